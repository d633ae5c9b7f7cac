"""Berth operator: reconciles InferenceService resources into runtime workloads."""

__version__ = "0.1.0"
