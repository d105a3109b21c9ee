"""Triton / Gluon kernels with torch fallbacks: the compute cores behind one dispatch point
(:mod:`.dispatch`), the phase-7 fused kernels (``fused_*``; their CP-aware dispatch is
:mod:`reference_impl.cp.fused_ops`), one fallback rule (:mod:`.fallback`) and the helpers the
kernels share (:mod:`.triton_helpers`).

Importing this package does not import Triton; the kernel modules do, and only the dispatch
functions load them, on CUDA inputs. Kernels take tensors and index tensors, never CP metadata.
"""

from __future__ import annotations

from reference_impl.kernels.dispatch import KERNEL_OPS, indexer_topk, sparse_mla_attention
from reference_impl.kernels.fallback import triton_available

__all__ = ["KERNEL_OPS", "indexer_topk", "sparse_mla_attention", "triton_available"]
