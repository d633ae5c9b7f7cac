"""References to a key in a Secret of the InferenceService's namespace: a token, an API key."""

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
    "Require `Authorization: Bearer <key>` on every endpoint but /health and /metrics, with the "
    "key from this Secret (passed as BERTH_API_KEY, never as an argument)."
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
