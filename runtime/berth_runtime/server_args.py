"""ServerArgs: every knob of `berth serve`, with its default, validation and CLI flag."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from berth_common.auth import Keys, settle_keys
from berth_common.dataclass_cli import DataclassCli

# How `tool_choice: auto` reads tool calls in a model's text (entrypoints/tool_calls.py).
TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral")
# How a reasoning model's thinking is told from its answer (entrypoints/reasoning.py).
REASONING_PARSERS = ("qwen3", "deepseek-r1")

DEFAULT_PORT = 30000
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"
BUILTIN_MODEL = "builtin://smollm2-135m-instruct"


@dataclass(frozen=True, kw_only=True)
class ServerArgs(DataclassCli):
    """The runtime's configuration; the operator renders exactly these flags."""

    # Model
    model: str = field(
        default=BUILTIN_MODEL,
        metadata={
            "help": "Model to serve: builtin://smollm2-135m-instruct (the embedded default), "
            "a Hugging Face directory (config.json + *.safetensors + tokenizer), or a .gguf file."
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "Name clients pass as `model` "
            "(default: the builtin name or the path's basename)."
        },
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={
            "help": "Weight, activation and KV cache dtype; auto = bfloat16 on CUDA and on CPUs "
            "with native bf16 (AVX512-BF16/AMX), float32 on other CPUs (with a GGUF source's "
            "4-bit weights for decode steps). bfloat16 on a CPU that cannot run it (AVX2 only) "
            "is refused at start-up."
        },
    )
    load_format: Literal["auto", "dummy"] = field(
        default="auto",
        metadata={
            "help": "auto: the weights from the model's files. dummy: random weights of the "
            "shapes its config.json gives, seeded by --random-seed (no *.safetensors needed; "
            "the tokenizer files still are), for benchmarks and capacity tests of large models "
            "without downloading them: the answers are noise."
        },
    )
    gguf_q4_max_batch: int | None = field(
        default=None,
        metadata={
            "help": "On CPU, run decode steps of at most this many sequences with a GGUF "
            "source's own 4-bit Q4_0/Q4_1 projection weights (a quarter of the bytes; prefill "
            "and larger decode steps use the bf16 or fp32 weights); 0 turns it off. Default in "
            "bfloat16: every decode step where Berth's int8 kernel runs (AVX2 or AVX-512), else "
            "8 (PyTorch's int4 kernel); in float32: every decode step where --dtype auto chose "
            "float32 and Berth's kernel runs, else 0 (an explicit float32 stays fp32 throughout)."
        },
    )
    attention_backend: Literal["auto", "torch_native", "berth_cpu", "triton"] = field(
        default="auto",
        metadata={
            "help": "Kernels for attention and RMSNorm. berth_cpu: Berth's C++ CPU kernels, "
            "built once on first start and cached (attention reads K/V in place through slot "
            "indices, each token alone, in prefill and decode; fused RMSNorm; exact top logits); "
            "needs a C++ compiler. triton: Berth's Triton paged attention for CUDA (K/V read in "
            "place through slot indices; CPU tensors only under TRITON_INTERPRET=1, for tests). "
            "torch_native: eager PyTorch (a K/V gather + SDPA), any device. auto = berth_cpu on "
            "CPU when the kernels build there (else torch_native, with a warning), triton on "
            "CUDA (torch_native where Triton or the head dim is missing)."
        },
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata={
            "help": "On CUDA, run decode steps eagerly instead of replaying CUDA graphs captured "
            "at start-up (one per batch-size bucket: 1, 2, 4, 8, then steps of 8)."
        },
    )
    cuda_graph_max_bs: int | None = field(
        default=None,
        metadata={
            "help": "Largest decode batch replayed from a CUDA graph; larger ones run eagerly "
            "(default: --max-running-requests)."
        },
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata={
            "help": "With CUDA graphs, a decode step of plain greedy requests is launched before "
            "the previous step's tokens are read back (they feed it on the device), so the host "
            "streams and checks one step's tokens while the GPU runs the next (SGLang's overlap "
            "scheduler). This flag reads each step's tokens before launching the next."
        },
    )
    enable_deterministic_inference: bool = field(
        default=False,
        metadata={
            "help": "A request's greedy output does not depend on what else runs in its batch "
            "(SGLang's flag): every decode step, whatever its size, runs on one weight format "
            "(the GGUF's 4-bit weights while --gguf-q4-max-batch > 0, else bf16), and attention "
            "computes each sequence alone (berth_cpu). CPU only. Costs throughput at high "
            "concurrency: see the README."
        },
    )
    speculative_algorithm: Literal["none", "ngram"] = field(
        default="none",
        metadata={
            "help": "ngram: speculative decoding without a draft model. A greedy request's draft "
            "is what followed the latest earlier occurrence of its last tokens (prompt lookup); "
            "one forward pass verifies it and keeps what greedy decoding would have produced "
            "itself, token for token. Applies to decode steps of at most "
            "--speculative-max-batch greedy requests (no logprobs, penalties, bias or grammar). "
            "CPU only, with the berth_cpu attention backend."
        },
    )
    speculative_num_draft_tokens: int = field(
        default=5,
        metadata={
            "help": "ngram: most draft tokens verified per request and step (on Berth's int8 "
            "kernel a step of up to eight rows reads the 4-bit weights once, so rows are nearly "
            "free; with PyTorch's int4 kernel four rows cost about 1.35x one, five 1.8x)."
        },
    )
    speculative_max_batch: int = field(
        default=1,
        metadata={
            "help": "ngram: speculate only in decode steps of at most this many requests, where "
            "verifying several tokens costs little more than decoding one."
        },
    )
    grammar_backend: Literal["xgrammar", "none"] = field(
        default="xgrammar",
        metadata={
            "help": "Engine for constrained decoding (response_format json_schema/json_object, "
            "tool_choice required or named, /generate's json_schema, regex and ebnf). none: "
            "refuse such requests with a 400."
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "How to read tool calls in the model's text when tool_choice is auto: hermes "
            "(Hermes, Qwen 2.5/3: <tool_call>...</tool_call>), llama3 (Llama 3.x JSON) or "
            "mistral ([TOOL_CALLS]); none: auto answers text. Unset: the format the model's chat "
            "template teaches, if any. tool_choice required or a named function needs none."
        },
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "Split a reasoning model's thinking (<think>...</think>) from its answer: "
            "qwen3 (Qwen3, QwQ) or deepseek-r1. Chat completions then return it as "
            "reasoning_content, the Responses API as a reasoning item. Unset: all is content."
        },
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata={"help": "Device to run the model on; auto = cuda if available."}
    )
    context_length: int | None = field(
        default=None,
        metadata={"help": "Maximum prompt + output tokens per request (default: the model's)."},
    )
    model_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where converted GGUF models are cached "
            "(default: $BERTH_CACHE_DIR or ~/.cache/berth)."
        },
    )
    random_seed: int = field(
        default=0, metadata={"help": "Seed for sampling without a request seed."}
    )

    # HTTP
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=DEFAULT_PORT, metadata={"help": "Port to listen on."})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Require `Authorization: Bearer <key>` on every endpoint "
            "but /health, /metrics and /get_load (default: $BERTH_API_KEY if set)."
        },
    )
    api_key_file: str | None = field(
        default=None,
        metadata={"help": "Read --api-key from this file (a mounted Secret), once at start."},
    )
    admin_api_key: str | None = field(
        default=None,
        metadata={
            "help": "The key for admin routes (/flush_cache, /abort_request with abort_all); "
            "the serving key cannot call them (default: $BERTH_ADMIN_API_KEY if set)."
        },
    )
    admin_api_key_file: str | None = field(
        default=None,
        metadata={"help": "Read --admin-api-key from this file, once at start."},
    )
    max_sequences_per_request: int = field(
        default=128,
        metadata={
            "help": "Most sequences one request may ask for: `n` times its prompts, or a "
            "/generate batch (OpenAI caps `n` at 128)."
        },
    )
    max_stored_responses: int = field(
        default=1000,
        metadata={
            "help": "Responses API: how many responses this server keeps in memory for "
            "previous_response_id and GET /v1/responses/{id} (the oldest go first; 0 keeps "
            "none)."
        },
    )
    graceful_shutdown_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds to let in-flight requests finish after SIGTERM."},
    )
    max_request_body_mb: float | None = field(
        default=None,
        metadata={
            "help": "Largest request body accepted, in MiB; larger ones get 413 before they are "
            "read (default: 64 bytes per token of context, at least 4 MiB)."
        },
    )

    # Scheduler and memory
    max_running_requests: int = field(
        default=64, metadata={"help": "Maximum requests decoded together in one batch."}
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata={"help": "KV cache capacity in tokens (default: sized from memory)."},
    )
    max_prefill_tokens: int = field(
        default=4096, metadata={"help": "Maximum new prompt tokens prefilled in one step."}
    )
    chunked_prefill_size: int = field(
        default=512,
        metadata={"help": "Prefill long prompts in chunks of this many tokens (<= 0 disables)."},
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata={
            "help": "Maximum waiting requests; beyond it new requests get 503 (default: unbounded)."
        },
    )
    schedule_policy: Literal["fcfs", "lpm", "priority"] = field(
        default="fcfs", metadata={"help": "Order in which waiting requests are admitted."}
    )
    disable_radix_cache: bool = field(
        default=False, metadata={"help": "Do not share cached prompt prefixes across requests."}
    )
    tp_size: int = field(
        default=1,
        metadata={
            "help": "Tensor parallelism: split the model over this many processes, one per GPU "
            "(attention heads, MLP columns, the vocabulary; gloo on CPU, for tests)."
        },
    )

    # LoRA adapters
    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "Serve LoRA adapters beside the base model: requests pick one by `model` "
            "(NAME or BASE:NAME) or /generate's `lora_path`; /load_lora_adapter and "
            "/unload_lora_adapter (admin key) change them at run time. Implied by --lora-paths."
        },
    )
    lora_paths: tuple[str, ...] = field(
        default=(),
        metadata={
            "nargs": "*",
            "help": "Adapters to load at start: NAME=PATH (a PEFT adapter directory: "
            "adapter_config.json and adapter_model.safetensors), or PATH (named by its last "
            "directory).",
        },
    )
    max_loras_per_batch: int = field(
        default=8,
        metadata={
            "help": "Adapters one batch may mix: the device slots adapters are copied into from "
            "host memory (least recently used first out); requests for another adapter wait."
        },
    )
    max_loaded_loras: int | None = field(
        default=None,
        metadata={"help": "Most adapters held in host memory at once (default: unbounded)."},
    )
    max_lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "Highest adapter rank accepted (default: the largest of --lora-paths', and "
            "at least 16)."
        },
    )

    watchdog_timeout: float = field(
        default=60.0,
        metadata={
            "help": "Exit non-zero when the engine's heartbeat has stopped this many seconds (a "
            "wedged scheduler or detokenizer), or one step has run this long, so the pod "
            "restarts; /health turns 503 after 5 s without a heartbeat or a step running."
        },
    )

    # Data parallelism and observability
    dp_rank: int | None = field(
        default=None,
        metadata={"help": "This server's data-parallel rank (a label on metrics and responses)."},
    )
    log_level: Literal["debug", "info", "warning", "error"] = field(
        default="info", metadata={"help": "Log level of every process."}
    )

    def __post_init__(self) -> None:
        def positive(name: str, value: float | None) -> None:
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

        for name in ("port", "max_running_requests", "max_prefill_tokens", "tp_size"):
            positive(name, getattr(self, name))
        for name in (
            "max_loras_per_batch",
            "max_loaded_loras",
            "max_lora_rank",
            "context_length",
            "max_total_tokens",
            "max_queued_requests",
            "max_request_body_mb",
            "cuda_graph_max_bs",
        ):
            positive(name, getattr(self, name))
        if self.tool_call_parser not in (None, "none", *TOOL_CALL_PARSERS):
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)} or none, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.gguf_q4_max_batch is not None and self.gguf_q4_max_batch < 0:
            raise ValueError(f"--gguf-q4-max-batch must be >= 0, got {self.gguf_q4_max_batch}")
        if self.speculative_algorithm != "none":
            if self.device == "cuda":
                raise ValueError("--speculative-algorithm ngram runs on CPU only for now")
            if self.attention_backend in ("torch_native", "triton"):
                raise ValueError(
                    "--speculative-algorithm ngram needs the berth_cpu attention backend: "
                    "verification must compute each token as decoding does"
                )
            positive("speculative_num_draft_tokens", self.speculative_num_draft_tokens)
            positive("speculative_max_batch", self.speculative_max_batch)
        if self.enable_deterministic_inference and self.device == "cuda":
            raise ValueError("--enable-deterministic-inference runs on CPU only, not --device cuda")
        if self.enable_deterministic_inference and self.attention_backend in (
            "torch_native",
            "triton",
        ):
            raise ValueError(
                "--enable-deterministic-inference needs the berth_cpu attention backend: "
                "torch_native's rounding depends on the batch's shape"
            )
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        if self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout must be positive")
        if self.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
        if self.max_sequences_per_request < 1:
            raise ValueError("--max-sequences-per-request must be >= 1")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.dp_rank is not None and self.dp_rank < 0:
            raise ValueError(f"--dp-rank must be >= 0, got {self.dp_rank}")
        settle_keys(self)

    @property
    def keys(self) -> Keys:
        return Keys(self.api_key, self.admin_api_key)

    @property
    def model_name(self) -> str:
        """The name clients must send as `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model == BUILTIN_MODEL:
            return DEFAULT_SERVED_NAME
        base = os.path.basename(os.path.normpath(self.model))
        return base.removesuffix(".gguf")


MIN_REQUEST_BODY_BYTES = 4 * 2**20
REQUEST_BODY_BYTES_PER_TOKEN = 64


def max_request_body_bytes(args: ServerArgs, context_len: int) -> int:
    """--max-request-body-mb, or by default room for a full context of JSON-escaped text (a token
    is a few characters; an escaped one up to six bytes each) and the request's other fields."""
    if args.max_request_body_mb is not None:
        return int(args.max_request_body_mb * 2**20)
    return max(MIN_REQUEST_BODY_BYTES, REQUEST_BODY_BYTES_PER_TOKEN * context_len)
