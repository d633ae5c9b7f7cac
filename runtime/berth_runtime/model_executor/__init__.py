"""Running the model on a batch: forward inputs, the model runner and the sampler."""
