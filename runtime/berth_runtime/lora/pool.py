"""LoraPool: the device slots that hold the adapters a batch may use (filled from host memory on
demand, the least recently used evicted), and the batched low-rank update each projection adds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.lora.adapter import PROJECTION_PARTS, LoraAdapter
from berth_runtime.models.layers.linear import pack_weight, packed_linear


@dataclass
class Slot:
    name: str
    adapter: LoraAdapter
    last_used: int = 0


@dataclass
class Stack:
    """One projection's updates for every slot; width = the projection's parts * max rank, zeros
    where a slot is empty or its rank is below the widest.

    torch (CPU): `a` [slots * width, in] holds slot s's stacked A in rows [s * width, ...), `b`
    [out, slots * width] its B in the same columns; prepacked for oneDNN where the projections
    are. Triton: `a` [slots + 1, width, in] and `b` [slots + 1, out, width], slot by slot, the
    last one all zeros (the base model's rows run on it)."""

    a: torch.Tensor
    b: torch.Tensor
    width: int


@dataclass
class LoraPool:
    """`num_slots` device slots (--max-loras-per-batch): the adapters one batch may mix.

    On CPU each adapted projection adds, for the whole step, `((x @ A.T) * mask) @ B.T`, A and B
    every slot's updates side by side (`Stack`) and the mask keeping each row's own slot's
    columns (none for base rows): three ops per projection whatever the adapters in the step,
    never one forward pass per adapter. The matmuls' shapes do not depend on the batch, and they
    run on oneDNN like the projections, so no row's result depends on what shares its step. On
    Triton, two launches of a grouped matmul multiply each row by its own slot's A then B (rows
    sorted by slot on the device, no host sync), so no other slot costs anything."""

    num_slots: int
    max_rank: int
    device: torch.device
    dtype: torch.dtype
    packed: bool
    # Run the updates on Triton (`kernels.triton_moe`'s expert matmul, a slot for an expert): each
    # row multiplies its own slot's weights only. Where attention runs on Triton (CUDA, or CPU
    # tensors under the interpreter).
    triton: bool = False
    slots: list[Slot | None] = field(init=False)
    # (layer, projection) -> (in_features, out_features), for every projection that takes updates.
    shapes: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    stacks: dict[tuple[int, str], Stack] = field(default_factory=dict)
    # The step being run, when a row has an adapter (`active`): torch, its row mask per
    # projection width; Triton, its rows sorted by slot (`triton_moe.align_by_expert`).
    masks: dict[int, torch.Tensor] | None = None
    alignment: tuple[torch.Tensor, ...] | None = None

    @property
    def active(self) -> bool:
        """Whether the step being run has rows under an adapter (projections add updates)."""
        return self.masks is not None or self.alignment is not None

    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.slots = [None] * self.num_slots

    # --- residency -----------------------------------------------------------------------------

    def slot_of(self, name: str) -> int | None:
        for index, slot in enumerate(self.slots):
            if slot is not None and slot.name == name:
                return index
        return None

    def resident(self) -> list[str]:
        return [slot.name for slot in self.slots if slot is not None]

    def fill(self, adapter: LoraAdapter, keep: set[str]) -> int:
        """Put `adapter` in a slot: its own, a free one, or the least recently used one whose
        adapter is not in `keep` (those the running requests use); returns the slot. The scheduler
        admits no more adapters at once than there are slots, so one is always found."""
        index = self.slot_of(adapter.name)
        if index is None:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                idle = [i for i, s in enumerate(self.slots) if s is not None and s.name not in keep]
                assert idle, "the scheduler admitted more adapters than there are slots"
                free = [min(idle, key=lambda i: self.slots[i].last_used)]  # type: ignore[union-attr]
            index = free[0]
            self.slots[index] = Slot(adapter.name, adapter)
            self._rebuild()
        slot = self.slots[index]
        assert slot is not None
        slot.last_used = next(self._clock)
        return index

    def evict(self, name: str) -> None:
        index = self.slot_of(name)
        if index is not None:
            self.slots[index] = None
            self._rebuild()

    def _rebuild(self) -> None:
        """Lay every slot's updates out again (after a slot changed; a load, not a step)."""
        self.stacks = {}
        for key, (fan_in, fan_out) in self.shapes.items():
            width = PROJECTION_PARTS[key[1]] * self.max_rank
            if self.triton:
                self.stacks[key] = self._triton_stack(key, fan_in, fan_out, width)
                continue
            a = torch.zeros(self.num_slots * width, fan_in, dtype=self.dtype)
            b = torch.zeros(fan_out, self.num_slots * width, dtype=self.dtype)
            for index, slot in enumerate(self.slots):
                delta = slot.adapter.deltas.get(key) if slot is not None else None
                if delta is not None:
                    start = index * width
                    a[start : start + delta.a.shape[0]] = delta.a
                    b[:, start : start + delta.b.shape[1]] = delta.b
            a, b = a.to(self.device), b.to(self.device)
            if self.packed:
                a, b = pack_weight(a), pack_weight(b)
            self.stacks[key] = Stack(a, b, width)

    def _triton_stack(self, key: tuple[int, str], fan_in: int, fan_out: int, width: int) -> Stack:
        a = torch.zeros(self.num_slots + 1, width, fan_in, dtype=self.dtype)
        b = torch.zeros(self.num_slots + 1, fan_out, width, dtype=self.dtype)
        for index, slot in enumerate(self.slots):
            delta = slot.adapter.deltas.get(key) if slot is not None else None
            if delta is not None:
                a[index, : delta.a.shape[0]] = delta.a
                b[index, :, : delta.b.shape[1]] = delta.b
        return Stack(a.to(self.device), b.to(self.device), width)

    # --- a step --------------------------------------------------------------------------------

    def set_batch(self, adapters: list[str | None], rows: list[int]) -> None:
        """The next step's rows: sequence i has `rows[i]` of them, under adapter `adapters[i]`
        (None: the base model)."""
        if not any(adapters):
            self.masks = self.alignment = None
            return
        row_slots = []
        for name, count in zip(adapters, rows):
            index = -1 if name is None else self.slot_of(name)
            assert index is not None, f"adapter {name!r} was not given a slot"
            row_slots += [index] * count
        if self.triton:
            from berth_runtime.kernels import triton_moe

            base = self.num_slots  # the all-zero slot
            slots = torch.tensor([base if i < 0 else i for i in row_slots], device=self.device)
            self.alignment = triton_moe.align_by_expert(slots[:, None], self.num_slots + 1)
            return
        row_slot = torch.tensor(row_slots, device=self.device)
        self.masks = {}
        for parts in set(PROJECTION_PARTS.values()):
            width = parts * self.max_rank
            columns = torch.arange(self.num_slots * width, device=self.device) // width
            self.masks[width] = (columns[None, :] == row_slot[:, None]).to(self.dtype)

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += ((x @ A.T) * mask) @ B.T over every slot at once, in place."""
        stack = self.stacks.get((layer, projection))
        if stack is None:
            return
        if self.triton:
            from berth_runtime.kernels import triton_moe

            assert self.alignment is not None
            shrunk = triton_moe.expert_matmul(x.contiguous(), stack.a, self.alignment, 1)
            out += triton_moe.expert_matmul(shrunk, stack.b, self.alignment, 1)
            return
        assert self.masks is not None
        matmul = packed_linear if self.packed else F.linear
        shrunk = matmul(x, stack.a)
        shrunk.mul_(self.masks[stack.width])
        out += matmul(shrunk, stack.b)


@dataclass
class LoraHook:
    """What an adaptable projection carries (`berth_lora`): its place, and the pool to ask."""

    pool: LoraPool
    layer: int
    projection: str


def attach(model: nn.Module, pool: LoraPool) -> None:
    """Give every attention and dense MLP projection its hook (a MoE layer's experts get none)."""
    for layer_id, layer in enumerate(model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for projection in PROJECTION_PARTS:
                module = getattr(owner, projection, None)
                if isinstance(module, nn.Linear):
                    module.berth_lora = LoraHook(pool, layer_id, projection)
                    pool.shapes[(layer_id, projection)] = (module.in_features, module.out_features)
    model.lora_pool = pool  # steps with adapter rows skip the fused decode, which has no hooks
    pool._rebuild()
