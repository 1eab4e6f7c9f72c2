"""The target side: target model, KV cache use, verification and the speculative engine."""
