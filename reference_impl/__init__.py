"""Reference implementation of context-parallel prefill with shared KV for DSA models.

Reading order: :mod:`reference_impl.config` -> :mod:`reference_impl.model` (the DSA layer and the
single-device oracle) -> :mod:`reference_impl.kvcache` (byte layouts, pools, allocator) ->
:mod:`reference_impl.cp` (split, collectives, rerange, KV stores, output collection) ->
:mod:`reference_impl.engine` (one rank's prefill) -> :mod:`reference_impl.runner` (launch, oracle,
report) -> :mod:`reference_impl.cli`.
"""

__version__ = "0.1.0"
