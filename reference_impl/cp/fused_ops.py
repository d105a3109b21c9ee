"""Phase 7's fused ops, one dispatch point each: the Triton kernel where it can run, the torch path otherwise.

* :func:`fused_store_mla` — quantize + pack (FP8) or convert (BF16) + scatter MLA rows to pool slots;
* :func:`fused_store_index` — quantize + scatter indexer K into the index pages;
* :func:`rerange_padded` — padded rank-major all-gather buffer -> sequence order;
* :func:`materialize_rows` — gathered owned pages -> full-view rows;
* :func:`materialize_mla_rows` — its MLA half alone (phase 8's prefetch);
* :func:`fill_current_rows` — the gathered chunk -> its full-view rows, with the cache's rounding (phase 3's reuse).

Each takes the same arguments whichever path runs and produces the same bytes (see the kernel
modules in :mod:`reference_impl.kernels`). Which path runs, and what a failing kernel does, is the
one rule of :mod:`reference_impl.kernels.fallback` (CUDA and Triton, not debug, not forced to
torch; one warning per failing kernel, then the torch path).

**Out-of-range locs / rows** are refused the same way on both paths: the op reads them on the host
and raises :class:`~reference_impl.kvcache.pool.LocOutOfRangeError` before either path runs. That
read synchronizes a GPU, so a caller that range-checked its locs once per batch (the engine's KV
stores do, before the layer loop) passes ``locs_checked=True`` and the op reads nothing; the
kernels still mask such rows, so a broken promise cannot write outside the pool. Debug mode checks
every call (inside :func:`~reference_impl.sync_audit.diagnostic`, not counted by phase 6's audit).
"""

from __future__ import annotations

import contextlib

import torch

from reference_impl.cp.current_reuse import fill_rows
from reference_impl.cp.split_index import SplitIndex
from reference_impl.kernels import fallback, fused_torch
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range
from reference_impl.sync_audit import diagnostic


def _check(name: str, values: torch.Tensor, limit: int, debug: bool, locs_checked: bool) -> None:
    """Range-check ``values`` on the host unless the caller already did (debug always checks)."""
    if debug or not locs_checked:
        with diagnostic() if debug else contextlib.nullcontext():  # a debug check syncs on purpose
            check_in_range(name, values, limit)


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


def _triton_fill_current(*args: object) -> None:
    from reference_impl.kernels.fused_current import fill_current_triton

    fill_current_triton(*args)  # type: ignore[arg-type]


def _use_kernels(device: torch.device, debug: bool, force_torch: bool) -> bool:
    return fallback.use_kernels(device, debug=debug, force_torch=force_torch)


def _run(kernel: str, tensor: torch.Tensor, debug: bool, force_torch: bool, fast, torch_path):  # type: ignore[no-untyped-def]
    if _use_kernels(tensor.device, debug, force_torch):
        return fallback.run_with_fallback(kernel, fast, torch_path)
    return torch_path()


def fused_store_mla(
    kv: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_mla: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
    locs_checked: bool = False,
) -> None:
    """``pool_mla[dst_locs] = layout.pack_mla(kv[src_rows])`` in place.

    ``kv [N, kv_lora + rope]`` float; ``src_rows int64 [M]`` or ``None`` (all rows); ``dst_locs
    int64 [M]`` physical slots; ``pool_mla uint8 [n_slots, mla_bytes]`` (e.g. ``pool.mla[layer]``).
    """
    fused_torch.check_store_args(kv, layout.kv_width, src_rows, dst_locs, pool_mla, layout.mla_bytes, "store_mla")
    _check("dst_locs", dst_locs, pool_mla.shape[0], debug, locs_checked)
    _run(
        "Triton fused_store_mla",
        kv,
        debug,
        force_torch,
        lambda: _triton_store_mla(kv, src_rows, dst_locs, pool_mla, layout),
        lambda: fused_torch.store_mla_torch(kv, src_rows, dst_locs, pool_mla, layout),
    )


def fused_store_index(
    k: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_index: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
    locs_checked: bool = False,
) -> None:
    """Quantize ``k[src_rows]`` (``k [N, 128]``) and write it at ``dst_locs`` of ``pool_index
    uint8 [n_pages, P * 132]`` (e.g. ``pool.index_of(layer)``) in place, as ``write_index`` does."""
    fused_torch.check_store_args(
        k, layout.index_head_dim, src_rows, dst_locs, pool_index, layout.index_page_bytes, "store_index"
    )
    _check("dst_locs", dst_locs, pool_index.shape[0] * layout.page_size, debug, locs_checked)
    _run(
        "Triton fused_store_index",
        k,
        debug,
        force_torch,
        lambda: _triton_store_index(k, src_rows, dst_locs, pool_index, layout),
        lambda: fused_torch.store_index_torch(k, src_rows, dst_locs, pool_index, layout),
    )


