"""ModelSpec: which model to serve, where its weights come from (builtin, hf, pvc, file)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from berth_operator.spec.fields import (
    Report,
    Rule,
    number,
    obj,
    optional,
    quantity,
    spec_object,
    string,
)
from berth_operator.spec.formats import DNS1123_SUBDOMAIN
from berth_operator.spec.secret_refs import HfTokenSecretRef

ModelSource = Literal["builtin", "hf", "pvc", "file"]
SOURCES: tuple[ModelSource, ...] = ("builtin", "hf", "pvc", "file")

BUILTIN_MODELS = ("smollm2-135m-instruct",)
DEFAULT_BUILTIN_URI = "builtin://smollm2-135m-instruct"
HF_REPO = r"[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*"
MODEL_URI_PATTERN = (
    r"^(builtin://[a-z0-9][-a-z0-9.]*"
    rf"|hf://{HF_REPO}(/[^\s]+\.gguf)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|file:///[^\s]*)$"
)
_BUILTIN_URIS = [f"builtin://{m}" for m in BUILTIN_MODELS]


def _builtin_rule() -> Rule:
    known = (
        f"self.uri == '{_BUILTIN_URIS[0]}'"
        if len(_BUILTIN_URIS) == 1
        else "self.uri in [" + ", ".join(f"'{u}'" for u in _BUILTIN_URIS) + "]"
    )
    return Rule(
        f"!has(self.uri) || !self.uri.startsWith('builtin://') || {known}",
        f"the runtime embeds {', '.join(_BUILTIN_URIS)} only",
    )


def _hf_only(key: str) -> Rule:
    return Rule(
        f"!has(self.{key}) || (has(self.uri) && self.uri.startsWith('hf://'))",
        f"{key} applies to hf:// models only",
    )


@spec_object(
    "hf:// only. Where the download goes: an emptyDir (default, size-limited by sizeLimit) or a "
    "PersistentVolumeClaim that keeps the files across restarts, so a restarted rank does not "
    "download again."
)
@dataclass(frozen=True)
class ModelCache:
    claim_name: str | None = string(
        "A PersistentVolumeClaim to download into and serve from. With several ranks it must be "
        "ReadWriteMany (or all ranks must land on one node).",
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a PVC name",
    )
    size_limit: str | None = quantity(
        "Size limit of the emptyDir the weights are downloaded into (e.g. 40Gi)."
    )


@spec_object(
    "The model to serve and where its weights come from.",
    rules=(
        _builtin_rule(),
        _hf_only("revision"),
        _hf_only("hfTokenSecretRef"),
        _hf_only("cache"),
        Rule(
            "!has(self.cache) || !has(self.cache.claimName) || !has(self.cache.sizeLimit)",
            "set either cache.claimName or cache.sizeLimit, not both",
        ),
    ),
)
@dataclass(frozen=True)
class ModelSpec:
    uri: str = string(
        "Where the weights are. builtin://smollm2-135m-instruct is embedded in the runtime image "
        "(CPU-friendly, for trying things out). hf://ORG/REPO downloads a Hugging Face repository "
        "(safetensors) in an init container before the server starts; "
        "hf://ORG/REPO/PATH/FILE.gguf downloads one GGUF file. pvc://CLAIM/PATH mounts a "
        "PersistentVolumeClaim read-only and serves the directory (or .gguf file) at PATH in it. "
        "file:///PATH is a path inside the runtime image.",
        DEFAULT_BUILTIN_URI,
        max_length=512,
        pattern=MODEL_URI_PATTERN,
        what="a model URI",
        # The operator has always refused URIs over 253 characters (the CRD allows 512).
        operator_max_length=253,
    )
    served_name: str | None = string(
        'The name clients send as "model". Default: the repository id for hf://, '
        "smollm2-135m-instruct for the builtin model, the file or directory name otherwise.",
        max_length=256,
    )
    revision: str | None = string(
        "hf:// only. Branch, tag or commit to download (default main).", max_length=256
    )
    size_gib: float | None = number(
        "Approximate size of the weights in GiB. Sizes the startup probe so that a large model "
        "is not killed while it loads (default for hf://, pvc://, file://: 16).",
        json="sizeGiB",
        exclusive_minimum=0,
        maximum=4096,
    )
    hf_token: HfTokenSecretRef | None = optional(HfTokenSecretRef, json="hfTokenSecretRef")
    cache: ModelCache = obj(ModelCache)

    @property
    def source(self) -> ModelSource:
        scheme = self.uri.partition("://")[0]
        return next((s for s in SOURCES if s == scheme), "builtin")

    @property
    def _rest(self) -> str:
        return self.uri.partition("://")[2]

    @property
    def hf_repo(self) -> str | None:
        """hf://ORG/REPO[/FILE.gguf]: ORG/REPO."""
        return "/".join(self._rest.split("/", 2)[:2]) if self.source == "hf" else None

    @property
    def hf_file(self) -> str | None:
        """hf://ORG/REPO/FILE.gguf: FILE.gguf (None: the whole repository)."""
        parts = self._rest.split("/", 2)
        return parts[2] if self.source == "hf" and len(parts) > 2 else None

    @property
    def claim_name(self) -> str | None:
        """pvc://CLAIM/PATH: CLAIM."""
        return self._rest.partition("/")[0] if self.source == "pvc" else None

    @property
    def claim_path(self) -> str:
        """pvc://CLAIM/PATH: PATH, without surrounding slashes ("" for the claim's root)."""
        return self._rest.partition("/")[2].strip("/") if self.source == "pvc" else ""

    @property
    def local_path(self) -> str | None:
        """file:///PATH: /PATH."""
        return "/" + self._rest.lstrip("/") if self.source == "file" else None

    def check(self, report: Report) -> None:
        source, rest = self.source, self._rest
        if source == "builtin" and rest not in BUILTIN_MODELS:
            report(
                "uri",
                f"unknown builtin model {rest!r}; the runtime embeds " + ", ".join(_BUILTIN_URIS),
            )
        if source == "pvc" and ".." in rest.partition("/")[2].split("/"):
            report("uri", "a pvc:// path may not contain '..'")
        if source != "hf":
            for key, value in (
                ("revision", self.revision),
                ("hfTokenSecretRef", self.hf_token),
                ("cache", self.cache.claim_name or self.cache.size_limit),
            ):
                if value:
                    report(key, "applies to hf:// models only")
        if self.cache.claim_name and self.cache.size_limit:
            report("cache", "set either claimName (a PVC) or sizeLimit (an emptyDir), not both")
