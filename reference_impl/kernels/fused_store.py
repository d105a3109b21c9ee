"""Fused store (phase 7): quantize + pack + scatter the MLA latent and the indexer K in one pass each.

Contracts (the torch paths in :mod:`.fused_torch` are the reference, byte for byte):

* :func:`store_mla_triton`: rows ``kv[src_rows]`` (``kv [N, kv_lora + rope]``, bf16 / fp16 / fp32)
  packed as :func:`reference_impl.kvcache.layout.pack_mla` packs them (FP8: e4m3 latent, one
  float32 scale ``max(amax, 1e-4) / 448`` per 128 values, rounded up to a power of two with the
  layout's ``mla_scale_fmt = "ue8m0"``, bf16 rope; BF16: every value as bf16) and
  written to rows ``dst_locs`` of ``pool_mla [n_slots, mla_bytes]`` uint8 (one layer's slice of
  :attr:`PagedKVPool.mla`), the bytes that ``pack_mla`` then :meth:`PagedKVPool.write_mla` write.
* :func:`store_index_triton`: ``k[src_rows]`` (``k [N, 128]``) quantized as
  :func:`~reference_impl.kvcache.layout.quantize_index_k` does (one scale per token, ``fp32`` or
  ``ue8m0``) and written into ``pool_index [n_pages, P * 132]`` uint8 at page ``loc // P``, slot
  ``loc % P``: values at ``slot * 128``, the scale at ``P * 128 + 4 * slot`` (what
  :meth:`PagedKVPool.write_index` writes).

``src_rows`` is ``None`` (all ``N`` rows, in order) or ``int64 [M]``; ``dst_locs`` is ``int64 [M]``.
One program handles ``BLOCK_M`` rows: it reads each input row once and writes each output byte
once; nothing round-trips through global memory. Rows whose loc is outside the pool are skipped
(the torch path raises there; debug mode takes the torch path).

Launch configs are per kernel (``store_mla_fp8``, ``store_mla_bf16``, ``store_index`` in
:mod:`.fused_configs`); each public function takes them as keyword overrides: ``block_m``,
``num_warps``, and two code paths with the same bytes. ``one_pass`` (FP8 MLA store): a row's
``L / 128`` blocks load as one ``[BLOCK_M, L / 128, 128]`` tile, with the rope, before the first
store, and the row's scales store as one vector; without it the kernel loads, quantizes and stores
one 128-value block at a time, and each block waits on memory (a load is not moved above a store to
a pointer that may alias). ``fast_div`` (FP8 MLA and index stores, bf16 input on the GPU): the
division by the block scale as reciprocal + one FMA correction
(:func:`~reference_impl.kernels.triton_helpers.negated_quotient`), about half the instructions per
value of ``div.rn`` (~10 instead of ~21 SASS instructions per value for the FP8 store, ptxas for
sm_90), which matters because the FP8 store issues about as many instructions as the copy of its
bytes allows.

Rounding, and why the interpreter needs help. Every step equals torch's: ``amax`` is exact, the
scale and ``x / scale`` are IEEE divisions (``tl.math.div_rn``; Triton's ``/`` on fp32 may compile
to the approximate ``div.full.f32``; ``fast_div`` gives the same quotients, proven for bf16 input),
the clamp to +-448 precedes the cast (``fast_div`` on the hardware cast leaves it to the cast's
saturation, same bytes for finite values), and the fp32 -> e4m3 and fp32 -> bf16 casts round to
nearest even. On GPU the casts are Triton's hardware conversions (round to nearest even, saturating
for fp8). The CPU interpreter (``TRITON_INTERPRET=1``) rounds both casts wrongly (it truncates), so
under it (``soft=True``, the default for CPU tensors) the kernels convert with explicit
round-to-nearest-even arithmetic on the int32 bit pattern
(:func:`~reference_impl.kernels.triton_helpers.e4m3_bits`,
:func:`~reference_impl.kernels.triton_helpers.bf16_bits`), which the interpreter executes exactly;
the CPU tests check that path byte for byte and the GPU benchmark checks the hardware path (and
times ``soft=True`` on GPU too: a dozen integer operations per value, the fallback if a hardware
conversion ever differed). NaN inputs give NaN outputs, not necessarily torch's NaN bit pattern
(torch's own CPU and CUDA patterns differ).

With ``ue8m0`` (the index store always follows ``index_scale_fmt``, the FP8 MLA store
``mla_scale_fmt``) the kernel rounds the scale up to a power of two exactly (exponent + 1 when the
mantissa is non-zero, as DeepSeek's kernels do), the same rule as the torch path
(:func:`reference_impl.fp8.round_up_pow2`), so the two agree on every scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.fused_configs import launch_config
from reference_impl.kernels.fused_torch import check_store_args
from reference_impl.kernels.triton_helpers import bf16_bits, check_aligned, quantize_block
from reference_impl.kvcache.layout import INDEX_HEAD_DIM, MLA_QUANT_BLOCK, SCALE_BYTES, KVLayout


@triton.jit
def _row_ids(src_ptr, dst_ptr, n_rows, n_slots, BLOCK_M: tl.constexpr, HAS_SRC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < n_rows
    if HAS_SRC:
        src = tl.load(src_ptr + rows, mask=in_range, other=0)
    else:
        src = rows
    dst = tl.load(dst_ptr + rows, mask=in_range, other=-1)
    ok = in_range & (dst >= 0) & (dst < n_slots)
    return tl.where(ok, src, 0), tl.where(ok, dst, 0), ok


# ---- kernels --------------------------------------------------------------------------------------


@triton.jit
def _store_mla_fp8_kernel(
    kv_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    n_rows,
    n_slots,
    stride_kv,
    stride_kv_col,
    stride_out,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_SRC: tl.constexpr,
    UE8M0: tl.constexpr,
    SOFT: tl.constexpr,
    ONE_PASS: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    src, dst, ok = _row_ids(src_ptr, dst_ptr, n_rows, n_slots, BLOCK_M, HAS_SRC)
    in_row = kv_ptr + src * stride_kv
    out_row = out_ptr + dst * stride_out
    cols = tl.arange(0, 128)
    if R > 0:
        rcols = tl.arange(0, BLOCK_R)
        rmask = ok[:, None] & (rcols < R)[None, :]
        rope_in = in_row[:, None] + (L + rcols)[None, :] * stride_kv_col
        rope_out = (out_row + L + 4 * (L // 128)).to(tl.pointer_type(tl.int16))[:, None] + rcols[None, :]
    if ONE_PASS:
        # All loads before the first store: the compiler cannot hoist a load above a store through
        # a pointer it cannot prove distinct, so the block loop below waits on memory once per block.
        blocks = tl.arange(0, BLOCK_NB)
        if BLOCK_NB == L // 128:  # every block real: row masks only (a per-element block test costs)
            mask = ok[:, None, None]
            scale_mask = ok[:, None]
        else:
            mask = ok[:, None, None] & (blocks < L // 128)[None, :, None]
            scale_mask = ok[:, None] & (blocks < L // 128)[None, :]
        offs = (blocks * 128)[None, :, None] + cols[None, None, :]
        x = tl.load(in_row[:, None, None] + offs * stride_kv_col, mask=mask, other=0.0)
        if R > 0:
            rope = tl.load(rope_in, mask=rmask, other=0.0)
        q, scale = quantize_block(x.to(tl.float32), 2, UE8M0, SOFT, FAST_DIV)
        tl.store(out_row[:, None, None] + offs, q, mask=mask)
        scales_out = (out_row + L).to(tl.pointer_type(tl.float32))  # the row's L / 128 scales: one vector
        tl.store(scales_out[:, None] + blocks[None, :], scale, mask=scale_mask)
    else:
        for b in tl.static_range(L // 128):
            x = tl.load(in_row[:, None] + (b * 128 + cols)[None, :] * stride_kv_col, mask=ok[:, None], other=0.0)
            q, scale = quantize_block(x.to(tl.float32), 1, UE8M0, SOFT, FAST_DIV)
            tl.store(out_row[:, None] + (b * 128 + cols)[None, :], q, mask=ok[:, None])
            tl.store((out_row + L + 4 * b).to(tl.pointer_type(tl.float32)), scale, mask=ok)
        if R > 0:
            rope = tl.load(rope_in, mask=rmask, other=0.0)
    if R > 0:
        tl.store(rope_out, bf16_bits(rope.to(tl.float32), SOFT), mask=rmask)


@triton.jit
def _store_mla_bf16_kernel(
    kv_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    n_rows,
    n_slots,
    stride_kv,
    stride_kv_col,
    stride_out,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_SRC: tl.constexpr,
    IN_BF16: tl.constexpr,
    SOFT: tl.constexpr,
):
    src, dst, ok = _row_ids(src_ptr, dst_ptr, n_rows, n_slots, BLOCK_M, HAS_SRC)
    in_row = kv_ptr + src * stride_kv
    out_row = (out_ptr + dst * stride_out).to(tl.pointer_type(tl.int16))
    for c0 in tl.static_range(0, W, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = ok[:, None] & (cols < W)[None, :]
        x = tl.load(in_row[:, None] + cols[None, :] * stride_kv_col, mask=mask, other=0.0)
        if IN_BF16:
            bits = x.to(tl.int16, bitcast=True)  # already bf16: copy the bits
        else:
            bits = bf16_bits(x.to(tl.float32), SOFT)
        tl.store(out_row[:, None] + cols[None, :], bits, mask=mask)


@triton.jit
def _store_index_kernel(
    k_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    n_rows,
    n_slots,
    stride_k,
    stride_k_col,
    stride_page,
    D: tl.constexpr,
    P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_SRC: tl.constexpr,
    UE8M0: tl.constexpr,
    SOFT: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    src, dst, ok = _row_ids(src_ptr, dst_ptr, n_rows, n_slots, BLOCK_M, HAS_SRC)
    cols = tl.arange(0, D)
    x = tl.load((k_ptr + src * stride_k)[:, None] + cols[None, :] * stride_k_col, mask=ok[:, None], other=0.0)
    q, scale = quantize_block(x.to(tl.float32), 1, UE8M0, SOFT, FAST_DIV)
    page_base = out_ptr + (dst // P) * stride_page
    slot = dst % P
    tl.store((page_base + slot * D)[:, None] + cols[None, :], q, mask=ok[:, None])
    tl.store((page_base + P * D + 4 * slot).to(tl.pointer_type(tl.float32)), scale, mask=ok)


# ---- launchers ------------------------------------------------------------------------------------


def _fast_div(config: dict[str, int | bool], values: torch.Tensor) -> bool:
    """Whether the kernel divides by reciprocal + FMA: asked for, bf16 input (where it is proven
    exact) and on the GPU (the interpreter's ``fma`` is not fused)."""
    return bool(config.get("fast_div", False)) and values.dtype == torch.bfloat16 and values.is_cuda


def store_mla_triton(
    kv: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_mla: torch.Tensor,
    layout: KVLayout,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    one_pass: bool | None = None,
    fast_div: bool | None = None,
) -> None:
    """Pack ``kv[src_rows]`` as ``layout`` says and write it to ``pool_mla[dst_locs]`` (in place).

    ``block_m``, ``num_warps`` and (FP8 only; ignored for BF16) ``one_pass`` and ``fast_div``
    override the launch config ``store_mla_fp8`` / ``store_mla_bf16`` of :mod:`.fused_configs`.
    ``fast_div`` takes effect for bf16 ``kv`` on CUDA only (see :func:`negated_quotient`).
    """
    check_store_args(kv, layout.kv_width, src_rows, dst_locs, pool_mla, layout.mla_bytes, "store_mla")
    check_aligned("store_mla pool", pool_mla, (pool_mla.stride(0),))
    n = dst_locs.shape[0]
    if n == 0:
        return
    soft = not kv.is_cuda if soft is None else soft
    fp8 = layout.kv_dtype == "fp8"
    overrides = {"block_m": block_m, "num_warps": num_warps}
    if fp8:
        overrides |= {"one_pass": one_pass, "fast_div": fast_div}
    config = launch_config(f"store_mla_{layout.kv_dtype}", kv.device, overrides)
    block = int(config["block_m"])
    common = {"BLOCK_M": block, "HAS_SRC": src_rows is not None, "SOFT": soft, "num_warps": int(config["num_warps"])}
    src = src_rows if src_rows is not None else dst_locs  # unused when HAS_SRC is false
    args = (kv, src, dst_locs, pool_mla, n, pool_mla.shape[0], kv.stride(0), kv.stride(1), pool_mla.stride(0))
    grid = (triton.cdiv(n, block),)
    if fp8:
        _store_mla_fp8_kernel[grid](
            *args,
            L=layout.kv_lora,
            R=layout.rope,
            BLOCK_R=triton.next_power_of_2(max(layout.rope, 1)),
            BLOCK_NB=triton.next_power_of_2(layout.kv_lora // MLA_QUANT_BLOCK),
            UE8M0=layout.mla_scale_fmt == "ue8m0",
            ONE_PASS=bool(config["one_pass"]),
            FAST_DIV=_fast_div(config, kv),
            **common,
        )
    else:
        width = layout.kv_width
        _store_mla_bf16_kernel[grid](
            *args,
            W=width,
            BLOCK_C=min(128, triton.next_power_of_2(width)),
            IN_BF16=kv.dtype == torch.bfloat16,
            **common,
        )


def store_index_triton(
    k: torch.Tensor,
    src_rows: torch.Tensor | None,
    dst_locs: torch.Tensor,
    pool_index: torch.Tensor,
    layout: KVLayout,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    fast_div: bool | None = None,
) -> None:
    """Quantize ``k[src_rows]`` (``layout.index_scale_fmt``) into the index pages at ``dst_locs`` (in place).

    ``block_m``, ``num_warps`` and ``fast_div`` override the launch config ``store_index`` of
    :mod:`.fused_configs` (``fast_div``: bf16 ``k`` on CUDA only; with ``ue8m0`` scales, powers of
    two that need no division, it only leaves the clamp to the saturating cast).
    """
    check_store_args(k, INDEX_HEAD_DIM, src_rows, dst_locs, pool_index, layout.index_page_bytes, "store_index")
    check_aligned("store_index pool", pool_index, (pool_index.stride(0),))
    n = dst_locs.shape[0]
    if n == 0:
        return
    soft = not k.is_cuda if soft is None else soft
    config = launch_config("store_index", k.device, {"block_m": block_m, "num_warps": num_warps, "fast_div": fast_div})
    block, warps = int(config["block_m"]), int(config["num_warps"])
    page_size = layout.page_size
    _store_index_kernel[(triton.cdiv(n, block),)](
        k,
        src_rows if src_rows is not None else dst_locs,
        dst_locs,
        pool_index,
        n,
        pool_index.shape[0] * page_size,
        k.stride(0),
        k.stride(1),
        pool_index.stride(0),
        D=INDEX_HEAD_DIM,
        P=page_size,
        BLOCK_M=block,
        HAS_SRC=src_rows is not None,
        UE8M0=layout.index_scale_fmt == "ue8m0",
        SOFT=soft,
        FAST_DIV=_fast_div(config, k),
        num_warps=warps,
    )


assert MLA_QUANT_BLOCK == 128 and SCALE_BYTES == 4  # the kernels hard-code both
