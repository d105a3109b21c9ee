"""The plain-torch paths that the phase-7 fused kernels replace (and fall back to).

Each function is the existing code of the engine, lifted onto raw tensors so that the kernels and
their fallbacks share one signature:

* :func:`store_mla_torch`: ``layout.pack_mla`` then ``index_copy_`` into the pool rows
  (:meth:`PagedKVPool.write_mla`);
* :func:`store_index_torch`: ``layout.quantize_index_k`` then the page/slot assignment of
  :meth:`PagedKVPool.write_index`;
* :func:`rerange_padded_torch`: trim the padded all-gather buffer (:meth:`CPGroup.all_gather_padded`),
  then ``index_select`` by the rerange index (:func:`reference_impl.cp.rerange.rerange`): two passes;
* :func:`materialize_rows_torch`: dequantize the gathered MLA rows and copy the index bytes and
  scales into the full view (:meth:`ShardedKV.full_view`).

No Triton import here: these run wherever torch runs.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError
from reference_impl.fp8 import FP8_DTYPE
from reference_impl.kvcache.layout import INDEX_HEAD_DIM, SCALE_BYTES, KVLayout

# ---- argument checks (metadata only: no device sync), shared with the kernels --------------------


def check_store_args(
    values: torch.Tensor,
    width: int,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool: torch.Tensor,
    pool_cols: int,
    what: str,
) -> None:
    """Metadata-only checks (no device sync) shared by the kernels and the torch paths."""
    if values.dim() != 2 or values.shape[1] != width or not values.is_floating_point():
        raise ConfigError(
            f"{what}: input must be a float [N, {width}] tensor, got {values.dtype} {tuple(values.shape)}"
        )
    if dst_locs.dtype != torch.int64 or dst_locs.dim() != 1:
        raise ConfigError(f"{what}: dst_locs must be int64 [M], got {dst_locs.dtype} {tuple(dst_locs.shape)}")
    n = values.shape[0] if src_rows is None else src_rows.shape[0]
    if src_rows is not None and (src_rows.dtype != torch.int64 or src_rows.dim() != 1):
        raise ConfigError(f"{what}: src_rows must be int64 [M], got {src_rows.dtype} {tuple(src_rows.shape)}")
    if dst_locs.shape[0] != n:
        raise ConfigError(f"{what}: {dst_locs.shape[0]} dst_locs for {n} rows to store")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != pool_cols or pool.stride(1) != 1:
        raise ConfigError(
            f"{what}: pool must be uint8 [rows, {pool_cols}] with contiguous rows, got {pool.dtype} {tuple(pool.shape)}"
        )
    devices = {values.device, dst_locs.device, pool.device} | ({src_rows.device} if src_rows is not None else set())
    if len(devices) != 1:
        raise ConfigError(f"{what}: tensors on several devices {sorted(map(str, devices))}")


def mla_strides(mla_pages: torch.Tensor, layout: KVLayout) -> tuple[int, int, int]:
    """(page stride, token-row stride, token rows) in bytes of either accepted MLA shape."""
    bad = mla_pages.dtype != torch.uint8 or mla_pages.dim() != 2 or mla_pages.stride(1) != 1
    if not bad and mla_pages.shape[1] == layout.mla_bytes:
        if mla_pages.shape[0] % layout.page_size:
            raise ConfigError(
                f"materialize: {mla_pages.shape[0]} MLA token rows are not whole pages of {layout.page_size}"
            )
        return layout.page_size * mla_pages.stride(0), mla_pages.stride(0), mla_pages.shape[0]
    if not bad and mla_pages.shape[1] == layout.mla_page_bytes:
        return mla_pages.stride(0), layout.mla_bytes, mla_pages.shape[0] * layout.page_size
    raise ConfigError(
        f"materialize: MLA bytes must be uint8 [n * {layout.page_size}, {layout.mla_bytes}] or "
        f"[n, {layout.mla_page_bytes}] with contiguous rows, got {mla_pages.dtype} {tuple(mla_pages.shape)}"
    )


def check_materialize_mla_args(
    mla_pages: torch.Tensor, row_source: torch.Tensor, view_rows: torch.Tensor, kv_view: torch.Tensor, layout: KVLayout
) -> int:
    """Metadata-only checks of the MLA half, shared with the torch path; returns the gathered token-row count."""
    n_source = mla_strides(mla_pages, layout)[2]
    for name, t in (("row_source", row_source), ("view_rows", view_rows)):
        if t.dtype != torch.int64 or t.dim() != 1 or t.shape != row_source.shape:
            raise ConfigError(f"materialize: {name} must be int64 [R] like row_source, got {t.dtype} {tuple(t.shape)}")
    n_view = kv_view.shape[0]
    if kv_view.dtype != torch.bfloat16 or kv_view.shape != (n_view, layout.kv_width) or kv_view.stride(1) != 1:
        raise ConfigError(
            f"materialize: kv_view must be bf16 [S, {layout.kv_width}] with contiguous rows, "
            f"got {kv_view.dtype} {tuple(kv_view.shape)}"
        )
    return n_source


def check_materialize_args(
    mla_pages: torch.Tensor,
    index_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor,
    index_scale: torch.Tensor,
    layout: KVLayout,
) -> int:
    """Metadata-only checks shared with the torch path; returns the gathered token-row count."""
    n_source = check_materialize_mla_args(mla_pages, row_source, view_rows, kv_view, layout)
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 2 or index_pages.shape[1] != layout.index_page_bytes:
        raise ConfigError(
            f"materialize: index pages must be uint8 [n, {layout.index_page_bytes}], "
            f"got {index_pages.dtype} {tuple(index_pages.shape)}"
        )
    if index_pages.shape[0] * layout.page_size != n_source or index_pages.stride(1) != 1:
        raise ConfigError(f"materialize: {index_pages.shape[0]} index pages for {n_source} MLA token rows")
    n_view = kv_view.shape[0]
    if index_fp8.dtype != FP8_DTYPE or index_fp8.shape != (n_view, INDEX_HEAD_DIM) or index_fp8.stride(1) != 1:
        raise ConfigError(
            f"materialize: index_fp8 must be float8_e4m3fn [{n_view}, {INDEX_HEAD_DIM}], "
            f"got {index_fp8.dtype} {tuple(index_fp8.shape)}"
        )
    if index_scale.dtype != torch.float32 or index_scale.shape != (n_view,):
        raise ConfigError(
            f"materialize: index_scale must be float32 [{n_view}], got {index_scale.dtype} {tuple(index_scale.shape)}"
        )
    return n_source


def check_fill_current_args(
    kv_seq: torch.Tensor,
    index_k_seq: torch.Tensor | None,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor | None,
    index_scale: torch.Tensor | None,
    layout: KVLayout,
) -> None:
    """Metadata-only checks of the current-rows fill, shared by its torch path's caller and the kernel.

    The three index tensors come together or not at all (``None``: a layer without indexer K).
    """
    n = view_rows.shape[0]
    if view_rows.dtype != torch.int64 or view_rows.dim() != 1:
        raise ConfigError(f"fill_current: view_rows must be int64 [T], got {view_rows.dtype} {tuple(view_rows.shape)}")
    present = [t is not None for t in (index_k_seq, index_fp8, index_scale)]
    if any(present) and not all(present):
        raise ConfigError("fill_current: give index_k_seq, index_fp8 and index_scale together, or none of them")
    if kv_seq.shape != (n, layout.kv_width) or (index_k_seq is not None and index_k_seq.shape != (n, INDEX_HEAD_DIM)):
        shape = None if index_k_seq is None else tuple(index_k_seq.shape)
        raise ConfigError(
            f"fill_current: kv_seq {tuple(kv_seq.shape)} and index_k_seq {shape} must be "
            f"[{n}, {layout.kv_width}] and [{n}, {INDEX_HEAD_DIM}] (one row per view row)"
        )
    n_view = kv_view.shape[0]
    bad_view = kv_view.dtype != torch.bfloat16 or kv_view.shape != (n_view, layout.kv_width) or kv_view.stride(-1) != 1
    bad_index = (
        index_fp8 is not None
        and index_scale is not None
        and (
            index_fp8.dtype != FP8_DTYPE
            or index_fp8.shape != (n_view, INDEX_HEAD_DIM)
            or index_scale.dtype != torch.float32
            or index_scale.shape != (n_view,)
            or index_fp8.stride(-1) != 1
            or index_scale.stride(-1) != 1
        )
    )
    if bad_view or bad_index:
        index = (
            "none"
            if index_fp8 is None or index_scale is None
            else (f"{index_fp8.dtype} {tuple(index_fp8.shape)}, {index_scale.dtype} {tuple(index_scale.shape)}")
        )
        raise ConfigError(
            f"fill_current: the full view must be bf16 kv [S, {layout.kv_width}], float8_e4m3fn index K "
            f"[S, {INDEX_HEAD_DIM}] and float32 scales [S], row-contiguous; got {kv_view.dtype} "
            f"{tuple(kv_view.shape)}, index {index}"
        )


def check_rerange_args(raw: torch.Tensor, lengths: tuple[int, ...]) -> None:
    """``raw`` must be the padded all-gather buffer of ranks sending ``lengths`` rows: ``[C, max(lengths), ...]``."""
    if raw.dim() < 2 or tuple(raw.shape[:2]) != (len(lengths), max(lengths)):
        raise ConfigError(
            f"rerange: raw must be [C={len(lengths)}, max_len={max(lengths)}, ...], got {tuple(raw.shape)}"
        )


# ---- torch paths ----------------------------------------------------------------------------------


def store_mla_torch(
    kv: torch.Tensor, src_rows: torch.Tensor | None, dst_locs: torch.Tensor, pool_mla: torch.Tensor, layout: KVLayout
) -> None:
    """``pool_mla[dst_locs] = pack_mla(kv[src_rows])`` (``src_rows=None``: all rows)."""
    rows = kv if src_rows is None else kv.index_select(0, src_rows)
    pool_mla.index_copy_(0, dst_locs, layout.pack_mla(rows))


def store_index_torch(
    k: torch.Tensor, src_rows: torch.Tensor | None, dst_locs: torch.Tensor, pool_index: torch.Tensor, layout: KVLayout
) -> None:
    """Quantize ``k[src_rows]`` and write values and scales at page ``loc // P``, slot ``loc % P``."""
    k_fp8, k_scale = layout.quantize_index_k(k if src_rows is None else k.index_select(0, src_rows))
    n_pages, page_size, n = pool_index.shape[0], layout.page_size, dst_locs.shape[0]
    split = page_size * INDEX_HEAD_DIM
    values = pool_index[:, :split].view(n_pages, page_size, INDEX_HEAD_DIM)
    scales = pool_index[:, split:].view(n_pages, page_size, SCALE_BYTES)
    page, slot = dst_locs // page_size, dst_locs % page_size
    values[page, slot] = k_fp8.contiguous().view(torch.uint8)
    scales[page, slot] = k_scale.contiguous().view(torch.uint8).reshape(n, SCALE_BYTES)


