"""Serving benchmark: synthetic workloads, a load generator, and a side-by-side comparison.

`berth bench` drives any OpenAI-compatible server (`client.py`) with seeded synthetic workloads
(`workload.py`) and reports throughput and latency percentiles (`metrics.py`); `berth bench
compare` launches Berth itself and measures it against Hugging Face transformers `generate()`
(`baseline_hf.py`) on the same prompts (`compare.py`).
"""

from __future__ import annotations
