"""Fused current-rows fill (phases 3 + 7): the gathered chunk -> its full-view rows, with the cache's rounding.

Phase 3 writes the full view's current rows straight from the all-gathered chunk, rounded exactly as
the cache stores them (:func:`reference_impl.cp.current_reuse.fill_current`):

* ``kv_view[view_rows[i]] = bf16(dequantize(pack_mla(kv_seq[i])))``: with the FP8 layout the latent
  is quantized (one float32 scale ``max(amax, 1e-4) / 448`` per 128 values, a power of two with
  ``mla_scale_fmt = "ue8m0"``) and dequantized again, the rope rounded to bf16; with the BF16
  layout every value rounded to bf16;
* ``index_fp8[view_rows[i]], index_scale[view_rows[i]] = quantize_index_k(index_k_seq[i])`` (not on
  an IndexShare shared layer, which has no indexer K).

As torch ops that is a float32 copy of the chunk, ``abs``, ``amax``, two divisions, clamps, the
e4m3 cast, the packed bytes, their float32 dequantization, a bf16 cast and an ``index_put``: about
twenty passes over the ``[T, 576]`` chunk per layer (measured: ``docs/glue-kernels.md#measured-results``). The
kernel reads each row once and writes each view byte once: read ``2 x 576 + 2 x 128`` bytes per token (bf16), write
``2 x 576 + 128 + 4``.

Equal to the torch path bit for bit: the quantization is :func:`~reference_impl.kernels.triton_helpers.quantize_block`
(the fused store's, byte-equal to ``act_quant``), the dequantization the same IEEE product as
:func:`~reference_impl.fp8.act_dequant`, bf16 rounding to nearest even (in software under the CPU
interpreter, ``soft=True``). The latent's e4m3 codes never leave registers, and there both
conversions run in software (integer arithmetic, exact): with Triton's hardware conversions there
(``.to(tl.float8e4nv)`` and back) the kernel wrote wrong values on the H200 (triton 3.6; the GPU
tier caught it), while the fused store and materialize, which convert through memory, are exact.
Rows whose view row is out of range are skipped.

Launch config ``fill_current`` in :mod:`.fused_configs` (``block_m``, ``num_warps``, ``fast_div``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.fused_configs import launch_config
from reference_impl.kernels.fused_torch import check_fill_current_args
from reference_impl.kernels.triton_helpers import bf16_bits, check_aligned, e4m3_value, quantize_block
from reference_impl.kvcache.layout import INDEX_HEAD_DIM, MLA_QUANT_BLOCK, KVLayout


@triton.jit
def _fill_current_kernel(
    kv_ptr,
    k_ptr,
    view_rows_ptr,
    view_ptr,
    index_out_ptr,
    scale_out_ptr,
    n_rows,
    n_view_rows,
    stride_kv,
    stride_k,
    stride_view,
    stride_index_out,
    L: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_C: tl.constexpr,
    UE8M0: tl.constexpr,
    MLA_UE8M0: tl.constexpr,
    WITH_INDEX: tl.constexpr,
    IN_BF16: tl.constexpr,
    SOFT: tl.constexpr,
    FAST_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < n_rows
    target = tl.load(view_rows_ptr + rows, mask=in_range, other=-1)
    ok = in_range & (target >= 0) & (target < n_view_rows)
    src = tl.where(ok, rows, 0)
    target = tl.where(ok, target, 0)
    kv_row = kv_ptr + src * stride_kv
    view_row = (view_ptr + target * stride_view).to(tl.pointer_type(tl.int16))  # bf16 bit patterns

    # Loads first: a load is not hoisted above a store through a pointer that may alias (see fused_store).
    icols = tl.arange(0, D)
    if WITH_INDEX:
        k = tl.load((k_ptr + src * stride_k)[:, None] + icols[None, :], mask=ok[:, None], other=0.0)  # read 2 D
    if R > 0:
        rcols = tl.arange(0, BLOCK_R)
        rmask = ok[:, None] & (rcols < R)[None, :]
        rope = tl.load(kv_row[:, None] + (L + rcols)[None, :], mask=rmask, other=0.0)
    if FP8:
        cols = tl.arange(0, 128)
        blocks = tl.arange(0, BLOCK_NB)
        mask = ok[:, None, None] & (blocks < L // 128)[None, :, None]
        offs = (blocks * 128)[None, :, None] + cols[None, None, :]
        x = tl.load(kv_row[:, None, None] + offs, mask=mask, other=0.0)  # read 2 L
        # Software e4m3 both ways: in registers, the hardware conversions gave wrong values (e4m3_value).
        codes, scale = quantize_block(x.to(tl.float32), 2, MLA_UE8M0, True, FAST_DIV)
        value = e4m3_value(codes) * scale[:, :, None]
        tl.store(view_row[:, None, None] + offs, bf16_bits(value, SOFT), mask=mask)  # write 2 L
    else:
        for c0 in tl.static_range(0, L, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = ok[:, None] & (cols < L)[None, :]
            x = tl.load(kv_row[:, None] + cols[None, :], mask=mask, other=0.0)
            bits = x.to(tl.int16, bitcast=True) if IN_BF16 else bf16_bits(x.to(tl.float32), SOFT)
            tl.store(view_row[:, None] + cols[None, :], bits, mask=mask)
    if R > 0:
        bits = rope.to(tl.int16, bitcast=True) if IN_BF16 else bf16_bits(rope.to(tl.float32), SOFT)
        tl.store(view_row[:, None] + (L + rcols)[None, :], bits, mask=rmask)  # write 2 R
    if WITH_INDEX:
        k_codes, k_scale = quantize_block(k.to(tl.float32), 1, UE8M0, SOFT, FAST_DIV)
        tl.store((index_out_ptr + target * stride_index_out)[:, None] + icols[None, :], k_codes, mask=ok[:, None])
        tl.store(scale_out_ptr + target, k_scale, mask=ok)  # write D + 4


def fill_current_triton(
    kv_seq: torch.Tensor,
    index_k_seq: torch.Tensor | None,
    view_rows: torch.Tensor,
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor | None,
    index_scale: torch.Tensor | None,
    layout: KVLayout,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    fast_div: bool | None = None,
) -> None:
    """Write the current rows of the full view from the gathered chunk, in place (see the module docstring).

    ``kv_seq [T, kv_width]`` and ``index_k_seq [T, 128]`` (bf16 or float32, sequence order),
    ``view_rows int64 [T]``; ``kv_view`` bf16 ``[S, kv_width]``, ``index_fp8`` float8_e4m3fn
    ``[S, 128]``, ``index_scale`` float32 ``[S]``, all row-contiguous (else a ``ConfigError`` names
    the problem). The three index tensors are ``None`` together for a layer without indexer K
    (IndexShare's shared layers): the MLA rows alone. ``block_m``, ``num_warps`` and ``fast_div``
    override the launch config ``fill_current`` (``fast_div``: bf16 input on CUDA).
    """
    check_fill_current_args(kv_seq, index_k_seq, view_rows, kv_view, index_fp8, index_scale, layout)
    n = view_rows.shape[0]
    if n == 0:
        return
    kv_seq = kv_seq if kv_seq.stride(1) == 1 else kv_seq.contiguous()
    with_index = index_k_seq is not None and index_fp8 is not None and index_scale is not None
    if with_index:
        index_k_seq = index_k_seq if index_k_seq.stride(1) == 1 else index_k_seq.contiguous()
        index_out, scale_out, k_in = index_fp8.view(torch.uint8), index_scale, index_k_seq
    else:  # never dereferenced (WITH_INDEX is a compile-time flag)
        index_out, scale_out, k_in = view_rows, view_rows, kv_seq
    check_aligned("fill_current kv_view", kv_view, (kv_view.stride(0) * 2,))
    soft = not kv_seq.is_cuda if soft is None else soft
    config = launch_config(
        "fill_current", kv_seq.device, {"block_m": block_m, "num_warps": num_warps, "fast_div": fast_div}
    )
    block = int(config["block_m"])
    in_bf16 = kv_seq.dtype == torch.bfloat16 and k_in.dtype == torch.bfloat16
    _fill_current_kernel[(triton.cdiv(n, block),)](
        kv_seq,
        k_in,
        view_rows,
        kv_view,
        index_out,
        scale_out,
        n,
        kv_view.shape[0],
        kv_seq.stride(0),
        k_in.stride(0),
        kv_view.stride(0),
        index_out.stride(0),
        L=layout.kv_lora,
        R=layout.rope,
        D=INDEX_HEAD_DIM,
        FP8=layout.kv_dtype == "fp8",
        BLOCK_R=triton.next_power_of_2(max(layout.rope, 1)),
        BLOCK_NB=triton.next_power_of_2(layout.kv_lora // MLA_QUANT_BLOCK),
        BLOCK_C=min(128, triton.next_power_of_2(layout.kv_lora)),
        UE8M0=layout.index_scale_fmt == "ue8m0",
        MLA_UE8M0=layout.mla_scale_fmt == "ue8m0",
        WITH_INDEX=with_index,
        IN_BF16=in_bf16,
        SOFT=soft,
        FAST_DIV=bool(config["fast_div"]) and in_bf16 and kv_seq.is_cuda,
        BLOCK_M=block,
        num_warps=int(config["num_warps"]),
    )
