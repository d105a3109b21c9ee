"""One dispatch point for the two compute cores of a DSA layer: indexer top-k and sparse MLA attention.

:func:`indexer_topk` and :func:`sparse_mla_attention` take the same arguments and return the same
results as the torch references in :mod:`reference_impl.model.sparse_attention` (plus a keyword-only
``force_torch``). They run the Triton kernel when the inputs live on a CUDA device and Triton
imports, and the torch reference otherwise (CPU tensors, no Triton, ``force_torch=True``, or the
environment variable ``DSACP_FORCE_TORCH=1``). If a Triton kernel raises, the call logs one warning
per process per kernel (``logging.getLogger(__name__)``) and returns the torch result; successful
calls log nothing.

Sparse MLA attention has a third, preferred path on Hopper: the Gluon kernel
(:mod:`reference_impl.kernels.sparse_mla_gluon`) runs where
:func:`~reference_impl.kernels.sparse_mla_gluon.gluon_supported` holds (sm_90, bf16 / fp16, the
DeepSeek widths) unless ``DSACP_NO_GLUON=1``; elsewhere, or after a Gluon failure (one warning), the
Triton kernel runs.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Callable

import torch

from reference_impl.config import env_flag
from reference_impl.model import sparse_attention as torch_ref
from reference_impl.model.sparse_attention import HostKeyBounds

logger = logging.getLogger(__name__)

# Kernels that already logged their fallback warning in this process.
_WARNED: set[str] = set()


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``triton`` and ``triton.language`` import in this process (cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else at import
        return False
    return True


def _on_triton_device(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and triton_available()


def _use_triton(tensor: torch.Tensor, force_torch: bool) -> bool:
    if force_torch or env_flag("force_torch"):
        return False
    return _on_triton_device(tensor)


def _warn_once(kernel: str, exc: BaseException, fallback: str = "the torch reference") -> None:
    if kernel in _WARNED:
        return
    _WARNED.add(kernel)
    logger.warning(
        "%s failed (%s: %s); falling back to %s (later failures of this kernel fall back silently)",
        kernel,
        type(exc).__name__,
        exc,
        fallback,
    )


@lru_cache(maxsize=1)
def gluon_available() -> bool:
    """True when Triton's Gluon front end (``triton.experimental.gluon``) imports (cached)."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except Exception:  # older Triton, or a broken install
        return False
    return True


# Indirections so that tests can substitute a failing kernel without CUDA.
def _gluon_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Gluon kernel's result, or ``None`` where it does not apply (then the Triton kernel runs)."""
    if sparse_mla_kernel(q, kv, d_v) != "gluon":
        return None
    from reference_impl.kernels.sparse_mla_gluon import sparse_mla_attention_gluon

    return sparse_mla_attention_gluon(q, kv, indices, softmax_scale, d_v, out_dtype=out_dtype)


def _triton_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    from reference_impl.kernels.sparse_mla_triton import sparse_mla_attention_triton

    return sparse_mla_attention_triton(q, kv, indices, softmax_scale, d_v, out_dtype=out_dtype)


def _triton_indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    topk: int,
    rows_per_chunk: int,
    host_bounds: HostKeyBounds | None = None,
) -> torch.Tensor:
    from reference_impl.kernels.indexer_triton import indexer_topk_triton

    return indexer_topk_triton(q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk, host_bounds)


def _try_triton(kernel: str, fn: Callable[[], object], fallback: str = "the torch reference") -> object | None:
    try:
        return fn()
    except Exception as exc:  # any kernel failure (compile, launch, unsupported input) falls back
        _warn_once(kernel, exc, fallback)
        return None


def sparse_mla_kernel(q: torch.Tensor, kv: torch.Tensor, d_v: int, *, force_torch: bool = False) -> str:
    """The path :func:`sparse_mla_attention` tries first for these inputs: ``"gluon"``, ``"triton"`` or ``"torch"``."""
    if not _use_triton(q, force_torch):
        return "torch"
    if env_flag("no_gluon") or not gluon_available():
        return "triton"
    from reference_impl.kernels.sparse_mla_gluon import gluon_supported

    return "gluon" if gluon_supported(q, kv, d_v) else "triton"


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    rows_per_chunk: int = 0,
    *,
    out_dtype: torch.dtype = torch.float32,
    force_torch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA attention over the selected rows -> (out [T, H, d_v] ``out_dtype``, lse [T, H] f32, natural log).

    See :func:`reference_impl.model.sparse_attention.sparse_mla_attention` for the contract.
    ``rows_per_chunk`` bounds the torch path's memory; the Triton kernel needs no chunking.
    ``out_dtype`` (float32 by default): the kernel rounds its fp32 result once when it stores it,
    as ``.to(out_dtype)`` would; a bf16 output saves the fp32 ``[T, H, d_v]`` buffer.
    On Hopper the Gluon kernel runs first (see the module docstring), then the Triton kernel.
    """
    if _use_triton(q, force_torch):
        result = _try_triton(
            "Gluon sparse_mla_attention",
            lambda: _gluon_sparse_mla(q, kv, indices, softmax_scale, d_v, out_dtype),
            fallback="the Triton kernel",
        )
        if result is None:
            result = _try_triton(
                "Triton sparse_mla_attention", lambda: _triton_sparse_mla(q, kv, indices, softmax_scale, d_v, out_dtype)
            )
        if result is not None:
            return result  # type: ignore[return-value]
    out, lse = torch_ref.sparse_mla_attention(q, kv, indices, softmax_scale, d_v, rows_per_chunk)
    return out.to(out_dtype), lse


def indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    topk: int,
    rows_per_chunk: int = 0,
    *,
    host_bounds: HostKeyBounds | None = None,
    force_torch: bool = False,
) -> torch.Tensor:
    """Top-``min(topk, visible)`` full-view rows per query -> [T, topk] int32, -1 padded.

    See :func:`reference_impl.model.sparse_attention.indexer_topk` for the contract.
    """
    if _use_triton(q_fp8, force_torch):
        result = _try_triton(
            "Triton indexer_topk",
            lambda: _triton_indexer_topk(
                q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk, host_bounds
            ),
        )
        if result is not None:
            return result  # type: ignore[return-value]
    return torch_ref.indexer_topk(q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk, host_bounds)
