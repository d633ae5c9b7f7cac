"""Tensor parallelism inside one rank: which part of each weight this process holds (Megatron's
split: attention heads and the MLP's intermediate columns, then rows; the vocabulary), and the
collectives that put the parts together (torch.distributed: gloo on CPU, NCCL on CUDA).

The split follows the KV heads: each process takes a contiguous run of KV heads with their
query heads, so a model whose heads do not divide evenly (SmolLM2-135M: 9 query and 3 KV heads
over 2 processes: 6 + 3) still splits. With more processes than KV heads, each KV head is held by
`size / kv_heads` processes (replicated, as SGLang does), each with its share of its queries.

Layers read `current()` when they are built; a model of one process (the default) never calls a
collective.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the rank's tensor-parallel processes."""

    rank: int = 0
    size: int = 1
    # torch.distributed groups once initialized: tensors (NCCL on CUDA), objects (gloo).
    objects: Any = field(default=None, compare=False)

    def part(self, total: int) -> range:
        """This process's share of `total` units, split as evenly as they go (the first
        `total % size` processes take one more)."""
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        """The query heads and KV heads this process holds."""
        if self.size == 1:
            return range(num_heads), range(num_kv_heads)
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            kv = self.part(num_kv_heads)
            return range(kv.start * group, kv.stop * group), kv
        if self.size % num_kv_heads or num_heads % self.size:
            raise ValueError(
                f"--tp-size {self.size} cannot split {num_heads} attention heads with "
                f"{num_kv_heads} KV heads: use a size of at most {num_kv_heads}, or a multiple "
                f"of it that divides {num_heads}"
            )
        per_kv = self.size // num_kv_heads
        kv_head = self.rank // per_kv
        share = group // per_kv
        start = kv_head * group + (self.rank % per_kv) * share
        return range(start, start + share), range(kv_head, kv_head + 1)


_current = TPGroup()


def current() -> TPGroup:
    return _current


def set_current(group: TPGroup) -> None:
    global _current
    _current = group


def init(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the rank's process group (every process calls this) and make it current."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    objects = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    group = TPGroup(rank, size, objects)
    set_current(group)
    return group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the processes of each one's partial `x` (in place); `x` alone without TP."""
    if _current.size > 1:
        dist.all_reduce(x)
    return x


def gather_columns(x: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Each process's columns of one matrix [rows, widths[rank]], put side by side in rank
    order on every process."""
    if _current.size == 1:
        return x
    widest = max(widths)
    padded = x if x.shape[1] == widest else torch.nn.functional.pad(x, (0, widest - x.shape[1]))
    parts = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:, :width] for part, width in zip(parts, widths)], dim=1)


def broadcast(obj: Any = None) -> Any:
    """Process 0's `obj`, on every process (pickled, over gloo; tensors must be on the CPU)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_current.objects)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_current(TPGroup())
