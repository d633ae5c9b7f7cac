"""Who may call what: the serving key, the admin key, and keys read from files."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth_common.auth import ADMIN, USER, Keys, resolve_key


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_roles_by_key() -> None:
    assert Keys().role(b"") == ADMIN  # no key configured: a laptop, everything open
    both = Keys("serve", "admin")
    assert both.role(bearer("admin")) == ADMIN
    assert both.role(bearer("serve")) == USER
    assert both.role(bearer("other")) is None and both.role(b"") is None
    serving_only = Keys("serve", None)
    assert serving_only.role(bearer("serve")) == USER  # never admin: admin routes stay closed
    assert "--admin-api-key" in serving_only.admin_refusal()
    admin_only = Keys(None, "admin")
    assert admin_only.role(b"") == USER and admin_only.role(bearer("admin")) == ADMIN


def test_keys_from_flag_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "key"
    secret.write_text("from-file\n")
    monkeypatch.setenv("BERTH_API_KEY", "from-env")
    assert resolve_key("api-key", None, str(secret), "BERTH_API_KEY") == "from-file"
    assert resolve_key("api-key", "from-flag", None, "BERTH_API_KEY") == "from-flag"
    assert resolve_key("api-key", None, None, "BERTH_API_KEY") == "from-env"
    monkeypatch.delenv("BERTH_API_KEY")
    assert resolve_key("api-key", None, None, "BERTH_API_KEY") is None
    with pytest.raises(ValueError, match="exclusive"):
        resolve_key("api-key", "x", str(secret), "BERTH_API_KEY")
    with pytest.raises(ValueError, match="--admin-api-key-file .*missing"):
        resolve_key("admin-api-key", None, str(tmp_path / "missing"), "X")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_key("api-key", None, str(tmp_path / "empty"), "X")
