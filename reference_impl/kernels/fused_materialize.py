"""Fused materialize (phase 7): gathered owned pages -> full-view rows in one pass.

After the materialization all-gather (:func:`reference_impl.cp.page_gather.gather_pages`) every rank
holds the needed pages' raw bytes. The torch path then selects token rows (``index_select``: a
copy), dequantizes them in fp32 (another buffer), casts to bf16 (another) and scatters them into
the view, and does the same select + scatter for the index bytes and scales. The kernel reads each
needed byte once and writes each view byte once:

* ``kv_view[view_rows[i]] = bf16(dequantize(mla row row_source[i]))`` (FP8: ``e4m3 * scale`` per
  128-value block in fp32, rounded to bf16, rope copied; BF16: the row's bf16 values copied);
* ``index_fp8[view_rows[i]]`` = the token's 128 fp8 bytes, ``index_scale[view_rows[i]]`` = its scale,

where token row ``row_source[i] = page_index * P + slot`` addresses the gathered pages. The MLA bytes
come either as token rows ``[n_pages * P, mla_bytes]`` or as page rows ``[n_pages, P * mla_bytes]``
with any page stride (e.g. ``gathered[:, :split]``, the MLA half of the packed gather buffer, with
no copy); the index pages likewise as ``[n_pages, P * 132]`` with any page stride.

Equal to :func:`reference_impl.kernels.fused_torch.materialize_rows_torch` bit for bit (the fp32
product is the same IEEE multiply; bf16 rounding is to nearest even, in software under the CPU
interpreter: see :mod:`.fused_store`). Rows whose source or destination is out of range are skipped.

Launch config (``block_m`` rows per program, ``num_warps``; FP8 also ``one_pass``):
``materialize_fp8`` / ``materialize_bf16`` in :mod:`.fused_configs`, keyword arguments override it.
With ``one_pass`` the FP8 kernel loads a row's ``L / 128`` blocks as one tile, its scales as one
vector, the rope and the index bytes before its first store; without it, it goes block by block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.fused_configs import launch_config
from reference_impl.kernels.fused_torch import check_materialize_args, check_materialize_mla_args, mla_strides
from reference_impl.kernels.triton_helpers import bf16_bits, check_aligned
from reference_impl.kvcache.layout import INDEX_HEAD_DIM, MLA_QUANT_BLOCK, KVLayout


@triton.jit
def _materialize_kernel(
    mla_ptr,
    index_ptr,
    source_ptr,
    view_rows_ptr,
    kv_ptr,
    index_out_ptr,
    scale_out_ptr,
    n_rows,
    n_source_rows,
    n_view_rows,
    stride_mla_page,
    stride_mla_row,
    stride_index_page,
    stride_kv,
    stride_index_out,
    stride_scale_out,
    L: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SOFT: tl.constexpr,
    ONE_PASS: tl.constexpr,
    WITH_INDEX: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < n_rows
    source = tl.load(source_ptr + rows, mask=in_range, other=-1)
    target = tl.load(view_rows_ptr + rows, mask=in_range, other=-1)
    ok = in_range & (source >= 0) & (source < n_source_rows) & (target >= 0) & (target < n_view_rows)
    source = tl.where(ok, source, 0)
    target = tl.where(ok, target, 0)
    page, slot = source // P, source % P
    mla_row = mla_ptr + page * stride_mla_page + slot * stride_mla_row
    kv_row = kv_ptr + target * stride_kv  # kv_view as int16: bf16 bit patterns
    # Indexer K: the token's D fp8 bytes and its float32 scale.
    icols = tl.arange(0, D)
    index_page = index_ptr + page * stride_index_page
    index_in = (index_page + slot * D)[:, None] + icols[None, :]
    k_scale_in = (index_page + P * D + 4 * slot).to(tl.pointer_type(tl.float32))
    if FP8 and ONE_PASS:
        # All loads before the first store (see fused_store: a load is not hoisted above a store).
        cols = tl.arange(0, 128)
        blocks = tl.arange(0, BLOCK_NB)
        if BLOCK_NB == L // 128:  # every block real: row masks only (a per-element block test costs)
            mask = ok[:, None, None]
            scale_mask = ok[:, None]
        else:
            mask = ok[:, None, None] & (blocks < L // 128)[None, :, None]
            scale_mask = ok[:, None] & (blocks < L // 128)[None, :]
        offs = (blocks * 128)[None, :, None] + cols[None, None, :]
        q = tl.load(mla_row[:, None, None] + offs, mask=mask, other=0)
        scales_in = (mla_row + L).to(tl.pointer_type(tl.float32))
        scale = tl.load(scales_in[:, None] + blocks[None, :], mask=scale_mask, other=0.0)
        if R > 0:
            rcols = tl.arange(0, BLOCK_R)
            rmask = ok[:, None] & (rcols < R)[None, :]
            rope = (mla_row + L + 4 * (L // 128)).to(tl.pointer_type(tl.int16))
            rope_bits = tl.load(rope[:, None] + rcols[None, :], mask=rmask, other=0)
        if WITH_INDEX:
            values = tl.load(index_in, mask=ok[:, None], other=0)
            k_scale = tl.load(k_scale_in, mask=ok, other=0.0)
        value = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        tl.store(kv_row[:, None, None] + offs, bf16_bits(value, SOFT), mask=mask)
        if R > 0:
            tl.store(kv_row[:, None] + (L + rcols)[None, :], rope_bits, mask=rmask)
    else:
        if FP8:
            cols = tl.arange(0, 128)
            for b in tl.static_range(L // 128):
                q = tl.load(mla_row[:, None] + (b * 128 + cols)[None, :], mask=ok[:, None], other=0)
                scale = tl.load((mla_row + L + 4 * b).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
                value = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
                tl.store(kv_row[:, None] + (b * 128 + cols)[None, :], bf16_bits(value, SOFT), mask=ok[:, None])
            if R > 0:
                rcols = tl.arange(0, BLOCK_R)
                rmask = ok[:, None] & (rcols < R)[None, :]
                rope = (mla_row + L + 4 * (L // 128)).to(tl.pointer_type(tl.int16))
                bits = tl.load(rope[:, None] + rcols[None, :], mask=rmask, other=0)
                tl.store(kv_row[:, None] + (L + rcols)[None, :], bits, mask=rmask)
        else:
            mla16 = mla_row.to(tl.pointer_type(tl.int16))
            for c0 in tl.static_range(0, L + R, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = ok[:, None] & (cols < L + R)[None, :]
                bits = tl.load(mla16[:, None] + cols[None, :], mask=mask, other=0)
                tl.store(kv_row[:, None] + cols[None, :], bits, mask=mask)
        if WITH_INDEX:
            values = tl.load(index_in, mask=ok[:, None], other=0)
            k_scale = tl.load(k_scale_in, mask=ok, other=0.0)
    if WITH_INDEX:
        tl.store((index_out_ptr + target * stride_index_out)[:, None] + icols[None, :], values, mask=ok[:, None])
        tl.store(scale_out_ptr + target * stride_scale_out, k_scale, mask=ok)


def materialize_rows_triton(
    mla_pages: torch.Tensor,
    index_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor,
    index_scale: torch.Tensor,
    layout: KVLayout,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    one_pass: bool | None = None,
) -> None:
    """Fill ``kv_view``, ``index_fp8``, ``index_scale`` at ``view_rows`` from gathered ``row_source`` (in place).

    ``block_m``, ``num_warps`` and (FP8 only; ignored for BF16) ``one_pass`` override the launch
    config ``materialize_fp8`` / ``materialize_bf16`` of :mod:`.fused_configs`.
    """
    n_source = check_materialize_args(
        mla_pages, index_pages, row_source, view_rows, kv_view, index_fp8, index_scale, layout
    )
    check_aligned("materialize index pages", index_pages, (index_pages.stride(0),))
    index = (index_pages, index_fp8.view(torch.uint8), index_scale)
    _launch(mla_pages, index, row_source, view_rows, kv_view, layout, n_source, soft, block_m, num_warps, one_pass)


def materialize_mla_rows_triton(
    mla_pages: torch.Tensor,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    layout: KVLayout,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    one_pass: bool | None = None,
) -> None:
    """The MLA half of :func:`materialize_rows_triton` (phase 8's prefetch): ``kv_view`` rows only."""
    n_source = check_materialize_mla_args(mla_pages, row_source, view_rows, kv_view, layout)
    _launch(mla_pages, None, row_source, view_rows, kv_view, layout, n_source, soft, block_m, num_warps, one_pass)


def _launch(
    mla_pages: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    row_source: torch.Tensor,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    layout: KVLayout,
    n_source: int,
    soft: bool | None,
    block_m: int | None,
    num_warps: int | None,
    one_pass: bool | None,
) -> None:
    n = row_source.shape[0]
    if n == 0:
        return
    stride_page, stride_row, _ = mla_strides(mla_pages, layout)
    check_aligned("materialize MLA bytes", mla_pages, (stride_page, stride_row))
    soft = not kv_view.is_cuda if soft is None else soft
    fp8 = layout.kv_dtype == "fp8"
    overrides = {"block_m": block_m, "num_warps": num_warps} | ({"one_pass": one_pass} if fp8 else {})
    config = launch_config(f"materialize_{layout.kv_dtype}", kv_view.device, overrides)
    block, warps = int(config["block_m"]), int(config["num_warps"])
    # Without the index part its pointers are never dereferenced (WITH_INDEX is a compile-time flag).
    index_pages, index_bytes, index_scale = index if index is not None else (mla_pages, mla_pages, kv_view)
    _materialize_kernel[(triton.cdiv(n, block),)](
        mla_pages,
        index_pages,
        row_source,
        view_rows,
        kv_view.view(torch.int16),
        index_bytes,
        index_scale,
        n,
        n_source,
        kv_view.shape[0],
        stride_page,
        stride_row,
        index_pages.stride(0),
        kv_view.stride(0),
        index_bytes.stride(0),
        index_scale.stride(0),
        L=layout.kv_lora,
        R=layout.rope,
        P=layout.page_size,
        D=INDEX_HEAD_DIM,
        FP8=fp8,
        BLOCK_R=triton.next_power_of_2(max(layout.rope, 1)),
        BLOCK_C=min(128, triton.next_power_of_2(layout.kv_width)),
        BLOCK_NB=triton.next_power_of_2(layout.kv_lora // MLA_QUANT_BLOCK),
        BLOCK_M=block,
        SOFT=soft,
        ONE_PASS=bool(config.get("one_pass", False)),
        WITH_INDEX=index is not None,
        num_warps=warps,
    )
