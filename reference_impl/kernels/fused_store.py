"""Fused store (phase 7): quantize + pack + scatter the MLA latent and the indexer K in one pass each.

Contracts (the torch paths in :mod:`.fused_torch` are the reference, byte for byte):

* :func:`store_mla_triton`: rows ``kv[src_rows]`` (``kv [N, kv_lora + rope]``, bf16 / fp16 / fp32)
  packed as :func:`reference_impl.kvcache.layout.pack_mla` packs them (FP8: e4m3 latent, one
  float32 scale ``max(amax, 1e-4) / 448`` per 128 values, bf16 rope; BF16: every value as bf16) and
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
one 128-value block at a time, and each block waits on memory (a load is not moved above a store
to a pointer that may alias). ``fast_div`` (FP8 MLA and index stores, bf16 input on the GPU): the
division by the block scale as reciprocal + one FMA correction (:func:`_negated_quotient`), about
half the instructions per value of ``div.rn`` (~10 instead of ~21 SASS instructions per value for
the FP8 store, ptxas for sm_90), which matters because the FP8 store issues about as many
instructions as the copy of its bytes allows.

Rounding, and why the interpreter needs help. Every step equals torch's: ``amax`` is exact, the
scale and ``x / scale`` are IEEE divisions (``tl.math.div_rn``; Triton's ``/`` on fp32 may compile
to the approximate ``div.full.f32``; ``fast_div`` gives the same quotients, proven for bf16 input),
the clamp to +-448 precedes the cast (``fast_div`` on the hardware cast leaves it to the cast's
saturation, same bytes for finite values), and the fp32 -> e4m3 and fp32 -> bf16 casts round to
nearest even. On GPU the casts are Triton's hardware conversions
(round to nearest even, saturating for fp8). The CPU interpreter (``TRITON_INTERPRET=1``) rounds both casts wrongly (it
truncates), so under it (``soft=True``, the default for CPU tensors) the kernels convert with
explicit round-to-nearest-even arithmetic on the int32 bit pattern (:func:`_e4m3_bits`,
:func:`_bf16_bits`), which the interpreter executes exactly; the CPU tests check that path byte for
byte and the GPU benchmark checks the hardware path (and times ``soft=True`` on GPU too: a dozen
integer operations per value, the fallback if a hardware conversion ever differed). NaN inputs give
NaN outputs, not necessarily torch's NaN bit pattern (torch's own CPU and CUDA patterns differ).

With ``ue8m0`` the kernel rounds the scale up to a power of two exactly (exponent + 1 when the
mantissa is non-zero, as DeepSeek's kernels do), the same rule as the torch path
(:func:`reference_impl.model.fp8.round_up_pow2`), so the two agree on every scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.fused_configs import launch_config
from reference_impl.kernels.fused_torch import check_store_args
from reference_impl.kvcache.layout import INDEX_HEAD_DIM, MLA_QUANT_BLOCK, SCALE_BYTES, KVLayout

# ---- conversions (shared with fused_materialize) ------------------------------------------------


@triton.jit
def _bf16_bits(x, SOFT: tl.constexpr):
    """fp32 ``x`` -> its bf16 bit pattern as int16, round to nearest even (NaN stays a NaN)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(x != x, 0x7FC0, rounded & 0xFFFF).to(tl.int16)
    else:
        out = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return out


