"""The V4 layer's compute cores with kernels plugged in (:data:`V4_KERNEL_OPS`), one fallback rule.

* ``sparse_attention``: :mod:`reference_impl.kernels.v4_attention_triton` where
  :func:`~reference_impl.kernels.fallback.use_kernels` says so (CUDA, Triton, not forced to torch),
  the torch reference otherwise or when the kernel raises (one warning per process);
* ``select_entries``: the torch reference (score GEMMs in the tensors' dtype, then ``topk``): the
  indexer over compressed keys reads a quarter of V3.2's keys per query, and its GEMMs already
  run on the tensor cores through cuBLAS.
"""

from __future__ import annotations

import torch

from reference_impl.kernels import fallback
from reference_impl.model.v4.sparse import V4Ops, select_entries, sparse_attention_sinks


def sparse_attention(
    q: torch.Tensor, view: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, softmax_scale: float,
    dense_start: torch.Tensor | None = None, dense_len: torch.Tensor | None = None, dense_width: int | None = None,
    *, force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.model.v4.sparse.sparse_attention_sinks`, by the Triton kernel where it runs."""
    args = (q, view, indices, sinks, softmax_scale, dense_start, dense_len, dense_width)

    def torch_path() -> torch.Tensor:
        return sparse_attention_sinks(*args)

    if not fallback.use_kernels(q.device, force_torch=force_torch):
        return torch_path()

    def kernel() -> torch.Tensor:
        from reference_impl.kernels.v4_attention_triton import v4_sparse_attention_triton

        return v4_sparse_attention_triton(*args)

    return fallback.run_with_fallback("Triton V4 sparse attention", kernel, torch_path)


def attention_kernel_name(device: torch.device, *, force_torch: bool = False) -> str:
    """What :func:`sparse_attention` runs for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


V4_KERNEL_OPS = V4Ops("kernels", select_entries, sparse_attention)
