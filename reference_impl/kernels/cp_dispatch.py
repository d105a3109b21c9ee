"""One dispatch point per phase-7 fused op: the Triton kernel where it can run, the torch path otherwise.

* :func:`fused_store_mla` — quantize + pack (FP8) or convert (BF16) + scatter MLA rows to pool slots;
* :func:`fused_store_index` — quantize + scatter indexer K into the index pages;
* :func:`rerange_padded` — padded rank-major all-gather buffer -> sequence order;
* :func:`materialize_rows` — gathered owned pages -> full-view rows;
* :func:`materialize_mla_rows` — its MLA half alone (phase 8's prefetch).

Each takes the same arguments whichever path runs and produces the same bytes (see the kernel
modules). The Triton path runs when
:func:`use_fused_kernels` says so: the tensors are on CUDA, Triton imports, ``debug`` is off, and
neither ``force_torch=True`` nor ``DSACP_FORCE_TORCH=1`` asks for torch. Debug mode takes the torch
path and range-checks the locs / rows on the host (a device sync), raising
:class:`~reference_impl.kvcache.pool.LocOutOfRangeError` where the kernel would skip the row.

If a kernel raises, the op logs ONE warning per process per kernel (``logging.getLogger(__name__)``)
and returns the torch result; later failures of that kernel fall back silently. Successful calls
log nothing (the ops run once per layer per rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from reference_impl.config import env_flag
from reference_impl.cp.split import SplitIndex
from reference_impl.sync_audit import diagnostic
from reference_impl.kernels import fused_torch
from reference_impl.kernels.dispatch import triton_available
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import LocOutOfRangeError, PagedKVPool

logger = logging.getLogger(__name__)

# Kernels that already logged their fallback warning in this process.
_WARNED: set[str] = set()


def _triton_device(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available()


def use_fused_kernels(device: torch.device | str, debug: bool = False) -> bool:
    """True when the fused Triton kernels run for tensors on ``device``: CUDA, Triton importable,
    not ``debug``, and ``DSACP_FORCE_TORCH`` unset. Depends only on the process's setup, so every
    rank of a CP group decides alike (the kernels launch no collective either way)."""
    if debug or env_flag("force_torch"):
        return False
    return _triton_device(torch.device(device))


def _warn_once(kernel: str, exc: BaseException) -> None:
    if kernel in _WARNED:
        return
    _WARNED.add(kernel)
    logger.warning(
        "Triton %s failed (%s: %s); falling back to the torch path (later failures of this kernel fall back silently)",
        kernel,
        type(exc).__name__,
        exc,
    )


def _run_triton(kernel: str, fn: Callable[[], object]) -> tuple[bool, object]:
    """(True, result) if the kernel ran; (False, None) after logging its first failure."""
    try:
        return True, fn()
    except Exception as exc:  # compile, launch or unsupported-input failures all fall back
        _warn_once(kernel, exc)
        return False, None


def _check_range(name: str, values: torch.Tensor, limit: int) -> None:
    if values.numel():
        with diagnostic():  # a host sync, debug only; not counted by phase 6's audit
            lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= limit:
            raise LocOutOfRangeError(f"{name} span [{lo}, {hi}] outside [0, {limit})")


# Indirections so that tests can substitute a failing kernel without CUDA.
def _triton_store_mla(*args: object) -> None:
    from reference_impl.kernels.fused_store import store_mla_triton

    store_mla_triton(*args)  # type: ignore[arg-type]


def _triton_store_index(*args: object) -> None:
    from reference_impl.kernels.fused_store import store_index_triton

    store_index_triton(*args)  # type: ignore[arg-type]


def _triton_rerange(raw: torch.Tensor, padded_index: torch.Tensor) -> torch.Tensor:
    from reference_impl.kernels.fused_rerange import rerange_padded_triton

    return rerange_padded_triton(raw, padded_index)


def _triton_materialize(*args: object) -> None:
    from reference_impl.kernels.fused_materialize import materialize_rows_triton

    materialize_rows_triton(*args)  # type: ignore[arg-type]


def _triton_materialize_mla(*args: object) -> None:
    from reference_impl.kernels.fused_materialize import materialize_mla_rows_triton

    materialize_mla_rows_triton(*args)  # type: ignore[arg-type]


def _fused(tensor: torch.Tensor, debug: bool, force_torch: bool) -> bool:
    return not force_torch and use_fused_kernels(tensor.device, debug)


def fused_store_mla(
    kv: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_mla: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
) -> None:
    """``pool_mla[dst_locs] = layout.pack_mla(kv[src_rows])`` in place.

    ``kv [N, kv_lora + rope]`` float; ``src_rows int64 [M]`` or ``None`` (all rows); ``dst_locs
    int64 [M]`` physical slots; ``pool_mla uint8 [n_slots, mla_bytes]`` (e.g. ``pool.mla[layer]``).
    """
    fused_torch.check_store_args(kv, layout.kv_width, src_rows, dst_locs, pool_mla, layout.mla_bytes, "store_mla")
    if debug:
        _check_range("dst_locs", dst_locs, pool_mla.shape[0])
    if _fused(kv, debug, force_torch):
        ran, _ = _run_triton("fused_store_mla", lambda: _triton_store_mla(kv, src_rows, dst_locs, pool_mla, layout))
        if ran:
            return
    fused_torch.store_mla_torch(kv, src_rows, dst_locs, pool_mla, layout)


def fused_store_index(
    k: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_index: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
) -> None:
    """Quantize ``k[src_rows]`` (``k [N, 128]``) and write it at ``dst_locs`` of ``pool_index
    uint8 [n_pages, P * 132]`` (e.g. ``pool.index[layer]``) in place, as ``write_index`` does."""
    fused_torch.check_store_args(
        k, layout.index_head_dim, src_rows, dst_locs, pool_index, layout.index_page_bytes, "store_index"
    )
    if debug:
        _check_range("dst_locs", dst_locs, pool_index.shape[0] * layout.page_size)
    if _fused(k, debug, force_torch):
        ran, _ = _run_triton(
            "fused_store_index", lambda: _triton_store_index(k, src_rows, dst_locs, pool_index, layout)
        )
        if ran:
            return
    fused_torch.store_index_torch(k, src_rows, dst_locs, pool_index, layout)


def rerange_padded(
    raw: torch.Tensor, index: SplitIndex, *, debug: bool = False, force_torch: bool = False
) -> torch.Tensor:
    """Padded all-gather buffer ``raw [C, max_len, ...]`` -> ``[T, ...]`` in sequence order (a new tensor).

    ``raw`` is :meth:`CPGroup.all_gather_rows_padded_raw`'s result for the split whose device
    tensors ``index`` holds.
    """
    fused_torch.check_rerange_args(raw, index.rank_lengths)
    if _fused(raw, debug, force_torch):
        ran, out = _run_triton("rerange_padded", lambda: _triton_rerange(raw, index.padded_rerange))
        if ran:
            return out  # type: ignore[return-value]
    return fused_torch.rerange_padded_torch(raw, index.rank_lengths, index.rerange)


def materialize_rows(
    mla_pages: torch.Tensor,
    index_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor,
    index_scale: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
) -> None:
    """Fill full-view rows ``view_rows`` from gathered token rows ``row_source`` in place.

    ``mla_pages`` uint8 ``[n_pages * P, mla_bytes]`` or ``[n_pages, P * mla_bytes]``;
    ``index_pages`` uint8 ``[n_pages, P * 132]``; ``kv_view`` bf16 ``[S, kv_width]``;
    ``index_fp8`` float8_e4m3fn ``[S, 128]``; ``index_scale`` float32 ``[S]``.
    """
    args = (mla_pages, index_pages, row_source, view_rows, kv_view, index_fp8, index_scale, layout)
    n_source = fused_torch.check_materialize_args(*args)
    if debug:
        _check_range("row_source", row_source, n_source)
        _check_range("view_rows", view_rows, kv_view.shape[0])
    if _fused(kv_view, debug, force_torch):
        ran, _ = _run_triton("materialize_rows", lambda: _triton_materialize(*args))
        if ran:
            return
    fused_torch.materialize_rows_torch(*args)


def materialize_mla_rows(
    mla_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
) -> None:
    """The MLA half of :func:`materialize_rows` (phase 8's prefetch: the index K stays synchronous):
    ``kv_view[view_rows] = bf16(dequantize(mla row row_source))`` in place."""
    n_source = fused_torch.check_materialize_mla_args(mla_pages, row_source, view_rows, kv_view, layout)
    if debug:
        _check_range("row_source", row_source, n_source)
        _check_range("view_rows", view_rows, kv_view.shape[0])
    args = (mla_pages, row_source, view_rows, kv_view, layout)
    if _fused(kv_view, debug, force_torch):
        ran, _ = _run_triton("materialize_mla_rows", lambda: _triton_materialize_mla(*args))
        if ran:
            return
    fused_torch.materialize_mla_rows_torch(*args)


def fused_store(
    pool: PagedKVPool,
    layer: int,
    kv: torch.Tensor,
    index_k: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    debug: bool,
) -> None:
    """Phase 7's store of one layer: MLA rows and indexer K of ``kv[src_rows]`` / ``index_k[src_rows]``
    at physical locs ``dst_locs`` of ``pool`` (both buffers, one call each)."""
    layout = pool.layout
    fused_store_mla(kv, src_rows, dst_locs, pool.mla[layer], layout, debug=debug)
    fused_store_index(index_k, src_rows, dst_locs, pool.index[layer], layout, debug=debug)
