"""References to a key in a Secret of the InferenceService's namespace: a token, the API keys."""

from __future__ import annotations

from dataclasses import dataclass

from berth_operator.spec.fields import spec_object, string
from berth_operator.spec.formats import DNS1123_SUBDOMAIN, SECRET_KEY

SECRET_NAME = "Name of the Secret in the InferenceService's namespace."


@dataclass(frozen=True)
class SecretKeyRef:
    name: str = string(
        SECRET_NAME,
        required=True,
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a Secret name",
    )


@spec_object(
    "hf:// only. A Secret holding a Hugging Face token, for gated or private repositories."
)
@dataclass(frozen=True)
class HfTokenSecretRef(SecretKeyRef):
    key: str = string(
        "Key in the Secret that holds the token.",
        "token",
        max_length=253,
        operator_pattern=SECRET_KEY,
        what="a Secret key",
    )


@spec_object(
    "Require `Authorization: Bearer <key>` on every endpoint but /health, /metrics and "
    "/get_load, with the key from this Secret (mounted as a file, never an argument or an "
    "environment variable). Without adminApiKeySecretRef, this key cannot call the admin routes."
)
@dataclass(frozen=True)
class ApiKeySecretRef(SecretKeyRef):
    key: str = string(
        "Key in the Secret that holds the API key.",
        "api-key",
        max_length=253,
        operator_pattern=SECRET_KEY,
        what="a Secret key",
    )


@spec_object(
    "The admin key: the only key that may call the admin routes (/flush_cache, /abort_request "
    "with abort_all) of the ranks and the router; it also serves like the API key. From this "
    "Secret, mounted as a file. Without it, the admin routes are closed."
)
@dataclass(frozen=True)
class AdminApiKeySecretRef(SecretKeyRef):
    key: str = string(
        "Key in the Secret that holds the admin key.",
        "admin-api-key",
        max_length=253,
        operator_pattern=SECRET_KEY,
        what="a Secret key",
    )
