"""LoraAdapter: a PEFT LoRA adapter directory read into host memory, checked against the base model
and laid out for Berth's fused projections."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file
from torch import nn

from berth_runtime.model_executor import tensor_parallel
from berth_runtime.models.layers.attention import Attention
from berth_runtime.models.layers.mlp import GatedMLP

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# A checkpoint projection PEFT targets -> (the Berth projection holding it, its part there).
# Part -1: the whole fused projection (Phi-3's checkpoints fuse q/k/v and gate/up themselves).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", -1),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", -1),
    "down_proj": ("down_proj", 0),
}
# Berth's projections that take updates, and how many checkpoint projections each fuses.
PROJECTION_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}

_LORA_NAME = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served: the message says why; `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ProjectionDelta:
    """One layer's low-rank update of one Berth projection: out += (x @ a.T) @ b.T, where `a`
    [parts * rank, in] stacks each targeted part's A, and `b` [out, parts * rank] is block
    diagonal (each part's B, scaled, in its own rows and columns), so a fused projection's
    update is two matmuls whatever its parts."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoraAdapter:
    """An adapter in host memory, ready to be copied into a device slot (`lora.pool`)."""

    name: str
    path: str
    rank: int
    # (layer, Berth projection) -> its update
    deltas: dict[tuple[int, str], ProjectionDelta] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas.values())


def read_adapter(name: str, path: str, model: nn.Module, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter at `path` for `model` (a CausalLM), in the model's dtype on the host;
    LoraError when it is not a LoRA adapter, or does not fit this base or `max_rank`."""
    config = _read_config(path)
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise LoraError(f"adapter {name!r}: `r` must be a positive rank, got {config.get('r')!r}")
    if rank > max_rank:
        raise LoraError(
            f"adapter {name!r} has rank {rank}, above this server's --max-lora-rank {max_rank}"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    tensors = _read_weights(path)
    params = next(model.parameters())
    pieces: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    split = tensor_parallel.current().size > 1
    for key, tensor in tensors.items():
        place = _place(name, key, model)
        if place is None:
            continue  # a part of the checkpoint Berth does not run (a vision tower)
        layer, projection, part, which = place
        if split:
            tensor = _share(model, tensor, layer, projection, part, which)
        slot = pieces.setdefault((layer, projection), {}).setdefault(part, {})
        slot[which] = tensor.to(params.dtype)
    adapter = LoraAdapter(name, path, rank)
    for (layer, projection), parts in pieces.items():
        module, sizes = _projection(model, layer, projection)
        adapter.deltas[(layer, projection)] = _fuse(
            name, f"layers.{layer}.{projection}", module, sizes, parts, scaling
        )
    if not adapter.deltas:
        raise LoraError(f"adapter {name!r} has no LoRA weights for this model's projections")
    return adapter


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoraError(f"{path!r} is not a PEFT adapter directory: no {CONFIG_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{config_path}: {e}") from e
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{path!r} is a {peft_type} adapter; only LoRA adapters are served")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole trained layers beside LoRA)",
        "rank_pattern": "rank_pattern (a rank per module)",
        "alpha_pattern": "alpha_pattern (an alpha per module)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise LoraError(f"{path!r} uses {what}, which Berth does not serve")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{path!r} trains biases (bias: {config['bias']!r}); Berth serves none")
    return config


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    for file in WEIGHT_FILES:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        try:
            if file.endswith(".safetensors"):
                return load_file(full)
            return torch.load(full, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: the load's 400 says which
            raise LoraError(f"{full}: cannot read the adapter's weights ({e})") from e
    raise LoraError(f"{path!r} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _place(name: str, key: str, model: nn.Module) -> tuple[int, str, int, str] | None:
    """(layer, Berth projection, part, "A" or "B") of a PEFT tensor name, as the base model's
    own names map (`CausalLM.remap`); None for a part of the checkpoint Berth does not run."""
    hf_name = key.removeprefix("base_model.model.").removeprefix("model.")
    hf_name = re.sub(r"\.lora_([AB])\.\w+\.weight$", r".lora_\1.weight", hf_name)  # named adapter
    which = "A" if ".lora_A." in hf_name else "B" if ".lora_B." in hf_name else None
    if which is None:
        raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight")
    base_name = model.remap(hf_name.replace(".lora_A.", ".").replace(".lora_B.", "."))
    if base_name is None:
        return None
    match = _LORA_NAME.match(base_name.replace(".weight", f".lora_{which}.weight"))
    if match is None or ".experts." in base_name:
        where = "MoE experts" if ".experts." in base_name else f"{base_name.rsplit('.', 1)[0]}"
        raise LoraError(
            f"adapter {name!r} targets {where}; Berth applies LoRA to the attention and MLP "
            f"projections ({', '.join(TARGETS)})"
        )
    layer, _, target = int(match.group(1)), match.group(2), match.group(3)
    if target not in TARGETS:
        raise LoraError(f"adapter {name!r} targets {target}, which Berth does not adapt")
    if layer >= len(model.layers):
        raise LoraError(
            f"adapter {name!r} has weights for layer {layer}; the base model has "
            f"{len(model.layers)} layers (was it trained for another base?)"
        )
    projection, part = TARGETS[target]
    return layer, projection, part, which


# The checkpoint projection each part of a Berth projection loads from (part -1: fused in it).
_CHECKPOINT_NAMES = {
    ("qkv_proj", 0): "q_proj",
    ("qkv_proj", 1): "k_proj",
    ("qkv_proj", 2): "v_proj",
    ("qkv_proj", -1): "qkv_proj",
    ("gate_up_proj", 0): "gate_proj",
    ("gate_up_proj", 1): "up_proj",
    ("gate_up_proj", -1): "gate_up_proj",
    ("o_proj", 0): "o_proj",
    ("down_proj", 0): "down_proj",
}


def _share(
    model: nn.Module, tensor: torch.Tensor, layer: int, projection: str, part: int, which: str
) -> torch.Tensor:
    """This process's part of a LoRA weight (tensor parallelism), cut as the base weight it
    updates is (`CausalLM._share`): a column-parallel projection's B by its output rows (A whole:
    its input is whole), a row-parallel one's (o_proj, down_proj) A by its input columns (B whole:
    each process's update is summed with its output)."""
    row_parallel = projection in ("o_proj", "down_proj")
    if (which == "A") != row_parallel:
        return tensor
    owner = "self_attn" if projection in ("qkv_proj", "o_proj") else "mlp"
    base = f"layers.{layer}.{owner}.{_CHECKPOINT_NAMES[(projection, part)]}.weight"
    return model._share(base, tensor)


