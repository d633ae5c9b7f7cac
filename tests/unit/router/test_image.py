"""The router's image stage: its own pins (the `router` extra), no torch, no engine, non-root."""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from tests.unit.operator.test_dockerfile import pins, requirements, stages


def copied(stage: str) -> set[str]:
    return set(re.findall(r"(?m)^COPY (\w+) /src/", stages()[stage]))


def test_router_pins_cover_and_satisfy_the_router_extra() -> None:
    pinned = pins(stages()["router-build"])
    for req in requirements("router"):
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in the router-build stage"
        assert req.specifier.contains(pinned[name], prereleases=True), req


def test_each_image_installs_its_own_package_and_common() -> None:
    assert copied("router-build") == {"common", "router"}
    assert copied("operator-build") == {"common", "operator"}
    # The operator runs its routers on the router image (--router-image): none in the runtime's.
    assert copied("runtime-build") == {"common", "runtime"}


def test_router_image_has_no_torch_and_runs_as_non_root() -> None:
    assert "torch" not in pins(stages()["router-build"])
    users = re.findall(r"(?m)^USER (\S+)", stages()["router"])
    assert users and users[-1].split(":")[0] == "10001"
    assert 'ENTRYPOINT ["berth", "router"]' in stages()["router"]