@triton.jit
def _e4m3_bits(y, SOFT: tl.constexpr):
    """fp32 ``y`` with ``|y| <= 448`` -> its e4m3fn bit pattern as uint8, round to nearest even."""
    if SOFT:
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag_bits = bits & 0x7FFFFFFF
        # Normal range (|y| >= 2**-6): rebias the exponent (127 -> 7) and keep 3 mantissa bits, RNE.
        normal = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1) - 0x3C000000) >> 20
        # Subnormals are multiples of 2**-9: round |y| * 512 to an integer (adding 2**23 makes the
        # fp32 adder round to nearest even, and the integer sits in the low mantissa bits).
        mag = mag_bits.to(tl.float32, bitcast=True)
        sub = (mag * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.minimum(tl.where(mag_bits >= 0x3C800000, normal, sub), 0x7E) | sign
        out = tl.where(y != y, sign | 0x7F, code).to(tl.uint8)
    else:
        out = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return out


@triton.jit
def _negated_quotient(x, scale, AXIS: tl.constexpr):
    """``-(x / scale)`` correctly rounded (``scale > 0`` broadcast along ``AXIS``), without a division per value.

    Markstein's correction from the block's reciprocal ``y = 1 / scale`` (one ``div_rn`` per block):
    ``q0 = x * y``, the exact residual ``r = x - q0 * scale`` (one fma), ``q0 + r * y`` (one fma):
    3 instructions per value instead of ``div.rn``'s ~11. Computed negated (``-y`` throughout) so
    that every zero keeps ``x``'s sign: Triton's ``-v`` is ``0 - v``, and ``fma(r, y, q0)`` with ``r =
    +0`` turns ``q0 = -0.0`` into ``+0.0``. Equal to ``-div_rn(x, scale)`` for every bf16 ``x`` and
    every scale a bf16 block gives (exhaustively, in exact arithmetic:
    ``tests/test_fused_launch_configs.py::test_fast_division_equals_correctly_rounded_division``); an
    infinite scale (an inf in the block) gives ``x * 0`` like the division.
    """
    recip = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    divisor = tl.expand_dims(tl.where(recip == 0.0, 0.0, scale), AXIS)  # inf scale: residual x, result -x * 0
    neg_recip = tl.expand_dims(recip * -1.0, AXIS)
    neg_q0 = x * neg_recip
    return tl.fma(tl.fma(neg_q0, divisor, x), neg_recip, neg_q0)


@triton.jit
def _quantize_block(x, AXIS: tl.constexpr, UE8M0: tl.constexpr, SOFT: tl.constexpr, FAST_DIV: tl.constexpr):
    """fp32 ``x`` with 128-value blocks along its last axis ``AXIS`` (``[BLOCK_M, 128]`` or
    ``[BLOCK_M, NB, 128]``) -> (e4m3 bits uint8 shaped like ``x``, scale fp32 without ``AXIS``), as ``act_quant``.

    ``FAST_DIV`` (the host sets it for bf16 input on the GPU only: the interpreter's ``fma`` rounds
    twice) divides by :func:`_negated_quotient` and flips the sign bit of the e4m3 codes (e4m3
    rounding is symmetric, so that is the code of the quotient), and on the hardware conversion skips
    the clamp: ``cvt.rn.satfinite`` saturates finite values to +-448 itself.
    """
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if UE8M0:
        sbits = scale.to(tl.int32, bitcast=True)
        exponent = (sbits >> 23) + ((sbits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        # Dividing by a power of two is multiplying by its exact reciprocal: same rounding, no division.
        y = x * tl.expand_dims(((254 - exponent) << 23).to(tl.float32, bitcast=True), AXIS)
    elif FAST_DIV:
        y = _negated_quotient(x, scale, AXIS)
    else:
        y = tl.math.div_rn(x, tl.expand_dims(scale, AXIS))
    if SOFT or not FAST_DIV:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    codes = _e4m3_bits(y, SOFT)
    if FAST_DIV and not UE8M0:
        codes = codes ^ 0x80  # on packed bytes: a quarter instruction per value, the negation a whole one
    return codes, scale


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
        q, scale = _quantize_block(x.to(tl.float32), 2, False, SOFT, FAST_DIV)
        tl.store(out_row[:, None, None] + offs, q, mask=mask)
        scales_out = (out_row + L).to(tl.pointer_type(tl.float32))  # the row's L / 128 scales: one vector
        tl.store(scales_out[:, None] + blocks[None, :], scale, mask=scale_mask)
    else:
        for b in tl.static_range(L // 128):
            x = tl.load(in_row[:, None] + (b * 128 + cols)[None, :] * stride_kv_col, mask=ok[:, None], other=0.0)
            q, scale = _quantize_block(x.to(tl.float32), 1, False, SOFT, FAST_DIV)
            tl.store(out_row[:, None] + (b * 128 + cols)[None, :], q, mask=ok[:, None])
            tl.store((out_row + L + 4 * b).to(tl.pointer_type(tl.float32)), scale, mask=ok)
        if R > 0:
            rope = tl.load(rope_in, mask=rmask, other=0.0)
    if R > 0:
        tl.store(rope_out, _bf16_bits(rope.to(tl.float32), SOFT), mask=rmask)


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
            bits = _bf16_bits(x.to(tl.float32), SOFT)
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
    q, scale = _quantize_block(x.to(tl.float32), 1, UE8M0, SOFT, FAST_DIV)
    page_base = out_ptr + (dst // P) * stride_page
    slot = dst % P
    tl.store((page_base + slot * D)[:, None] + cols[None, :], q, mask=ok[:, None])
    tl.store((page_base + P * D + 4 * slot).to(tl.pointer_type(tl.float32)), scale, mask=ok)


# ---- launchers ------------------------------------------------------------------------------------


def check_aligned(what: str, tensor: torch.Tensor, strides: tuple[int, ...] = ()) -> None:
    """The kernels store float32 scales and bf16 values through cast pointers: base address and byte
    strides must be multiples of 4 (every layout's rows are; a slice of a pool at a row offset is)."""
    if tensor.data_ptr() % 4 or any(stride % 4 for stride in strides):
        raise ValueError(f"{what}: the fused kernels need 4-byte aligned rows (base and byte strides)")


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
    ``fast_div`` takes effect for bf16 ``kv`` on CUDA only (see :func:`_negated_quotient`).
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
