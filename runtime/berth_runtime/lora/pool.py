"""LoraPool: the device slots that hold the adapters a batch may use (filled from host memory on
demand, the least recently used evicted), and the batched low-rank update each projection adds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from berth_runtime.lora.adapter import PROJECTIONS, LoraAdapter
from berth_runtime.models.layers.linear import pack_weight, packed_linear

Rows = slice | torch.Tensor  # a batch's rows: a contiguous run, or their indices


@dataclass
class Slot:
    """One adapter on the device: each (layer, projection)'s (A, B), prepacked for oneDNN on a
    CPU whose projections are (`pool.packed`)."""

    name: str
    deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    last_used: int = 0


@dataclass
class LoraPool:
    """`num_slots` slots (--max-loras-per-batch): the adapters one batch may mix. A step's rows
    are grouped by adapter (`set_batch`), and each adapted projection adds, per adapter in the
    batch, (x[rows] @ A.T) @ B.T to its rows: a handful of small matmuls per projection whatever
    the batch size, never one forward pass per adapter; base rows take none."""

    num_slots: int
    device: torch.device
    packed: bool  # CPU projections run on oneDNN: so do the updates (row-independent results)
    slots: list[Slot | None] = field(init=False)
    # The step being run: (slot, rows) for each adapter in it.
    segments: list[tuple[Slot, Rows]] = field(default_factory=list)
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
        """Copy `adapter` into a free slot, or over the least recently used one whose adapter is
        not in `keep` (those the running requests use); returns the slot. The scheduler admits no
        more adapters at once than there are slots, so one is always found."""
        index = self.slot_of(adapter.name)
        if index is None:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                idle = [i for i, s in enumerate(self.slots) if s is not None and s.name not in keep]
                assert idle, "the scheduler admitted more adapters than there are slots"
                free = [min(idle, key=lambda i: self.slots[i].last_used)]  # type: ignore[union-attr]
            index = free[0]
            self.slots[index] = Slot(adapter.name, self._to_device(adapter))
        slot = self.slots[index]
        assert slot is not None
        slot.last_used = next(self._clock)
        return index

    def evict(self, name: str) -> None:
        index = self.slot_of(name)
        if index is not None:
            self.slots[index] = None

    def _to_device(self, adapter: LoraAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
        def place(weight: torch.Tensor) -> torch.Tensor:
            weight = weight.to(self.device)
            return pack_weight(weight) if self.packed else weight

        return {key: (place(d.a), place(d.b)) for key, d in adapter.deltas.items()}

    # --- a step --------------------------------------------------------------------------------

    def set_batch(self, adapters: list[str | None], rows: list[int]) -> None:
        """The next step's rows: sequence i has `rows[i]` of them, under adapter `adapters[i]`
        (None: the base model)."""
        self.segments = []
        if not any(adapters):
            return
        by_name: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for name, count in zip(adapters, rows):
            if name is not None:
                by_name.setdefault(name, []).append((start, start + count))
            start += count
        for name, spans in by_name.items():
            index = self.slot_of(name)
            assert index is not None, f"adapter {name!r} was not given a slot"
            slot = self.slots[index]
            assert slot is not None
            slot.last_used = next(self._clock)
            contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            if contiguous:
                self.segments.append((slot, slice(spans[0][0], spans[-1][1])))
            else:
                indices = [i for s, e in spans for i in range(s, e)]
                self.segments.append((slot, torch.tensor(indices, device=self.device)))

    def clear_batch(self) -> None:
        self.segments = []

    def add_delta(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A.T) @ B.T for each adapter of the step, in place."""
        matmul = packed_linear if self.packed else F.linear
        for slot, rows in self.segments:
            weights = slot.deltas.get((layer, projection))
            if weights is None:
                continue
            a, b = weights
            if isinstance(rows, slice):
                out[rows] += matmul(matmul(x[rows], a), b)
            else:
                out.index_add_(0, rows, matmul(matmul(x.index_select(0, rows), a), b))


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
            for projection in PROJECTIONS:
                module = getattr(owner, projection, None)
                if isinstance(module, nn.Linear):
                    module.berth_lora = LoraHook(pool, layer_id, projection)
