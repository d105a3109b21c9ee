"""Helpers the Triton kernels share: device functions for FP8 / BF16 conversion and block
quantization, and the host-side launch checks.

Device functions (``@triton.jit``, called from the kernels):

* :func:`bf16_bits`, :func:`e4m3_bits`: fp32 -> the bit pattern of bf16 / e4m3fn, round to nearest
  even. ``SOFT=True`` converts with integer arithmetic on the fp32 bit pattern (exact under the CPU
  interpreter, whose casts truncate); ``SOFT=False`` uses the hardware conversion.
* :func:`e4m3_value`: e4m3fn bit patterns -> float32, with integer arithmetic.
* :func:`negated_quotient`: ``-(x / scale)`` correctly rounded from one reciprocal per block.
* :func:`quantize_block`: DeepSeek's ``act_quant`` on 128-value blocks (scale ``max(amax, 1e-4) / 448``,
  optionally rounded up to a power of two).

Host helpers: :func:`pow2_at_least_16` (a power-of-two block that covers ``n``) and
:func:`check_aligned` (4-byte alignment of what the kernels store through cast pointers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels import interpreter_compat  # noqa: F401  (repairs triton < 3.7's interpreter)


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= ``max(n, 16)`` (Triton block sizes; 16 is the smallest ``tl.dot`` dim)."""
    return max(16, triton.next_power_of_2(max(int(n), 1)))


def check_aligned(what: str, tensor: torch.Tensor, strides: tuple[int, ...] = ()) -> None:
    """The kernels store float32 scales and bf16 values through cast pointers: base address and byte
    strides must be multiples of 4 (every layout's rows are; a slice of a pool at a row offset is)."""
    if tensor.data_ptr() % 4 or any(stride % 4 for stride in strides):
        raise ValueError(f"{what}: the fused kernels need 4-byte aligned rows (base and byte strides)")


@triton.jit
def bf16_bits(x, SOFT: tl.constexpr):
    """fp32 ``x`` -> its bf16 bit pattern as int16, round to nearest even (NaN stays a NaN)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(x != x, 0x7FC0, rounded & 0xFFFF).to(tl.int16)
    else:
        out = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return out


@triton.jit
def e4m3_bits(y, SOFT: tl.constexpr):
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
def e4m3_value(codes):
    """e4m3fn bit patterns (uint8, finite) -> their float32 values, exactly, with integer operations only.

    For a kernel that quantizes and dequantizes in registers (:mod:`.fused_current`), where the
    hardware conversions gave wrong values on the H200 (triton 3.6).
    """
    bits = codes.to(tl.int32)
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20) | sign).to(tl.float32, bitcast=True)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign  # m * 2**-9
    return tl.where(exponent == 0, subnormal.to(tl.float32, bitcast=True), normal)


@triton.jit
def negated_quotient(x, scale, AXIS: tl.constexpr):
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
def quantize_block(x, AXIS: tl.constexpr, UE8M0: tl.constexpr, SOFT: tl.constexpr, FAST_DIV: tl.constexpr):
    """fp32 ``x`` with 128-value blocks along its last axis ``AXIS`` (``[BLOCK_M, 128]`` or
    ``[BLOCK_M, NB, 128]``) -> (e4m3 bits uint8 shaped like ``x``, scale fp32 without ``AXIS``), as ``act_quant``.

    ``FAST_DIV`` (the host sets it for bf16 input on the GPU only: the interpreter's ``fma`` rounds
    twice) divides by :func:`negated_quotient` and flips the sign bit of the e4m3 codes (e4m3
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
        # A finite scale is at most 2^120 (float max / 448), so 2^(127 - e) is normal; an inf scale
        # (an inf in the block) has reciprocal 0, as x / inf.
        recip = tl.where(exponent >= 255, 0.0, ((254 - exponent) << 23).to(tl.float32, bitcast=True))
        y = x * tl.expand_dims(recip, AXIS)
    elif FAST_DIV:
        y = negated_quotient(x, scale, AXIS)
    else:
        y = tl.math.div_rn(x, tl.expand_dims(scale, AXIS))
    if SOFT or not FAST_DIV:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    codes = e4m3_bits(y, SOFT)
    if FAST_DIV and not UE8M0:
        codes = codes ^ 0x80  # on packed bytes: a quarter instruction per value, the negation a whole one
    return codes, scale
