"""Uploading a step's integer inputs: built on the host with numpy, sent to the device in one copy.

`torch.tensor(list, device="cuda")` copies from pageable memory, which the driver stages and
waits for: a step that built five index tensors that way paid five synchronous copies, and an
index computed on the device from a device tensor (`repeat_interleave`) one more sync for its
size. Here the host computes every index (cheap with numpy, and its sizes are known there),
packs them into one pinned buffer, reused from step to step, and copies it with one non-blocking
transfer; the tensors handed back are views of the one device copy. On a CPU device the tensors
are the numpy arrays themselves, with no copy at all.
"""

from __future__ import annotations

import numpy as np
import torch


class HostInputs:
    """One device's staging buffer for int64 step inputs (grown as needed, never shrunk)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.int64, pin_memory=self.pinned)
        # Set after each copy: the buffer is refilled only once the device has read it.
        self.copied: torch.cuda.Event | None = None

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """`arrays` (int64, 1-D) as tensors on the device, in order."""
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        total = sum(len(a) for a in arrays)
        if self.copied is not None:
            self.copied.synchronize()
        if self.buffer.numel() < total:
            self.buffer = torch.empty(
                max(total, 2 * self.buffer.numel()), dtype=torch.int64, pin_memory=self.pinned
            )
        host = self.buffer.numpy()
        start = 0
        for a in arrays:
            host[start : start + len(a)] = a
            start += len(a)
        device_copy = self.buffer[:total].to(self.device, non_blocking=True)
        if self.pinned:
            self.copied = self.copied or torch.cuda.Event()
            self.copied.record()
        return list(device_copy.split([len(a) for a in arrays]))


_BY_DEVICE: dict[torch.device, HostInputs] = {}


def upload(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """`arrays` as int64 tensors on `device`, through that device's one staging buffer."""
    staging = _BY_DEVICE.get(device)
    if staging is None:
        staging = _BY_DEVICE[device] = HostInputs(device)
    return staging.upload(*arrays)
