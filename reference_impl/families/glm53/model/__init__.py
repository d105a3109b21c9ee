"""GLM-5.3's attention layers and their single-device oracle (pure torch).

* :mod:`.kda` -- Kimi Delta Attention: projections, the short convolution, the gated delta rule
  (chunked, float32 state) and the span's state map that CP exchanges;
* :mod:`.dsa` -- MLA without RoPE, the pooled-key indexer and its selection rule;
* :mod:`.oracle` -- the model around the layers, the per-span layer calls, the oracle;
* :mod:`.checkpoint` -- the checkpoint's tensor names.
"""
