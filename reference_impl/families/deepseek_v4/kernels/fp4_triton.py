"""Triton FP4 (e2m1) round trip for DeepSeek-V4's indexer query, bit-exact to the torch reference.

Contract: :func:`reference_impl.families.deepseek_v4.cache_layout.fp4_simulate` (``dequant(quant(x))`` in
``x.dtype``): per block of 32 values, the power-of-two scale ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``,
each value divided by it and rounded to the nearest e2m1 grid point (ties to the even index), then
multiplied back.

Why a kernel: the query is ``[T, 64 heads, 128]`` (16,384 tokens: 512 MiB as float32) and the
reference's rounding compares it with each of the grid's seven midpoints, about thirty elementwise
passes. The kernel reads it once and writes it once.

Exactness: the amax is exact; ``amax / 6`` is divided correctly rounded (``div_rn``, not the fast
division Triton emits for ``/``); the scale is built from the exponent bits as
:func:`~reference_impl.fp8.round_up_pow2` does; dividing by a power of two and the comparisons are
exact; the dequantized value ``grid x scale`` is exact in float32 and in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.families.deepseek_v4.cache_layout import FP4_BLOCK, FP4_MAX
from reference_impl.kernels import interpreter_compat  # noqa: F401  (repairs triton < 3.7's interpreter)

BLOCKS_PER_PROGRAM = 64
"""Quantization blocks per program: 64 x 32 values (4 KiB of bf16 in, 4 KiB out)."""

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _fp4_simulate_kernel(
    x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    blocks = tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (blocks < n_blocks)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 6.0 * 2.0**-126)
    bits = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # round up to a power of two
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    a = tl.abs(y)
    # Nearest e2m1 index: one up past each midpoint of (0, .5, 1, 1.5, 2, 3, 4, 6); a tie goes to the even index.
    index = (
        (a > 0.25).to(tl.int32)
        + ((a > 0.75) | (a == 0.75)).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + ((a > 1.75) | (a == 1.75)).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + ((a > 3.5) | (a == 3.5)).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    half = (index >> 1).to(tl.float32)
    magnitude = tl.where(
        index >= 2, tl.exp2(half - 1.0) * (1.0 + 0.5 * (index & 1).to(tl.float32)), 0.5 * index.to(tl.float32)
    )
    value = tl.where((y < 0) & (index > 0), -magnitude, magnitude) * scale[:, None]
    tl.store(out_ptr + offs, value.to(OUT_DTYPE), mask=mask)


def fp4_simulate_triton(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """The kernel behind :func:`~reference_impl.families.deepseek_v4.cache_layout.fp4_simulate`'s contract."""
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"fp4_simulate_triton takes float32/bf16/fp16, got {x.dtype}")
    if block != FP4_BLOCK or x.shape[-1] % block:
        raise ValueError(f"the last dim {x.shape[-1]} must be whole blocks of {FP4_BLOCK}")
    assert FP4_MAX == 6.0  # the kernel's midpoints are those of e2m1
    src = x.contiguous()
    out = torch.empty_like(src)
    n_blocks = src.numel() // block
    if n_blocks:
        _fp4_simulate_kernel[(triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)](
            src,
            out,
            n_blocks,
            BLOCK=block,
            PER_PROGRAM=BLOCKS_PER_PROGRAM,
            OUT_DTYPE=_TL_DTYPES[x.dtype],
            num_warps=4,
        )
    return out