def _projection(model: nn.Module, layer: int, projection: str) -> tuple[nn.Linear, list[int]]:
    """A layer's Berth projection and the output rows of each of its parts."""
    decoder_layer = model.layers[layer]
    if projection in ("qkv_proj", "o_proj"):
        attn: Attention = decoder_layer.self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size] if projection == "qkv_proj" else None
        module = getattr(attn, projection)
    else:
        mlp = decoder_layer.mlp
        if not isinstance(mlp, GatedMLP):
            raise LoraError("LoRA on a MoE layer's experts is not served; adapt attention only")
        sizes = [mlp.intermediate_size] * 2 if projection == "gate_up_proj" else None
        module = getattr(mlp, projection)
    return module, sizes or [module.out_features]


def _fuse(
    name: str,
    where: str,
    module: nn.Linear,
    sizes: list[int],
    parts: dict[int, dict[str, torch.Tensor]],
    scaling: float,
) -> ProjectionDelta:
    """Stack the parts' A, lay their scaled B block-diagonally (see `ProjectionDelta`); part -1
    is the whole fused projection."""
    a_rows, b_blocks = [], []
    rank_total = 0
    for part in sorted(parts):
        pair = parts[part]
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {where} part {part} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        start = 0 if part < 0 else sum(sizes[:part])
        end = module.out_features if part < 0 else start + sizes[part]
        if a.dim() != 2 or a.shape[1] != module.in_features:
            raise LoraError(
                f"adapter {name!r} does not fit the base model: {where}'s lora_A is "
                f"{list(a.shape)}, the model's projection takes {module.in_features} inputs "
                "(was it trained for another base?)"
            )
        if b.dim() != 2 or b.shape != (end - start, a.shape[0]):
            raise LoraError(
                f"adapter {name!r} does not fit the base model: {where}'s lora_B is "
                f"{list(b.shape)}, expected [{end - start}, {a.shape[0]}] "
                "(was it trained for another base?)"
            )
        a_rows.append(a)
        b_blocks.append((start, end, rank_total, b * scaling))
        rank_total += a.shape[0]
    b_full = a_rows[0].new_zeros(module.out_features, rank_total)
    for start, end, column, b in b_blocks:
        b_full[start:end, column : column + b.shape[1]] = b
    return ProjectionDelta(torch.cat(a_rows).contiguous(), b_full)
