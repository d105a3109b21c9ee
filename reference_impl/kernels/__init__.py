"""Triton kernels with torch fallbacks behind one dispatch point (:mod:`.dispatch`).

Importing this package does not import Triton; the kernel modules (``sparse_mla_gluon``,
``sparse_mla_triton``, ``indexer_triton``) do, and only the dispatch functions load them, on CUDA
inputs.
"""

from __future__ import annotations

from reference_impl.kernels.dispatch import indexer_topk, sparse_mla_attention, triton_available

__all__ = ["indexer_topk", "sparse_mla_attention", "triton_available"]