def rerange_padded(
    raw: torch.Tensor, index: SplitIndex, *, debug: bool = False, force_torch: bool = False
) -> torch.Tensor:
    """Padded all-gather buffer ``raw [C, max_len, ...]`` -> ``[T, ...]`` in sequence order (a new tensor).

    ``raw`` is :meth:`CPGroup.all_gather_rows_padded_raw`'s result for the split whose device
    tensors ``index`` holds.
    """
    fused_torch.check_rerange_args(raw, index.rank_lengths)
    return _run(  # type: ignore[no-any-return]
        "Triton rerange_padded",
        raw,
        debug,
        force_torch,
        lambda: _triton_rerange(raw, index.padded_rerange),
        lambda: fused_torch.rerange_padded_torch(raw, index.rank_lengths, index.rerange),
    )


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
    locs_checked: bool = False,
) -> None:
    """Fill full-view rows ``view_rows`` from gathered token rows ``row_source`` in place.

    ``mla_pages`` uint8 ``[n_pages * P, mla_bytes]`` or ``[n_pages, P * mla_bytes]``;
    ``index_pages`` uint8 ``[n_pages, P * 132]``; ``kv_view`` bf16 ``[S, kv_width]``;
    ``index_fp8`` float8_e4m3fn ``[S, 128]``; ``index_scale`` float32 ``[S]``.
    """
    args = (mla_pages, index_pages, row_source, view_rows, kv_view, index_fp8, index_scale, layout)
    n_source = fused_torch.check_materialize_args(*args)
    _check("row_source", row_source, n_source, debug, locs_checked)
    _check("view_rows", view_rows, kv_view.shape[0], debug, locs_checked)
    _run(
        "Triton materialize_rows",
        kv_view,
        debug,
        force_torch,
        lambda: _triton_materialize(*args),
        lambda: fused_torch.materialize_rows_torch(*args),
    )


def materialize_mla_rows(
    mla_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
    locs_checked: bool = False,
) -> None:
    """The MLA half of :func:`materialize_rows` (phase 8's prefetch: the index K stays synchronous):
    ``kv_view[view_rows] = bf16(dequantize(mla row row_source))`` in place."""
    n_source = fused_torch.check_materialize_mla_args(mla_pages, row_source, view_rows, kv_view, layout)
    _check("row_source", row_source, n_source, debug, locs_checked)
    _check("view_rows", view_rows, kv_view.shape[0], debug, locs_checked)
    args = (mla_pages, row_source, view_rows, kv_view, layout)
    _run(
        "Triton materialize_mla_rows",
        kv_view,
        debug,
        force_torch,
        lambda: _triton_materialize_mla(*args),
        lambda: fused_torch.materialize_mla_rows_torch(*args),
    )


def fill_current_rows(
    kv_seq: torch.Tensor,
    index_k_seq: torch.Tensor | None,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor | None,
    index_scale: torch.Tensor | None,
    layout: KVLayout,
    *,
    debug: bool = False,
    force_torch: bool = False,
    locs_checked: bool = False,
) -> None:
    """Phase 3's current rows of the full view, in one pass: ``kv_view[view_rows] =
    bf16(dequantize(pack_mla(kv_seq)))`` and ``index_fp8 / index_scale[view_rows] =
    quantize_index_k(index_k_seq)``, in place (:func:`reference_impl.cp.current_reuse.fill_rows`).
    The index tensors are ``None`` together on an IndexShare shared layer: the MLA rows alone."""
    args = (kv_seq, index_k_seq, view_rows, kv_view, index_fp8, index_scale, layout)
    fused_torch.check_fill_current_args(*args)
    _check("view_rows", view_rows, kv_view.shape[0], debug, locs_checked)
    _run(
        "Triton fill_current",
        kv_view,
        debug,
        force_torch,
        lambda: _triton_fill_current(*args),
        lambda: fill_rows(*args),
    )


def fused_store(
    pool: PagedKVPool,
    layer: int,
    kv: torch.Tensor,
    index_k: torch.Tensor | None,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    debug: bool,
    locs_checked: bool = False,
) -> None:
    """Phase 7's store of one layer: MLA rows and indexer K of ``kv[src_rows]`` / ``index_k[src_rows]``
    at physical locs ``dst_locs`` of ``pool`` (both buffers, one call each; ``index_k=None`` on an
    IndexShare shared layer, which keeps no index K: the MLA rows alone)."""
    layout = pool.layout
    fused_store_mla(kv, src_rows, dst_locs, pool.mla[layer], layout, debug=debug, locs_checked=locs_checked)
    if index_k is not None:
        fused_store_index(
            index_k, src_rows, dst_locs, pool.index_of(layer), layout, debug=debug, locs_checked=locs_checked
        )
