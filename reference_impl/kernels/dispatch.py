"""One dispatch point for what a DSA layer runs as kernels: indexer top-k, sparse MLA attention and the glue.

:func:`indexer_topk` and :func:`sparse_mla_attention` take the arguments of the torch references in
:mod:`reference_impl.model.sparse_attention` (plus a keyword-only ``force_torch``) and return the
same results. :data:`KERNEL_OPS` bundles them as the model's
:class:`~reference_impl.model.sparse_attention.ComputeOps`: a model built with it
(``DSAModel(cfg, dtype, ops=KERNEL_OPS)``, what :func:`reference_impl.workload.build_model` does)
runs these kernels; a model built without it runs the torch references.

Which path runs (:mod:`.fallback`): the kernel where the inputs live on a CUDA device and Triton
imports, the torch reference otherwise (CPU tensors, no Triton, ``force_torch=True`` or
``DSACP_FORCE_TORCH=1``); a kernel that raises logs one warning and the next path runs.

Sparse MLA attention has two preferred paths on Hopper, both Gluon: the warp-specialized kernel
(:mod:`reference_impl.kernels.sparse_mla_gluon_ws`) where
:func:`~reference_impl.kernels.sparse_mla_gluon_ws.ws_supported` holds (sm_90, bf16 / fp16, the
DeepSeek widths) unless ``DSACP_NO_GLUON_WS=1``, then the first Gluon kernel
(:mod:`reference_impl.kernels.sparse_mla_gluon`, wider rope parts) where
:func:`~reference_impl.kernels.sparse_mla_gluon.gluon_supported` holds; ``DSACP_NO_GLUON=1`` skips
both. Elsewhere, or after a failure (one warning each), the next one runs. Order: warp-specialized
Gluon -> Gluon -> Triton -> torch.

Indexer top-k is the Triton logits kernel, then the Triton selection kernel
(:mod:`reference_impl.kernels.topk_select`; ``torch.topk`` after a selection failure, one warning,
or where ``DSACP_TRITON_TOPK=0``); the torch reference where the kernels do not run. With
``DSACP_FUSED_BOUND=1`` the selection's bound reads the group maxima the logits kernel writes beside
the logits instead of the logits (the fused bound; off by default, see
:mod:`reference_impl.kernels.topk_select`; measured: ``docs/compute-kernels.md#top-k-selection``).

The per-token glue runs one-pass Triton kernels where the kernels run: the query preparation
(:mod:`reference_impl.model.query_prep`: the indexer query's RoPE, Hadamard rotation and FP8
quantization, and the MLA query's RoPE; :mod:`reference_impl.kernels.query_prep_triton`) and
RMSNorm (:mod:`reference_impl.kernels.rms_norm_triton`), unless ``DSACP_NO_FUSED_GLUE=1`` (the
torch ops, for comparisons). Inputs the kernels do not take go to the references; a kernel that
raises falls back to them with one warning.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import torch

from reference_impl.config import env_flag
from reference_impl.kernels import fallback
from reference_impl.model import norm, query_prep
from reference_impl.model import sparse_attention as torch_ref
from reference_impl.model.sparse_attention import ComputeOps, HostKeyBounds

logger = logging.getLogger(__name__)

T = TypeVar("T")


@lru_cache(maxsize=1)
def gluon_available() -> bool:
    """True when Triton's Gluon front end (``triton.experimental.gluon``) imports (cached)."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except Exception:  # older Triton, or a broken install
        return False
    return True


# The launchers: each imports its kernel module when first called (SPARSE_MLA_LAUNCHERS registers them).
def _gluon_ws_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    from reference_impl.kernels.sparse_mla_gluon_ws import sparse_mla_attention_gluon_ws

    return sparse_mla_attention_gluon_ws(q, kv, indices, softmax_scale, d_v, out_dtype=out_dtype)


def _gluon_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
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

    return indexer_topk_triton(
        q_fp8,
        weights,
        k_fp8,
        k_scale,
        key_start,
        key_end,
        topk,
        rows_per_chunk,
        host_bounds,
        selector=topk_selector(),
        fused_bound=env_flag("fused_bound"),
    )


