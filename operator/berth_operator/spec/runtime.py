"""RuntimeSpec: the runtime image, its `berth serve` flags and environment, start and stop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from berth_operator import constants
from berth_operator.spec.fields import (
    Report,
    Rule,
    String,
    array,
    boolean,
    enum,
    integer,
    obj,
    pass_through,
    spec_object,
    string,
)
from berth_operator.spec.formats import DNS1123_SUBDOMAIN, ENV_NAME

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")
LOG_LEVELS = ("debug", "info", "warning", "error")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
GRAMMAR_BACKENDS = ("xgrammar", "none")
TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "none")
REASONING_PARSERS = ("qwen3", "deepseek-r1")

# Flags the operator renders itself; `runtime.extraArgs` may not repeat or override them.
MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--admin-api-key",
    "--admin-api-key-file",
    "--dp-rank",
    "--tp-size",
    "--model-cache-dir",
    "--graceful-shutdown-timeout",
)
# Environment variables the operator sets on the runtime container; `runtime.env` may not repeat
# them (a container's env is a list keyed by name: a repeat is a duplicate key, not an override).
SET_ENV = (
    constants.ENV_DP_RANK,
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
)
# ...and the ones the runtime would read keys from: keys come from the spec's Secret references.
MANAGED_ENV = (constants.ENV_API_KEY, constants.ENV_ADMIN_API_KEY, *SET_ENV)


@spec_object("`berth serve` settings; an unset field keeps the runtime's default.")
@dataclass(frozen=True)
class RuntimeArgs:
    dtype: str | None = enum(
        "Weight and activation dtype (auto = bfloat16 on CUDA and on CPUs with native bf16 "
        "(AVX512-BF16 or AMX), else float32).",
        DTYPES,
    )
    device: str | None = enum("Device to run on (auto = cuda when the pod has a GPU).", DEVICES)
    context_length: int | None = integer(
        "Maximum prompt + output tokens per request (default the model's).", minimum=1
    )
    max_running_requests: int | None = integer(
        "Maximum requests decoded together in one batch.", minimum=1
    )
    max_total_tokens: int | None = integer(
        "KV cache capacity in tokens (default sized from memory).", minimum=1
    )
    max_prefill_tokens: int | None = integer(
        "Maximum new prompt tokens prefilled in one step.", minimum=1
    )
    chunked_prefill_size: int | None = integer(
        "Prefill long prompts in chunks of this many tokens (0 or less disables)."
    )
    max_queued_requests: int | None = integer(
        "Maximum waiting requests per rank; beyond it requests get 503.", minimum=1
    )
    schedule_policy: str | None = enum(
        "Order in which waiting requests are admitted.", SCHEDULE_POLICIES
    )
    disable_radix_cache: bool = boolean(
        "Do not share cached prompt prefixes across requests.", False, schema_default=False
    )
    log_level: str | None = enum("Log level of every runtime process.", LOG_LEVELS)
    grammar_backend: str | None = enum(
        "Engine for constrained decoding: response_format json_schema / json_object, "
        "tool_choice required or a named function, /generate's json_schema, regex and ebnf "
        "(default xgrammar; none refuses such requests with a 400).",
        GRAMMAR_BACKENDS,
    )
    tool_call_parser: str | None = enum(
        "How tool calls are read out of the model's text when tool_choice is auto: hermes "
        "(Hermes, Qwen 2.5/3), llama3 (Llama 3.x JSON) or mistral ([TOOL_CALLS]); none: auto "
        "answers text. Unset: the format the model's chat template teaches, if any.",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = enum(
        "Split a reasoning model's thinking (<think>...</think>) from its answer: qwen3 (Qwen3, "
        "QwQ) or deepseek-r1; it is returned as reasoning_content (chat) or a reasoning item "
        "(Responses API). Unset: all is content.",
        REASONING_PARSERS,
    )


@spec_object("A reference to a docker-registry Secret in the same namespace.")
@dataclass(frozen=True)
class PullSecret:
    name: str = string(
        "Name of the Secret.",
        required=True,
        max_length=253,
        operator_pattern=DNS1123_SUBDOMAIN,
        what="a Secret name",
    )


def _managed_env_list() -> str:
    return ", ".join(f"'{name}'" for name in MANAGED_ENV)


@spec_object(
    "An environment variable, as in a Pod's container.",
    rules=(
        Rule(
            "!(has(self.value) && has(self.valueFrom))", "set either value or valueFrom, not both"
        ),
        Rule(
            f"!(self.name in [{_managed_env_list()}])",
            f"{', '.join(MANAGED_ENV[:-1])} and {MANAGED_ENV[-1]} are set by the operator "
            "(for the keys use apiKeySecretRef and adminApiKeySecretRef)",
        ),
    ),
)
@dataclass(frozen=True)
class EnvVar:
    name: str = string(
        "Name of the variable.",
        required=True,
        max_length=256,
        # The operator has always refused names over 253 characters (the CRD allows 256).
        operator_max_length=253,
        operator_pattern=ENV_NAME,
        what="an environment variable name",
    )
    value: str | None = string("Literal value.", operator_max_length=253)
    value_from: dict[str, Any] | None = pass_through(
        "Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), as in "
        "a Pod; checked strictly by the API server when the operator applies the ranks (a "
        "misspelt key is an InvalidSpec)."
    )

    def check(self, report: Report) -> None:
        if self.name in MANAGED_ENV:
            report("name", f"{self.name} is set by the operator")
        if self.value is not None and self.value_from is not None:
            report("value", "set either value or valueFrom, not both")


def _one_secret_each(secret: dict[str, Any], kept: list[dict[str, Any]], report: Report) -> bool:
    if secret in kept:
        report("name", f"duplicate entry {secret['name']!r}: each Secret once")
        return False
    return True


def _one_variable_each(var: dict[str, Any], kept: list[dict[str, Any]], report: Report) -> bool:
    if any(e["name"] == var["name"] for e in kept):
        report("name", f"duplicate entry {var['name']!r}: each variable once")
        return False
    return True


def _no_managed_flag(arg: str, kept: list[str], report: Report) -> bool:
    managed = managed_flag(arg)
    if managed:
        flag = arg.split("=", 1)[0]
        named = managed if flag == managed else f"{flag} (read as {managed})"
        report(
            None,
            f"{named} is set by the operator; use the matching spec field instead "
            "(model.uri, model.servedName, apiKeySecretRef, adminApiKeySecretRef, "
            "runtime.gracefulShutdownSeconds, "
            "parallelism.tensor)",
        )
    return True


def managed_flag(arg: str) -> str | None:
    """The operator-owned flag `arg` names, if any (argparse also accepts unique prefixes)."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--") or len(flag) < 4:
        return None
    return next((m for m in MANAGED_FLAGS if m.startswith(flag)), None)