def trim_padded(raw: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """``[C, max_len, ...]`` -> ``[sum(lengths), ...]`` rank-major (a view when nothing is padded)."""
    if len(lengths) != raw.shape[0]:
        raise ConfigError(f"padded buffer has {raw.shape[0]} rank slots, metadata {len(lengths)} ranks")
    max_len = raw.shape[1]
    if all(n == max_len for n in lengths):
        return raw.reshape(raw.shape[0] * max_len, *raw.shape[2:])
    return torch.cat([raw[r, :n] for r, n in enumerate(lengths)])


def rerange_padded_torch(raw: torch.Tensor, lengths: tuple[int, ...], rerange_index: torch.Tensor) -> torch.Tensor:
    """Padded rank-major ``raw [C, max_len, W]`` -> sequence order ``[T, W]``: trim to ``lengths``
    rows per rank, then reorder by ``rerange_index`` (``int64 [T]``, rows of the trimmed tensor)."""
    return trim_padded(raw, lengths).index_select(0, rerange_index)


def mla_token_rows(mla_pages: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Gathered MLA bytes as token rows ``[n_pages * P, mla_bytes]`` (accepts ``[n_pages, P * mla_bytes]``)."""
    if mla_pages.dim() == 2 and mla_pages.shape[1] == layout.mla_page_bytes:
        return mla_pages.reshape(-1, layout.mla_bytes)
    return mla_pages


def materialize_rows_torch(
    mla_pages: torch.Tensor,
    index_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor,
    index_scale: torch.Tensor,
    layout: KVLayout,
) -> None:
    """Fill full-view rows ``view_rows`` from gathered token rows ``row_source`` (``page * P + slot``)."""
    materialize_mla_rows_torch(mla_pages, row_source, view_rows, kv_view, layout)
    page_size, dim = layout.page_size, layout.index_head_dim
    values = index_pages[:, : page_size * dim].reshape(-1, dim).index_select(0, row_source)
    scales = index_pages[:, page_size * dim :].reshape(-1, SCALE_BYTES).index_select(0, row_source)
    index_fp8.view(torch.uint8)[view_rows] = values  # fp8 has no index_put on CPU
    index_scale[view_rows] = scales.view(torch.float32).reshape(-1)


def materialize_mla_rows_torch(
    mla_pages: torch.Tensor, row_source: torch.Tensor, view_rows: torch.Tensor, kv_view: torch.Tensor, layout: KVLayout
) -> None:
    """``kv_view[view_rows] = bf16(dequantize(mla token rows row_source))``: the MLA half of the materialize."""
    rows = mla_token_rows(mla_pages, layout).index_select(0, row_source)
    kv_view[view_rows] = layout.dequantize_mla(rows).to(torch.bfloat16)
