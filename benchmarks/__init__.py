"""Comparison suites and baselines, run from a checkout (`make bench`, `make bench-router`); they
ship in no image. `berth bench`, the load generator they drive, is in the runtime package."""
