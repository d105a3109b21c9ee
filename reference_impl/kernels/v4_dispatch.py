"""The V4 layer's compute cores with kernels plugged in (:data:`V4_KERNEL_OPS`), one fallback rule.

* ``sparse_attention``: :mod:`reference_impl.kernels.v4_attention_triton` where
  :func:`~reference_impl.kernels.fallback.use_kernels` says so (CUDA, Triton, not forced to torch),
  the torch reference otherwise or when the kernel raises (one warning per process);
* ``select_entries``: the V3.2 lightning-indexer kernels of :mod:`reference_impl.kernels.indexer_triton`
  over the compressed keys (the same score ``sum_h w[t, h] ReLU(q[t, h] . k[s])``, a unit key scale,
  each query's visible entries as its key range), where kernels run and ``q`` and ``keys`` are
  bf16. V4's indexer values are FP4 with power-of-two block scales (or plain bf16), so bf16 holds
  them exactly: the kernel's bf16 products are exact and only the fp32 summation order differs from
  the reference, which may swap entries tied at the k-th score within rounding. The torch
  reference materializes ``[rows, 64 heads, entries]`` fp32 logits; the kernel keeps the head sum in
  registers and selects with the exact Triton top-k (memory flat in the context past one key tile).
  Other dtypes (the ``fp32`` codec's keys) take the torch reference;
* ``pool``: :mod:`reference_impl.kernels.v4_compressor_triton` where kernels run (one pass over
  the slots' value and score features instead of the reference's gathered copies), the torch
  reference otherwise;
* ``rope_tail``: :mod:`reference_impl.kernels.v4_rope_triton` where kernels run (the query's
  per-head norm and RoPE, the raw entry's and the indexer query's RoPE, the output's inverse RoPE
  and cast: one read and one write instead of the reference's passes), the torch reference otherwise;
* ``fp4_simulate``: :mod:`reference_impl.kernels.v4_fp4_triton` where kernels run (the indexer
  query's FP4 round trip, bit-exact), the torch reference otherwise.
"""

from __future__ import annotations

import torch

from reference_impl.kernels import fallback
from reference_impl.model.sparse_attention import HostKeyBounds
from reference_impl.model.v4 import sparse as reference
from reference_impl.kvcache.v4_layout import fp4_simulate as fp4_simulate_reference
from reference_impl.model.v4.compressor import pool as pool_reference
from reference_impl.model.v4.rope_tail import rope_tail as rope_tail_reference
from reference_impl.model.v4.ops import V4Ops
from reference_impl.model.v4.sparse import sparse_attention_sinks


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


def select_entries(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor, n_visible: torch.Tensor,
    topk: int, host_bounds: HostKeyBounds | None = None, *, force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.model.v4.sparse.select_entries`, by the indexer kernels where they run
    (rows of a query's set in ascending order; the reference lists them by score)."""

    def torch_path() -> torch.Tensor:
        return reference.select_entries(q, weights, keys, key_start, n_visible, topk)

    if indexer_kernel_name(q, keys, force_torch=force_torch) == "torch":
        return torch_path()

    def kernel() -> torch.Tensor:
        from reference_impl.kernels.indexer_triton import indexer_topk_triton

        unit_scale = torch.ones(keys.shape[0], dtype=torch.float32, device=keys.device)
        key_end = key_start + n_visible
        return indexer_topk_triton(
            q, weights.float(), keys, unit_scale, key_start, key_end, topk,
            host_bounds=host_bounds, selector="triton", dot_dtype="bf16",
        )

    return fallback.run_with_fallback("Triton V4 indexer", kernel, torch_path)


def indexer_kernel_name(q: torch.Tensor, keys: torch.Tensor, *, force_torch: bool = False) -> str:
    """What :func:`select_entries` runs for these inputs: ``"triton"`` or ``"torch"``."""
    exact = q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16
    return "triton" if exact and fallback.use_kernels(q.device, force_torch=force_torch) else "torch"


def attention_kernel_name(device: torch.device, *, force_torch: bool = False) -> str:
    """What :func:`sparse_attention` runs for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


def pool(
    kv_rows: torch.Tensor, score_rows: torch.Tensor, slot_rows: torch.Tensor, ratio: int, *, force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.model.v4.compressor.pool`, by the Triton kernel where it runs."""

    def torch_path() -> torch.Tensor:
        return pool_reference(kv_rows, score_rows, slot_rows, ratio)

    if not fallback.use_kernels(kv_rows.device, force_torch=force_torch):
        return torch_path()

    def kernel() -> torch.Tensor:
        from reference_impl.kernels.v4_compressor_triton import pool_triton

        return pool_triton(kv_rows, score_rows, slot_rows, ratio)

    return fallback.run_with_fallback("Triton V4 compressor pool", kernel, torch_path)


def rope_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, rms_eps: float | None = None,
    out_dtype: torch.dtype | None = None, *, force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.model.v4.rope_tail.rope_tail`, by the Triton kernel where it runs."""
    args = (x, cos, sin, rope_dim, rms_eps, out_dtype)

    def torch_path() -> torch.Tensor:
        return rope_tail_reference(*args)

    if not fallback.use_kernels(x.device, force_torch=force_torch):
        return torch_path()

    def kernel() -> torch.Tensor:
        from reference_impl.kernels.v4_rope_triton import rope_tail_triton

        return rope_tail_triton(*args)

    return fallback.run_with_fallback("Triton V4 rope tail", kernel, torch_path)


def fp4_simulate(x: torch.Tensor, *, force_torch: bool = False) -> torch.Tensor:
    """:func:`~reference_impl.kvcache.v4_layout.fp4_simulate`, by the Triton kernel where it runs."""
    if not fallback.use_kernels(x.device, force_torch=force_torch):
        return fp4_simulate_reference(x)

    def kernel() -> torch.Tensor:
        from reference_impl.kernels.v4_fp4_triton import fp4_simulate_triton

        return fp4_simulate_triton(x)

    return fallback.run_with_fallback("Triton V4 FP4 round trip", kernel, lambda: fp4_simulate_reference(x))


V4_KERNEL_OPS = V4Ops("kernels", select_entries, sparse_attention, pool, rope_tail, fp4_simulate)
