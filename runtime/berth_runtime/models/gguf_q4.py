"""Read a GGUF file's 4-bit projection weights (Q4_0, Q4_1) as groups of codes, scales and zeros.

A Q4 block holds 32 weights of one output row: w = d * q + m (Q4_1) or d * (q - 8) (Q4_0), with
q in 0..15. Kept in that form, a decode step on CPU reads a quarter of the bytes of bf16 weights;
at one to a few rows per step the projections are memory-bound, so this is what makes
single-stream decode fast (`Int4Weight`, attached by `models/llama.py`). The groups are stored in
torch's int4 convention, w = (q - 8) * scale + zero, which both formats convert to exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GROUP_SIZE = 32
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_q4_groups(gguf_path: Path) -> dict[str, torch.Tensor]:
    """Every Q4_0/Q4_1 projection of `gguf_path`, by Hugging Face name: `{name}.codes` (uint8
    [N, K/2], two codes a byte, low nibble first), `{name}.scales` and `{name}.zeros` (float32
    [N, K/32]). Other tensors (norms, the Q8_0 embedding) are not included."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    types = gguf.GGMLQuantizationType
    arch = _field(reader, "general.architecture")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or num_heads
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_TO_HF:
            continue
        if tensor.tensor_type not in (types.Q4_0, types.Q4_1):
            continue
        blocks = np.asarray(tensor.data)  # [N, K/32 * block bytes]
        rows = blocks.shape[0]
        blocks = blocks.reshape(rows, -1, 18 if tensor.tensor_type == types.Q4_0 else 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if tensor.tensor_type == types.Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            packed = blocks[..., 4:]
            zeros = m + 8.0 * d  # d*q + m == (q - 8)*d + (m + 8d)
        else:
            packed = blocks[..., 2:]
            zeros = np.zeros_like(d)
        codes = _ggml_codes(packed)  # [N, K/32, 32]
        hf = f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight"
        # llama.cpp's converter permutes the rows of q/k of llama models for its rotary layout;
        # undo it as transformers does for the dequantized weights, so rows match the HF ones.
        if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[2] == "attn_q" else num_kv_heads
            order = _unpermute_rows(rows, heads)
            codes, d, zeros = codes[order], d[order], zeros[order]
        flat = codes.reshape(rows, -1)
        out[f"{hf}.codes"] = torch.from_numpy(flat[:, 0::2] | (flat[:, 1::2] << 4))
        out[f"{hf}.scales"] = torch.from_numpy(np.ascontiguousarray(d))
        out[f"{hf}.zeros"] = torch.from_numpy(np.ascontiguousarray(zeros))
    return out


def matching_groups(
    groups: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The groups whose dequantized weight equals `reference` (the weights transformers
    dequantized from the same file): a layout this reader gets wrong is dropped, not served."""
    kept: dict[str, torch.Tensor] = {}
    for name in [key.removesuffix(".codes") for key in groups if key.endswith(".codes")]:
        fields = [groups[f"{name}.{field}"] for field in ("codes", "scales", "zeros")]
        ref = reference.get(name)
        if ref is not None and torch.allclose(dequantize(*fields), ref.float(), atol=1e-6):
            kept.update({f"{name}.{f}": t for f, t in zip(("codes", "scales", "zeros"), fields)})
    return kept


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == np.uint8 else int(value[0])


def _ggml_codes(packed: np.ndarray) -> np.ndarray:
    """ggml packs a block's 32 codes as 16 bytes: low nibbles are codes 0-15, high 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' `_reverse_permute_weights` produces, as indices."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (two codes a byte) -> int32 [N, K]."""
    low, high = codes & 0x0F, codes >> 4
    return torch.stack((low, high), dim=-1).reshape(codes.shape[0], -1).to(torch.int32)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the groups stand for (tests and checks)."""
    q = unpack_codes(codes).float().view(codes.shape[0], -1, GROUP_SIZE)
    return ((q - 8) * scales[..., None] + zeros[..., None]).reshape(codes.shape[0], -1)


def pack_q4_vnni(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups in `torch.ops.berth.quant_linear`'s 4-bit layout (see kernels/quant_linear.cpp):
    output rows in groups of 16, one SIMD lane each; per block of 32, four 64-byte chunks, chunk c
    holding each row's codes of k = 8c..8c+3 in its low nibbles and 8c+4..8c+7 in its high ones;
    then the fp16 scale d and offset m of w = d * q + m, per lane. The GGUF's fp16 d and m survive
    the round trip exactly (checked by `dequantize_q4_vnni` in the tests)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"quant_linear needs N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    q = unpack_codes(codes).to(torch.uint8).view(n // 16, 16, k // 32, 4, 2, 4)
    q = q.permute(0, 2, 3, 1, 5, 4)  # [group, block, chunk, lane, byte, nibble]
    packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
    offsets = zeros - 8 * scales  # torch's (q - 8) * scale + zero is d * q + m
    pairs = torch.stack((scales, offsets), dim=-1).view(n // 16, 16, k // 32, 2)
    return packed, pairs.permute(0, 2, 3, 1).contiguous().to(torch.float16)


def dequantize_q4_vnni(packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a `pack_q4_vnni` layout stands for (tests)."""
    groups, blocks = packed.shape[:2]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [g, b, c, lane, byte, nibble]
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(groups * 16, blocks, 32).float()
    d, m = pairs.float().permute(0, 3, 1, 2).reshape(groups * 16, blocks, 2).unbind(-1)
    return (q * d[..., None] + m[..., None]).reshape(groups * 16, blocks * 32)


def can_run_int4(dtype: torch.dtype, device: torch.device, integer: bool = False) -> bool:
    """Whether a CPU step in `dtype` can run on 4-bit weights: Berth's int8 kernel (`integer`,
    where it runs) takes bf16 or fp32 activations, torch's int4 kernel bf16 with bf16 scales."""
    if device.type != "cpu":
        return False
    if integer:
        return dtype in (torch.bfloat16, torch.float32)
    return (
        dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
    )


class Int4Weight:
    """One projection's 4-bit weight, packed for one of two CPU kernels: Berth's
    `torch.ops.berth.quant_linear` (int8 activations on integer dot products, as llama.cpp runs
    these blocks; `integer=True`, where `kernels.cpu.quant_linear_available()`), or else PyTorch's
    `_weight_int4pack_mm_for_cpu` (bf16 activations, the scales rounded to bf16). `packed` and
    `scales_and_zeros` are the kernel's two weight tensors; `decode_layers` tells them apart by
    rank."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        max_rows: int,
        integer: bool = False,
    ) -> None:
        self.max_rows = max_rows  # larger steps use the bf16 weight
        self.out_features = codes.shape[0]
        self.in_features = codes.shape[1] * 2
        self.integer = integer
        if integer:
            self.packed, self.scales_and_zeros = pack_q4_vnni(codes, scales, zeros)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(codes), 2)
        # [K/32, N, 2]: (scale, zero) per group and output row, in the activations' dtype.
        self.scales_and_zeros = (
            torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        )

    def dequantized(self, scratch: torch.Tensor) -> torch.Tensor:
        """The bf16 weight [N, K], written into the front of `scratch` (a flat bf16 buffer
        reused for every projection): bit for bit the bf16 rounding of the GGUF's dequantized
        weight, that is, what a bf16 checkpoint of the file holds (Berth's kernel only)."""
        out = scratch[: self.out_features * self.in_features].view(
            self.out_features, self.in_features
        )
        torch.ops.berth.quant_dequantize(self.packed, self.scales_and_zeros, out)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.integer:
            return torch.ops.berth.quant_linear(x, self.packed, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros
        )

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes
