"""The DeepSeek-V4 family: sliding-window, CSA and HCA layers over compressed entries.

One folder: :mod:`.config` (the config and presets), :mod:`.cache_layout` (the entries' bytes),
:mod:`.model` (the layer and its oracle), :mod:`.kernels` (Triton kernels and their dispatch),
:mod:`.cp` (the chunk plan with its halos, the store that shards CSA entries, the layer step),
:mod:`.check` (the comparison with the oracle) and :mod:`.family` (the interface the engine calls).
"""
