"""Native kernels Berth builds itself where eager PyTorch has none that fit (see `cpu`)."""
