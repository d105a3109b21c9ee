"""The GLM-5.3 family (``transformers``' ``glm5_next``): hybrid stacks of KDA linear-attention layers
and MLA layers with a pooled-key DSA indexer.

One folder: :mod:`.config` (the config and presets), :mod:`.model` (the two layer types, the oracle,
the checkpoint names; pure torch), :mod:`.cp` (the rank's store and the layer step: the KDA state
hand-off, the convolution halo, the pooled index keys owned per group), :mod:`.check` (the comparison
with the oracle) and :mod:`.family` (the interface the engine calls).
"""
