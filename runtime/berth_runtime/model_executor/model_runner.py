"""ModelRunner: load the model and its KV pools, and run one ForwardBatch to logits."""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from berth_runtime.kernels import cpu as cpu_kernels
from berth_runtime.lora.manager import LoraManager
from berth_runtime.mem_cache.kv_pool import ReqToTokenPool, TokenToKVPool
from berth_runtime.model_executor import tensor_parallel
from berth_runtime.model_executor.cuda_graph_runner import DecodeGraphRunner
from berth_runtime.model_executor.device import (
    berth_cpu_problem,
    berth_cpu_required_by,
    resolve_device,
    triton_problem,
)
from berth_runtime.model_executor.forward_batch import DecodeLogits, ForwardBatch
from berth_runtime.model_executor.tp_worker import device_of, for_broadcast
from berth_runtime.models.dummy_weights import DEFAULT_INIT_STD, init_dummy_weights
from berth_runtime.models.gguf_q4 import can_run_int4
from berth_runtime.models.layers.linear import can_prepack_cpu_linears
from berth_runtime.models.layers.moe import SparseMoE
from berth_runtime.models.loader import Q4_GROUPS_FILE, default_cache_dir
from berth_runtime.models.registry import architecture_of, language_config, model_class
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils import cpu_isa

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV capacity on CPU without --max-total-tokens (on the embedded model about 0.38 GB in bf16, the
# default on CPUs with native bf16, and 0.75 GB in fp32).
DEFAULT_CPU_KV_TOKENS = 16384
# Fraction of free accelerator memory (after weights) given to the KV cache.
CUDA_KV_MEMORY_FRACTION = 0.85


@dataclass
class LoadProgress:
    """Where loading stands, for logs and /get_server_info; `report` is called at most twice a
    second while weights load, and once at the end."""

    tensors_done: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    report: Callable[[LoadProgress], None] | None = None
    _last_report: float = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        done = self.tensors_done == self.tensors_total
        if self.report is not None and (done or now - self._last_report >= 0.5):
            self._last_report = now
            self.report(self)

    def to_json(self) -> dict[str, int]:
        return {
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
        }


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA, and on CPUs with native bf16 (AVX512-BF16 / AMX), where bf16 weights
    (prepacked for oneDNN) and KV decode faster than fp32 at every batch size measured, batch 1
    included, and halve memory; fp32 on other CPUs, where bf16 would be emulated. bf16 on a CPU
    that cannot run it at all (AVX2 only) is a ValueError naming the way out."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype == "bfloat16" and device.type == "cpu":
        problem = cpu_isa.bf16_problem()
        if problem is not None:
            raise ValueError(f"--dtype bfloat16: {problem}")
    return _DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls in hardware rather than emulated (then slower than fp32);
    never under an AVX2 cap (`utils.cpu_isa`)."""
    native = cpu_isa.has_native_bf16()
    if native is not None:
        return native
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


class ModelRunner:
    """Owns the model weights, the KV pool and the request-to-slot table of one scheduler."""

    def __init__(
        self,
        model_path: str,
        args: ServerArgs,
        progress: LoadProgress | None = None,
        config: PretrainedConfig | None = None,
        tp: tensor_parallel.TPGroup | None = None,
    ) -> None:
        """Load `model_path` (a Hugging Face directory; `args.model` is its source) as `args`
        says: dtype, device, context length, KV capacity, batch slots, 4-bit weights, kernels;
        with --load-format dummy, random weights instead of its files'. `config`: its config,
        if read already. `tp`: this process's place among the rank's tensor-parallel processes
        (it holds its share of the weights and of the KV cache's heads)."""
        torch.manual_seed(args.random_seed)
        self.tp = tp or tensor_parallel.current()
        tensor_parallel.set_current(self.tp)  # read by the layers as they are built
        self.device = (
            device_of(args, self.tp.rank) if self.tp.size > 1 else resolve_device(args.device)
        )
        self.dtype = resolve_dtype(args.dtype, self.device)
        context_length = args.context_length
        self.config = language_config(config or AutoConfig.from_pretrained(model_path))
        arch = architecture_of(self.config)
        if arch is None:
            raise ValueError(f"unsupported architecture {self.config.architectures}")
        self.architecture = arch
        model_cls = model_class(arch)
        model_max = int(getattr(self.config, "max_position_embeddings", 4096))
        self.context_len = min(context_length, model_max) if context_length else model_max
        if context_length and context_length > model_max:
            logger.warning("--context-length %d exceeds the model's %d", context_length, model_max)
        self.vocab_size = int(self.config.vocab_size)

        start = time.perf_counter()
        with torch.device("meta"), _no_param_init():
            model = model_cls(self.config, max_positions=self.context_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        # Buffers (rotary tables) were on meta: rebuild them on the real device.
        model.rebuild_buffers(self.device)
        dummy = args.load_format == "dummy"
        if dummy:
            std = float(getattr(self.config, "initializer_range", DEFAULT_INIT_STD))
            init_dummy_weights(model, args.random_seed, std)
            logger.warning(
                "--load-format dummy: random weights (seed %d), answers are noise",
                args.random_seed,
            )
        else:
            model.load_weights(_iter_weights(model_path, progress))
        self.deterministic = args.enable_deterministic_inference
        self.speculative = args.speculative_algorithm != "none"
        self.attention_backend = self._enable_kernels(
            model, args.attention_backend, args.model_cache_dir
        )
        moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.moe_experts = None if not moe else "fused" if moe[0].fused else "grouped"
        # Berth's int8 kernel for quantized weights (loaded by _enable_kernels), where it runs.
        self.quant_kernel = cpu_kernels.quant_linear_available()
        self.quant_isa = cpu_kernels.quant_linear_isa()
        self.cpu_capability = cpu_kernels.cpu_capability() if self.device.type == "cpu" else None
        q4_rows = args.gguf_q4_max_batch
        if q4_rows is None:
            q4_rows = self._default_q4_rows(args)
        if self.tp.size > 1:
            q4_rows = 0  # the 4-bit groups and the 8-bit lm_head are whole-model copies
        if self.deterministic and q4_rows > 0:
            q4_rows = args.max_running_requests  # one weight format for every decode step
        self.gguf_q4_max_batch = q4_rows
        # A GGUF source's 4-bit groups are its real weights: never beside random ones.
        self.q4_kernel: str | None = None  # which CPU kernel runs them, set by _attach_q4
        self.q4_bytes = 0 if dummy else self._attach_q4(model, model_path, q4_rows)
        self.int8_lm_head_bytes = self._attach_int8_lm_head(model, q4_rows)
        # After the 4-bit weights: projections they run whole keep no bf16 copy.
        self.prepacked = can_prepack_cpu_linears(self.dtype, self.device)
        if self.prepacked:
            freed = model.prepack_cpu_linears()
            if freed > 0:
                logger.info(
                    "The 4-bit weights are the projections' only copy (%.0f MB freed)",
                    freed / 2**20,
                )
        # What the model holds in its own dtype (the 4-bit and 8-bit weights: q4_bytes and
        # int8_lm_head_bytes).
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # LoRA adapters: their hooks go on the projections (steps with adapter rows skip the
        # fused C++ decode step, which bypasses them; base-only steps still take it).
        self.lora: LoraManager | None = None
        if args.enable_lora:
            self.lora = LoraManager(
                args,
                model,
                self.device,
                packed=self.prepacked,
                triton=self.attention_backend == "triton",
            )
        # Needs berth_cpu (it checks itself), and the whole model: its C++ step has no collective.
        self.fused_decode = self.tp.size == 1 and model.enable_fused_decode()
        # Only SDPA reads an attention mask; paged kernels take each sequence's length.
        self.needs_attn_mask = model.layers[0].self_attn.paged_attention is None
        self.model = model.eval()
        self.load_time_s = time.perf_counter() - start

        attn = model.layers[0].self_attn
        self.num_layers = len(model.layers)
        kv_tokens = args.max_total_tokens or self._default_kv_tokens(
            attn.num_kv_heads, attn.head_dim
        )
        if self.tp.size > 1:  # process 0 hands out the slots: every process has as many
            agreed = torch.tensor([kv_tokens], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            kv_tokens = int(agreed.item())
        self.kv_pool = TokenToKVPool(
            kv_tokens, self.num_layers, attn.num_kv_heads, attn.head_dim, self.dtype, self.device
        )
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, self.context_len + 1, self.device
        )
        # CUDA graphs need attention with no host sync: Triton's reads K/V in place.
        self.graph_runner: DecodeGraphRunner | None = None
        graphs = self.attention_backend == "triton" and not args.disable_cuda_graph
        if self.tp.size > 1 or self.lora is not None:
            # Not captured yet with the collectives, nor with LoRA's per-step grouping of rows
            # by adapter: such steps run eagerly.
            graphs = False
        if graphs and self.device.type == "cuda" and not model.cuda_graphs:
            logger.info("%s steps run eagerly: its MoE layers group tokens on the host", arch)
            graphs = False
        if self.device.type == "cuda" and graphs:
            max_bs = min(
                args.cuda_graph_max_bs or args.max_running_requests, args.max_running_requests
            )
            self.graph_runner = DecodeGraphRunner(
                model, self.kv_pool, self.req_to_token_pool.req_to_token, max_bs, capture=True
            )
        logger.info(
            "Loaded %s (%s, %s on %s) in %.2fs; KV cache %d tokens (%.0f MB)",
            arch,
            model_path,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.load_time_s,
            kv_tokens,
            kv_tokens * self.kv_pool.bytes_per_token / 2**20,
        )

    def _default_q4_rows(self, args: ServerArgs) -> int:
        """Decode steps of at most this many sequences take a GGUF's 4-bit weights by default.
        In bf16: Berth's int8 kernel beats bf16 at every batch size measured (1-128 sequences),
        PyTorch's int4 kernel only up to about 8. In fp32: only where `auto` chose fp32 for a
        CPU without native bf16, and Berth's kernel runs (AVX2 or AVX-512); an explicit
        --dtype float32 computes every step in fp32, as HF fp32 on the dequantized weights."""
        if self.dtype == torch.bfloat16:
            return args.max_running_requests if self.quant_kernel else 8
        if self.dtype == torch.float32 and args.dtype == "auto" and self.quant_kernel:
            return args.max_running_requests
        return 0

    def _attach_q4(self, model, model_path: str, max_batch: int) -> int:
        """Small steps on the GGUF's own 4-bit weights, when the source kept them (see
        `gguf_q4`); returns the bytes this adds (0 when not used)."""
        groups_file = os.path.join(model_path, Q4_GROUPS_FILE)
        if max_batch <= 0 or not can_run_int4(self.dtype, self.device, self.quant_kernel):
            return 0
        if not os.path.isfile(groups_file):
            return 0
        self.q4_kernel = "berth_int8" if self.quant_kernel else "torch_int4"
        added = model.attach_int4(load_file(groups_file), max_batch, integer=self.quant_kernel)
        logger.info(
            "Steps of <= %d tokens use the GGUF's 4-bit weights (%.0f MB more, %s kernel)",
            max_batch,
            added / 2**20,
            self.q4_kernel,
        )
        return added

    def _attach_int8_lm_head(self, model, max_batch: int) -> int:
        """The lm_head of small CPU steps (those the 4-bit weights take) on an 8-bit copy run by
        Berth's integer kernel; returns the bytes this adds (0 when not used)."""
        usable = self.dtype in (torch.bfloat16, torch.float32) and self.device.type == "cpu"
        if max_batch <= 0 or not usable or not self.quant_kernel:
            return 0
        added = model.attach_int8_lm_head(max_batch)
        if added:
            logger.info(
                "Steps of <= %d rows rank the vocabulary on an 8-bit lm_head (%.0f MB more)",
                max_batch,
                added / 2**20,
            )
        return added

    def _enable_kernels(self, model, backend: str, cache_dir: str | None) -> str:
        """Resolve --attention-backend to `berth_cpu`, `triton` or `torch_native` and set the
        model up for it; an explicit backend that cannot run here is an error, auto falls back."""
        if backend == "torch_native":
            return "torch_native"
        if backend == "triton" or (backend == "auto" and self.device.type == "cuda"):
            return self._enable_triton(model, explicit=backend == "triton")
        required_by = berth_cpu_required_by(backend, self.deterministic, self.speculative)
        problem = berth_cpu_problem(self.device.type, str(self.dtype).removeprefix("torch."))
        if problem is not None:
            if required_by:
                raise ValueError(f"{required_by} {problem}")
            return "torch_native"
        try:
            cpu_kernels.load(Path(cache_dir) if cache_dir else default_cache_dir())
        except cpu_kernels.KernelBuildError as e:
            if required_by:
                raise ValueError(f"{required_by}: {e}") from e
            logger.warning("CPU kernels unavailable (%s); using torch_native attention", e)
            return "torch_native"
        attn = model.layers[0].self_attn
        attention = cpu_kernels.attention_supports(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if not attention:
            if self.deterministic or self.speculative:
                raise ValueError(
                    f"{required_by}: no kernel for {attn.num_heads} heads and "
                    f"{attn.num_kv_heads} KV heads of {attn.head_dim}"
                )
            logger.info("Attention shape not built into the CPU kernels; using SDPA")
        model.enable_cpu_kernels(attention=attention)
        return "berth_cpu"

    def _enable_triton(self, model, explicit: bool) -> str:
        """Triton paged attention (the default on CUDA) where it runs and has a kernel for the
        model's head dim and dtype; otherwise an error when asked for, else torch_native."""
        attn = model.layers[0].self_attn
        problem = triton_problem(self.device.type)
        if problem is None:
            from berth_runtime.kernels import triton_attention

            if attn.head_dim not in triton_attention.HEAD_DIMS:
                problem = f"has no kernel for head dim {attn.head_dim}"
            elif self.dtype not in triton_attention.DTYPES:
                problem = f"takes float32, bfloat16 or float16, not {self.dtype}"
        if problem is not None:
            if explicit:
                raise ValueError(f"--attention-backend triton {problem}")
            logger.warning("Triton attention %s; using torch_native", problem)
            return "torch_native"
        model.enable_triton_attention()
        return "triton"

    def _default_kv_tokens(self, num_kv_heads: int, head_dim: int) -> int:
        if self.device.type != "cuda":
            return max(DEFAULT_CPU_KV_TOKENS, self.context_len)
        free, _ = torch.cuda.mem_get_info(self.device)
        if self.lora is not None:
            free = max(0, free - self.lora.slots_nbytes())  # LoRA slots fill on demand
        per_token = 2 * self.num_layers * num_kv_heads * head_dim * self.dtype.itemsize
        return int(free * CUDA_KV_MEMORY_FRACTION / per_token)

    def decode_matches_prefill(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` sequences writes the K/V that a prefill of the
        same tokens would, bit for bit: the same weights (not the 4-bit ones) and attention that
        computes each token alone (`berth_cpu`; SDPA's rounding depends on the step's shape)."""
        return self.attention_backend == "berth_cpu" and not self._decode_on_int4(batch_size)

    def _decode_on_int4(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` sequences runs on the 4-bit weights."""
        return self.q4_bytes > 0 and batch_size <= self.gguf_q4_max_batch

    def verify_as_decode(self, sequences: int, rows: int) -> bool:
        """Whether a speculative verification of `rows` tokens of `sequences` sequences may run
        as a decode step of `rows` rows, bit for bit what the extend it replaces computes: the
        weights a decode step of `sequences` takes (4-bit or not), and attention that computes
        each token alone (`berth_cpu`)."""
        if self.attention_backend != "berth_cpu" or self.graph_runner is not None:
            return False
        return self._decode_on_int4(sequences) == self._decode_on_int4(rows)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every new token, [T, hidden]; with tensor parallelism, the
        other processes run the same pass on their shares (see `tp_worker`)."""
        if self.tp.size > 1:
            tensor_parallel.broadcast(("forward", for_broadcast(batch)))
        return self.model(batch, self.kv_pool)

    def forward_decode(
        self,
        input_ids: list[int] | torch.Tensor,
        cached_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
    ) -> DecodeLogits:
        """Scores [B, V] of a decode step (one new token after the `cached_lens[b]` tokens of
        each sequence): replayed from a CUDA graph, greedy tokens included, where one holds the
        batch, else run eagerly. New tokens still on the device (the previous step's, under the
        overlap scheduler) need a graph."""
        graphs = self.graph_runner
        if graphs is not None and len(input_ids) <= graphs.max_bs:
            return graphs.run(input_ids, cached_lens, out_cache_loc, req_rows)
        if isinstance(input_ids, torch.Tensor):
            raise ValueError("decode inputs on the device need a graph that holds the batch")
        batch = ForwardBatch.decode(
            input_ids,
            cached_lens,
            out_cache_loc,
            req_rows,
            self.req_to_token_pool.req_to_token,
            self.device,
            with_mask=self.needs_attn_mask,
        )
        return DecodeLogits(self.compute_logits(self.forward(batch)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 vocab scores [rows, V]; each row's leading candidates are exact (see
        `models.layers.logits.exact_top_logits`). With tensor parallelism every process scores
        its share of the vocabulary."""
        if self.tp.size > 1:
            tensor_parallel.broadcast(("logits", hidden.cpu()))
        return self.model.compute_logits(hidden)


@contextlib.contextmanager
def _no_param_init() -> Iterator[None]:
    """Layers built on the meta device skip their random init: it computes nothing there (the
    weights are loaded or drawn afterwards), and its first meta op imports torch._dynamo and
    Triton (about 45 MB of the scheduler's memory and 1 s of its start)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset  # type: ignore[method-assign]


def _iter_weights(model_path: str, progress: LoadProgress | None):
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if progress is not None:
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    piece = st.get_slice(name)
                    numel = math.prod(piece.get_shape())
                    progress.bytes_total += numel * _DTYPE_BYTES.get(piece.get_dtype(), 4)
                    progress.tensors_total += 1
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = st.get_tensor(name)
                if progress is not None:
                    progress.tensors_done += 1
                    progress.bytes_done += tensor.numel() * tensor.element_size()
                    progress.tick()
                yield name, tensor
