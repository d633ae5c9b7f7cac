"""Uploading a step's integer inputs: built on the host with numpy, sent to the device in one copy.

`torch.tensor(list, device="cuda")`, or indexing a CUDA tensor with CPU indices, copies from
pageable memory, and PyTorch waits for such a copy: the host stalls until the GPU has finished
everything queued before it, the step in flight included (which would undo the overlap
scheduler). Here the host packs the arrays into one pinned buffer and copies it with one
non-blocking transfer; the tensors handed back are views of the one device copy. The buffer
comes from PyTorch's caching host allocator, which hands a block out again only once the copy
that read it has run, so nothing here waits. On a CPU device the tensors are the numpy arrays
themselves, with no copy at all.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """`arrays` (int64, 1-D) as tensors on `device`, in order, without waiting for the device."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    sizes = [len(a) for a in arrays]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    np.concatenate(arrays, out=staging.numpy())
    return list(staging.to(device, non_blocking=True).split(sizes))
