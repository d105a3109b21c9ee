"""DeepSeek-V4's hybrid attention (sliding window, CSA, HCA) and its single-device oracle.

Beside the V3.2 layer (:mod:`reference_impl.model.attention`), not a branch of it:

* :mod:`.compressor` -- gated softmax pooling of 4 (overlapping) or 128 tokens into one entry;
* :mod:`.indexer` -- the lightning indexer over compressed keys, with the causal rule for entries;
* :mod:`.sparse` -- sparse attention over ``[window | selected entries]`` with attention sinks;
* :mod:`.attention` -- the layer: projections, RoPE and its inverse, grouped output projection;
* :mod:`.cache` -- one request's cache of one layer, and the single-device layer call;
* :mod:`.oracle` -- the model around the layers and the oracle every CP run is compared with;
* :mod:`.checkpoint` -- Hugging Face parameter names.
"""
