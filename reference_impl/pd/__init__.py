"""Prefill -> decode transfer of the KV cache (planned with phase 2)."""
