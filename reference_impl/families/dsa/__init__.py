"""The DSA family: DeepSeek-V3.2, GLM-5 and GLM-5.2 (an MLA layer with the lightning indexer over
FP8 index keys, IndexShare on GLM-5.2).

This folder is the family's interface (:mod:`.family`) and its presets (:mod:`.config`). The layer
math and the caches it writes are the package's base, which every phase page documents:
:mod:`reference_impl.model` (the layer and the oracle), :mod:`reference_impl.kvcache` (the 656-byte
rows and the pools), the KV stores of :mod:`reference_impl.cp` and the per-layer step here
(:mod:`.layer_step`).
"""