def topk_selector() -> str:
    """What picks the indexer's top-k after the Triton logits: ``"triton"`` (the selection kernel,
    :mod:`reference_impl.kernels.topk_select`, exact; measured against ``torch.topk``:
    ``docs/compute-kernels.md#top-k-selection``) unless ``DSACP_TRITON_TOPK=0`` asks for ``"torch"``
    (``torch.topk``, for comparisons)."""
    return "triton" if env_flag("triton_topk", default=True) else "torch"


def sparse_mla_kernels(q: torch.Tensor, kv: torch.Tensor, d_v: int, *, force_torch: bool = False) -> list[str]:
    """The paths :func:`sparse_mla_attention` tries for these inputs, in order, each falling back to the
    next: some of ``"gluon_ws"``, ``"gluon"``, ``"triton"``, always ending with ``"torch"``."""
    if not fallback.use_kernels(q.device, force_torch=force_torch):
        return ["torch"]
    paths = ["triton", "torch"]
    if env_flag("no_gluon") or not gluon_available():
        return paths
    from reference_impl.kernels.sparse_mla_gluon import gluon_supported
    from reference_impl.kernels.sparse_mla_gluon_ws import ws_supported

    if gluon_supported(q, kv, d_v):
        paths.insert(0, "gluon")
    if not env_flag("no_gluon_ws") and ws_supported(q, kv, d_v):
        paths.insert(0, "gluon_ws")
    return paths


def sparse_mla_kernel(q: torch.Tensor, kv: torch.Tensor, d_v: int, *, force_torch: bool = False) -> str:
    """The path :func:`sparse_mla_attention` tries first for these inputs: ``"gluon_ws"``, ``"gluon"``,
    ``"triton"`` or ``"torch"``."""
    return sparse_mla_kernels(q, kv, d_v, force_torch=force_torch)[0]


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
    ``rows_per_chunk`` bounds the torch path's memory; the kernels need no chunking.
    ``out_dtype`` (float32 by default): the kernel rounds its fp32 result once when it stores it,
    as ``.to(out_dtype)`` would; a bf16 output saves the fp32 ``[T, H, d_v]`` buffer.
    """
    args = (q, kv, indices, softmax_scale, d_v, out_dtype)
    return _sparse_mla_chain(sparse_mla_kernels(q, kv, d_v, force_torch=force_torch), args, rows_per_chunk)


class _KernelPath(NamedTuple):
    """One sparse MLA kernel path: its name in a fallback warning and how the previous path's warning names it."""

    warning_name: str
    referred_to_as: str


_SPARSE_MLA_PATHS = {
    "gluon_ws": _KernelPath("Warp-specialized Gluon sparse_mla_attention", "the warp-specialized Gluon kernel"),
    "gluon": _KernelPath("Gluon sparse_mla_attention", "the Gluon kernel"),
    "triton": _KernelPath("Triton sparse_mla_attention", "the Triton kernel"),
}

SparseMlaLauncher = Callable[..., tuple[torch.Tensor, torch.Tensor]]
SPARSE_MLA_LAUNCHERS: dict[str, SparseMlaLauncher] = {
    "gluon_ws": _gluon_ws_sparse_mla,
    "gluon": _gluon_sparse_mla,
    "triton": _triton_sparse_mla,
}
"""Path -> the launcher the dispatch calls, looked up when called: the registered seam where a test or a
benchmark stands another kernel in (``monkeypatch.setitem(SPARSE_MLA_LAUNCHERS, "triton", spy)``)."""


