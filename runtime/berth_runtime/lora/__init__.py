"""LoRA adapters: many fine-tunes served on one base model, selected per request."""