@spec_object("The runtime image, its `berth serve` arguments, and how ranks start and stop.")
@dataclass(frozen=True)
class RuntimeSpec:
    image: str = string(
        "Runtime image for the ranks and the router (default set by the operator, "
        "--runtime-image).",
        constants.DEFAULT_RUNTIME_IMAGE,
        schema_default=False,  # the operator's --runtime-image, resolved when the spec is read
        max_length=512,
        operator_min_length=1,
    )
    image_pull_policy: str = enum("When to pull the image.", PULL_POLICIES, "IfNotPresent")
    image_pull_secrets: tuple[dict[str, Any], ...] = array(
        "Secrets for pulling the image from a private registry (each once).",
        PullSecret,
        max_items=8,
        map_keys=("name",),
        each=_one_secret_each,
    )
    args: RuntimeArgs = obj(RuntimeArgs)
    graceful_shutdown_seconds: int = integer(
        "How long a stopping rank keeps serving its in-flight requests and streams after SIGTERM "
        "(--graceful-shutdown-timeout). The pod's termination grace period is "
        "preStopSleepSeconds + this + 15.",
        60,
        minimum=0,
        maximum=3600,
    )
    pre_stop_sleep_seconds: int = integer(
        "Pause before SIGTERM so that Services and the router stop sending new requests to a "
        "stopping rank first.",
        10,
        minimum=0,
        maximum=300,
    )
    startup_timeout_seconds: int | None = integer(
        "How long a rank may take from start to ready before it is restarted. Default: derived "
        "from the model's source and model.sizeGiB (at least 300).",
        minimum=30,
        maximum=86400,
    )
    extra_args: tuple[str, ...] = array(
        "More `berth serve` flags, appended as given. Flags the operator sets itself (--model, "
        "--port, --dp-rank, ...) are refused.",
        String("One command-line argument.", max_length=1024),
        max_items=64,
        each=_no_managed_flag,
    )
    env: tuple[dict[str, Any], ...] = array(
        "Extra environment variables for the runtime container, each name once. Names the "
        f"operator sets itself ({', '.join(MANAGED_ENV)}) are refused.",
        EnvVar,
        max_items=64,
        map_keys=("name",),
        each=_one_variable_each,
    )
