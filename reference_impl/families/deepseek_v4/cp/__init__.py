"""CP prefill for DeepSeek-V4: the chunk plan (halos), the store (sharded CSA entries, replicated
HCA entries, window tails and compressor states) and the layer step the engine runs."""
