"""The V4 layer's compute cores with kernels plugged in (:data:`V4_KERNEL_OPS`), one fallback rule.

* ``sparse_attention``: :mod:`reference_impl.families.deepseek_v4.kernels.attention_triton` where
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
* ``pool``: :mod:`reference_impl.families.deepseek_v4.kernels.compressor_triton` where kernels run (one pass over
  the slots' value and score features instead of the reference's gathered copies), the torch
  reference otherwise;
* ``rope_tail``: :mod:`reference_impl.families.deepseek_v4.kernels.rope_triton` where kernels run (the query's
  per-head norm and RoPE, the raw entry's and the indexer query's RoPE, the output's inverse RoPE
  and cast: one read and one write instead of the reference's passes), the torch reference otherwise;
* ``fp4_simulate``: :mod:`reference_impl.families.deepseek_v4.kernels.fp4_triton` where kernels run (the indexer
  query's FP4 round trip, bit-exact), the torch reference otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate as fp4_simulate_reference
from reference_impl.families.deepseek_v4.model import sparse as reference
from reference_impl.families.deepseek_v4.model.compressor import pool as pool_reference
from reference_impl.families.deepseek_v4.model.ops import V4Ops
from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail as rope_tail_reference
from reference_impl.kernels import fallback
from reference_impl.model.sparse_attention import HostKeyBounds


def _kernel(module: str, name: str) -> Callable[..., torch.Tensor]:
    """``<name>`` of this family's kernel module ``<module>`` (beside this one), looked up when called:
    Triton is imported only where kernels run, and a test may stand a function in for it."""
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _shared_kernel(module: str, name: str) -> Callable[..., torch.Tensor]:
    """``reference_impl.kernels.<module>.<name>`` (the V3.2 indexer kernels CSA's selection reuses), looked
    up when called like :func:`_kernel`."""
    return getattr(importlib.import_module(f"reference_impl.kernels.{module}"), name)


def _dispatch(
    what: str,
    device: torch.device,
    force_torch: bool,
    kernel: Callable[[], torch.Tensor],
    torch_path: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """``kernel()`` where kernels run on ``device`` (falling back to ``torch_path()`` if it raises,
    one warning per ``what`` per process), else ``torch_path()``."""
    if not fallback.use_kernels(device, force_torch=force_torch):
        return torch_path()
    return fallback.run_with_fallback(what, kernel, torch_path)


def sparse_attention(
    q: torch.Tensor,
    view: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    dense_start: torch.Tensor | None = None,
    dense_len: torch.Tensor | None = None,
    dense_width: int | None = None,
    *,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.deepseek_v4.model.sparse.sparse_attention_sinks`, by the Triton kernel
    where it runs."""
    args = (q, view, indices, sinks, softmax_scale, dense_start, dense_len, dense_width)
    return _dispatch(
        "Triton V4 sparse attention",
        q.device,
        force_torch,
        lambda: _kernel("attention_triton", "v4_sparse_attention_triton")(*args),
        lambda: reference.sparse_attention_sinks(*args),
    )


def attention_kernel_name(device: torch.device, *, force_torch: bool = False) -> str:
    """What :func:`sparse_attention` runs for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


def select_entries(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_start: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    *,
    host_bounds: HostKeyBounds | None = None,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.deepseek_v4.model.sparse.select_entries`, by the indexer kernels where they run
    and ``q`` and ``keys`` are bf16 (rows of a query's set in ascending order; the reference lists
    them by score)."""

    def kernel() -> torch.Tensor:
        unit_scale = torch.ones(keys.shape[0], dtype=torch.float32, device=keys.device)
        return _shared_kernel("indexer_triton", "indexer_topk_triton")(
            q,
            weights.float(),
            keys,
            unit_scale,
            key_start,
            key_start + n_visible,
            topk,
            host_bounds=host_bounds,
            selector="triton",
            dot_dtype="bf16",
        )

    def torch_path() -> torch.Tensor:
        return reference.select_entries(q, weights, keys, key_start, n_visible, topk)

    if not _bf16_inputs(q, keys):  # the kernel's bf16 products would round other dtypes
        return torch_path()
    return _dispatch("Triton V4 indexer", q.device, force_torch, kernel, torch_path)


def _bf16_inputs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    return q.dtype == torch.bfloat16 and keys.dtype == torch.bfloat16


def indexer_kernel_name(q: torch.Tensor, keys: torch.Tensor, *, force_torch: bool = False) -> str:
    """What :func:`select_entries` runs for these inputs: ``"triton"`` or ``"torch"``."""
    return "triton" if _bf16_inputs(q, keys) and fallback.use_kernels(q.device, force_torch=force_torch) else "torch"


def pool(
    kv_rows: torch.Tensor,
    score_rows: torch.Tensor,
    slot_rows: torch.Tensor,
    ratio: int,
    *,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.deepseek_v4.model.compressor.pool`, by the Triton kernel where it runs."""
    args = (kv_rows, score_rows, slot_rows, ratio)
    return _dispatch(
        "Triton V4 compressor pool",
        kv_rows.device,
        force_torch,
        lambda: _kernel("compressor_triton", "pool_triton")(*args),
        lambda: pool_reference(*args),
    )


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    rms_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.deepseek_v4.model.rope_tail.rope_tail`, by the Triton kernel where it runs."""
    args = (x, cos, sin, rope_dim, rms_eps, out_dtype)
    return _dispatch(
        "Triton V4 rope tail",
        x.device,
        force_torch,
        lambda: _kernel("rope_triton", "rope_tail_triton")(*args),
        lambda: rope_tail_reference(*args),
    )


def fp4_simulate(x: torch.Tensor, *, force_torch: bool = False) -> torch.Tensor:
    """:func:`~reference_impl.families.deepseek_v4.cache_layout.fp4_simulate`, by the Triton kernel where it runs."""
    return _dispatch(
        "Triton V4 FP4 round trip",
        x.device,
        force_torch,
        lambda: _kernel("fp4_triton", "fp4_simulate_triton")(x),
        lambda: fp4_simulate_reference(x),
    )


V4_KERNEL_OPS = V4Ops("kernels", select_entries, sparse_attention, pool, rope_tail, fp4_simulate)