def _sparse_mla_chain(
    paths: list[str], args: tuple[Any, ...], rows_per_chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paths[0]``, falling back along the rest (``args``: the launchers' arguments).

    A module function, not a closure that calls itself: such a closure is a reference cycle that
    holds the layer's ``q``, ``kv`` and ``indices`` until the cyclic garbage collector happens to run
    (2.25 GiB of bf16 ``q`` per layer at 16K local tokens and 128 heads, accumulating over layers)."""
    path, rest = paths[0], paths[1:]
    if path == "torch":
        q, kv, indices, softmax_scale, d_v, out_dtype = args
        out, lse = torch_ref.sparse_mla_attention(q, kv, indices, softmax_scale, d_v, rows_per_chunk)
        return out.to(out_dtype), lse
    this = _SPARSE_MLA_PATHS[path]
    launch = SPARSE_MLA_LAUNCHERS[path]
    to = "the torch path" if rest[0] == "torch" else _SPARSE_MLA_PATHS[rest[0]].referred_to_as
    return fallback.run_with_fallback(
        this.warning_name, lambda: launch(*args), lambda: _sparse_mla_chain(rest, args, rows_per_chunk), to=to
    )


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
    args = (q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk, host_bounds)

    def torch_path() -> torch.Tensor:
        return torch_ref.indexer_topk(*args)

    if not fallback.use_kernels(q_fp8.device, force_torch=force_torch):
        return torch_path()
    return fallback.run_with_fallback("Triton indexer_topk", lambda: _triton_indexer_topk(*args), torch_path)


def _run_glue(
    name: str,
    device: torch.device,
    force_torch: bool,
    unsupported: Callable[[], str | None],
    kernel: Callable[[], T],
    reference: Callable[[], T],
) -> T:
    """The glue's one rule: ``kernel()`` where the kernels run, ``DSACP_NO_FUSED_GLUE`` is unset and
    ``unsupported()`` names no reason; else ``reference()``, also after the kernel raised (one warning)."""
    if not fallback.use_kernels(device, force_torch=force_torch) or env_flag("no_fused_glue") or unsupported():
        return reference()
    return fallback.run_with_fallback(f"Triton {name}", kernel, reference)


def _kernels(module: str) -> ModuleType:
    """A glue kernel module, imported on first use (it imports Triton, which CPU-only runs may lack)."""
    return importlib.import_module(f"reference_impl.kernels.{module}")


def indexer_query(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hadamard: torch.Tensor,
    head_weights: torch.Tensor,
    rope_dim: int,
    interleaved: bool,
    scale_fmt: str,
    *,
    force_torch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer query's RoPE, rotation, FP8 quantization and head weights -> ``(q_fp8, weights)``.

    See :func:`reference_impl.model.query_prep.indexer_query` for the contract. The Triton kernel
    (:func:`~reference_impl.kernels.query_prep_triton.indexer_query_triton`) runs where the kernels
    run and it supports the inputs (bf16 / float32, ``D = 128``); the reference elsewhere.
    """
    args = (q, cos, sin, hadamard, head_weights, rope_dim, interleaved, scale_fmt)
    return _run_glue(
        "indexer_query",
        q.device,
        force_torch,
        lambda: _kernels("query_prep_triton").indexer_query_unsupported(q, rope_dim, scale_fmt),
        lambda: _kernels("query_prep_triton").indexer_query_triton(*args),
        lambda: query_prep.indexer_query(*args),
    )


def rope_into(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    *,
    force_torch: bool = False,
) -> None:
    """RoPE of ``x`` written into ``out``; see :func:`reference_impl.model.query_prep.rope_into`.

    The Triton kernel (:func:`~reference_impl.kernels.query_prep_triton.rope_into_triton`) runs where
    the kernels run and it supports the tensors (bf16 / float32); the reference elsewhere.
    """
    args = (out, x, cos, sin, interleaved)
    return _run_glue(
        "rope_into",
        x.device,
        force_torch,
        lambda: _kernels("query_prep_triton").rope_into_unsupported(out, x),
        lambda: _kernels("query_prep_triton").rope_into_triton(*args),
        lambda: query_prep.rope_into(*args),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, force_torch: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` -> ``x.dtype``; see :func:`reference_impl.model.norm.rms_norm` for the contract.

    The Triton kernel (:func:`~reference_impl.kernels.rms_norm_triton.rms_norm_triton`) runs where
    the kernels run and it supports the tensors (bf16 / float32 rows); the reference elsewhere.
    """
    return _run_glue(
        "rms_norm",
        x.device,
        force_torch,
        lambda: _kernels("rms_norm_triton").rms_norm_unsupported(x, weight),
        lambda: _kernels("rms_norm_triton").rms_norm_triton(x, weight, eps),
        lambda: norm.rms_norm(x, weight, eps),
    )


KERNEL_OPS = ComputeOps("kernels", indexer_topk, sparse_mla_attention, indexer_query, rope_into, rms_norm)
"""The model's :class:`~reference_impl.model.sparse_attention.ComputeOps` through this dispatch."""
