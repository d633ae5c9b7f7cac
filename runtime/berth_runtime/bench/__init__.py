"""`berth bench`: a serving benchmark client (synthetic workloads, a load generator, metrics).

`berth bench` drives any OpenAI-compatible server (`client.py`) with seeded synthetic workloads
(`workload.py`) and reports throughput and latency percentiles (`metrics.py`) and the server's
memory (`memory.py`). The side-by-side comparison with baselines lives outside the package, in the
repository's `benchmarks/` (`make bench`).
"""

from __future__ import annotations
