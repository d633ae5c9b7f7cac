"""Layers the model families share: projections, norms, rotary embeddings, attention, MLPs."""
