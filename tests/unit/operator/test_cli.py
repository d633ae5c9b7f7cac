"""`berth operator render` prints what the operator applies; `run` parses its flags."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from berth_common.cli import main as berth_main
from berth_operator import builders, cli
from berth_operator.spec import InferenceService

from .factories import REPO_ROOT, SAMPLES, load_yaml_docs

CPU_SAMPLE = next(p for p in SAMPLES if p.name.endswith("_cpu.yaml"))


def render(
    *files: str,
    image: str = "img:1",
    namespace: str | None = None,
    router_image: str = "router-img:1",
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.render(list(files), image, namespace, out, err, router_image=router_image)
    return code, out.getvalue(), err.getvalue()


def test_render_prints_exactly_the_builders_children() -> None:
    code, out, err = render(*(str(p) for p in SAMPLES))
    assert code == 0, err
    expected = []
    for path in SAMPLES:
        for doc in load_yaml_docs(path):
            expected += builders.build_children(
                InferenceService.from_body(doc, default_image="img:1", router_image="router-img:1")
            )
    assert list(yaml.safe_load_all(out)) == expected
    assert "ownerReferences" not in out  # nothing owns a rendered object yet


def test_render_uses_the_namespace_flag_and_the_default_image(tmp_path: Path) -> None:
    code, out, _ = render(str(CPU_SAMPLE), image="registry.local/berth:dev", namespace="team-b")
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    assert {d["metadata"]["namespace"] for d in docs} == {"team-b"}
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/berth:dev"


def test_routers_run_the_router_image_and_ranks_the_runtime_image() -> None:
    sample = next(
        p
        for p in SAMPLES
        if any(d.get("spec", {}).get("replicas", 1) > 1 for d in load_yaml_docs(p))
    )
    code, out, err = render(str(sample), image="reg/runtime:1", router_image="reg/router:1")
    assert code == 0, err
    images = {
        d["kind"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
        for d in yaml.safe_load_all(out)
        if d["kind"] in ("StatefulSet", "Deployment")
    }
    assert images == {"StatefulSet": "reg/runtime:1", "Deployment": "reg/router:1"}


def test_render_reports_every_problem_and_fails(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: serving.berth.dev/v1alpha1\nkind: InferenceService\n"
        "metadata: {name: chat}\nspec: {replicas: -1, routing: {policy: fastest}}\n"
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"
    )
    code, out, err = render(str(bad))
    assert code == 1
    assert out == ""
    assert "InferenceService chat: invalid spec" in err
    assert "spec.replicas: must be at least 0, got -1" in err
    assert "spec.routing.policy: 'fastest' is not one of" in err
    assert "skipping ConfigMap" in err


def test_render_missing_file_fails() -> None:
    code, _, err = render("/nonexistent/isvc.yaml")
    assert code == 1 and "No such file" in err


def test_berth_operator_render_through_the_berth_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert berth_main(["operator", "render", "-f", str(CPU_SAMPLE)]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds[:2] == ["Service", "StatefulSet"]
    assert kinds.count("Deployment") == 1 and "RoleBinding" in kinds  # the router, its account


def test_render_reads_stdin() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from berth_operator.cli import main; sys.exit(main())",
            "render",
            "-f",
            "-",
        ],
        input=CPU_SAMPLE.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": f"{REPO_ROOT / 'operator'}:{REPO_ROOT / 'runtime'}"},
    )
    assert result.returncode == 0, result.stderr
    assert "kind: StatefulSet" in result.stdout


def test_run_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        ["run", "-n", "team-a", "-n", "team-b", "--liveness", "http://0.0.0.0:8080/healthz"]
    )
    assert args.namespace == ["team-a", "team-b"] and not args.all_namespaces
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    dev = parser.parse_args(["run", "--dev"])
    assert dev.dev and dev.namespace == [] and dev.runtime_image.startswith("ghcr.io/")
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "-n", "a", "--all-namespaces"])
    with pytest.raises(SystemExit):
        parser.parse_args(["render"])  # -f is required


@pytest.mark.parametrize(
    ("argv", "clusterwide", "namespaces", "scanning_disabled", "standalone"),
    [
        (["run"], True, [], False, False),
        (["run", "--all-namespaces", "--standalone"], True, [], False, True),
        (["run", "-n", "team-a", "-n", "team-b"], False, ["team-a", "team-b"], True, False),
        (["run", "-n", "team-*"], False, ["team-*"], False, False),
        (["run", "--dev"], True, [], False, True),
    ],
)
def test_run_starts_kopf_with_the_right_scope(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    clusterwide: bool,
    namespaces: list[str],
    scanning_disabled: bool,
    standalone: bool,
) -> None:
    import kopf

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    assert (
        cli.main(
            [
                *argv,
                "--runtime-image",
                "img:2",
                "--router-image",
                "router:2",
                "--liveness",
                "http://0.0.0.0:8080/healthz",
            ]
        )
        == 0
    )
    (kwargs,) = calls
    assert kwargs["clusterwide"] is clusterwide
    assert kwargs["namespaces"] == namespaces
    assert kwargs["standalone"] is standalone
    assert kwargs["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert kwargs["settings"].scanning.disabled is scanning_disabled  # type: ignore[attr-defined]
    assert kwargs["memo"].default_image == "img:2"  # type: ignore[attr-defined]
    assert kwargs["memo"].router_image == "router:2"  # type: ignore[attr-defined]
