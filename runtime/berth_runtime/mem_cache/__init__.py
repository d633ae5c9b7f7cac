"""KV cache memory: the token-slot pool (kv_pool), each request's slots and table row
(kv_manager), and the prefix cache that lets requests share them (radix_cache)."""
