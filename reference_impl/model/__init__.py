"""The DSA layer math (MLA, indexer, RoPE, FP8) and the single-device oracle."""
