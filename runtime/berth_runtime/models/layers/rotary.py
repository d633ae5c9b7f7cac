"""Rotary position embeddings: the frequencies of each scaling scheme (default, linear, Llama 3,
YaRN, LongRoPE), a cos/sin table per position, and the rotate-half rotation over all or part of a
head."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings in one dict (transformers 5 `rope_parameters`, older configs'
    `rope_theta` and `rope_scaling`); `layer_type` picks a per-layer-type entry (Gemma 3)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return params


def rotary_dim(config, layer_type: str | None = None) -> int:
    """How many of each head's dimensions rotate (the rest pass through)."""
    factor = rope_parameters(config, layer_type).get("partial_rotary_factor") or 1.0
    return int(head_dim_of(config) * factor)


def rope_type_of(config, layer_type: str | None = None) -> str:
    params = rope_parameters(config, layer_type)
    return params.get("rope_type", params.get("type", "default"))


def rope_inv_freq(
    config, layer_type: str | None = None, long: bool = False
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the factor cos and sin are scaled by (YaRN's and
    LongRoPE's attention factor; 1 otherwise), as transformers computes them; `long`: LongRoPE's
    frequencies past the original context."""
    params = rope_parameters(config, layer_type)
    theta = params["rope_theta"]
    dim = rotary_dim(config, layer_type)
    # On the CPU explicitly, also under a `torch.device("meta")` context: meta's arange is a
    # Python decomposition whose first use imports torch._dynamo and Triton (45 MB, about 1 s).
    even = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (theta ** (even / dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params, config)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(theta, dim, params, config)
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope(theta, dim, params, config, long)
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} "
            "(supported: default, linear, llama3, yarn, longrope)"
        )
    return inv_freq.float(), attention_factor


def _original_max_positions(params: dict[str, Any], config) -> int:
    return int(
        params.get("original_max_position_embeddings")
        or getattr(config, "original_max_position_embeddings", None)
        or config.max_position_embeddings
    )


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any], config) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend
    between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = _original_max_positions(params, config)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, params: dict[str, Any], config) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies interpolated by `factor` below a ramp of dimensions,
    extrapolated above it, and cos/sin scaled by the attention factor."""
    original = _original_max_positions(params, config)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    # In fp32, as transformers computes it: YaRN's blend is sensitive to the last bit.
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(
    theta: float, dim: int, params: dict[str, Any], config, long: bool
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): each frequency divided by its own factor, the
    short ones within the original context, the long ones past it; cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original context))."""
    original = _original_max_positions(params, config)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    factors = torch.tensor(
        params["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu"
    )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (factors * theta**exponents), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table.

    LongRoPE keeps two tables: positions below the original context rotate with its short
    factors, positions past it with its long ones. That is how transformers decodes past the
    original context; its own prefill of a prompt longer than that rotates every position with
    the long factors, which a prefix cache shared between requests cannot do (a cached position
    must keep one rotation whatever the prompt it is reused in)."""

    def __init__(self, config, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.config, self.max_positions, self.layer_type = config, max_positions, layer_type
        inv_freq, attention_factor = rope_inv_freq(config, layer_type)
        self.rotary_dim = 2 * inv_freq.shape[0]
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        if rope_type_of(config, layer_type) == "longrope":
            original = _original_max_positions(rope_parameters(config, layer_type), config)
            long_freq, _ = rope_inv_freq(config, layer_type, long=True)
            long = torch.outer(t, long_freq)
            past = t >= original
            cos[past] = long.cos()[past] * attention_factor
            sin[past] = long.sin()[past] * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rebuild(self, device: torch.device) -> None:
        """Compute the tables again on `device` (a model built on the meta device has none)."""
        self.__init__(self.config, self.max_positions, self.layer_type)
        self.to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and signed sin of this step's positions over the rotary dims, [T, 1, rotary_dim];
        computed once per forward, read by every layer."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (
            torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
            torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype),
        )


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as
    x * cos + (x2, x1) * (-sin, sin): four kernels instead of seven, the same rounding."""
    cos, signed_sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin
