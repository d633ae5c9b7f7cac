"""KV cache memory: the token-slot pool and the request-to-slot table."""
