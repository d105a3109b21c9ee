"""FP8 (e4m3) block quantization and the Hadamard rotation used by the lightning indexer.

DeepSeek-V3.2's ``act_quant``: per block of ``block`` values, ``scale = amax / 448`` (``amax``
clamped to at least 1e-4 so an all-zero block has a finite scale); with ``scale_fmt="ue8m0"`` the
scale is rounded up to a power of two (exactly, by exponent bits: :func:`round_up_pow2`).
``x_fp8 = (x / scale)`` cast to ``float8_e4m3fn``.
"""

from __future__ import annotations

import math

import torch

SCALE_FMTS: tuple[str, ...] = ("ue8m0", "fp32")
"""FP8 scale formats of a cache's 128-value blocks: ``ue8m0`` (powers of two, DeepSeek's inference code and
FlashMLA) or ``fp32`` (``amax / 448``, SGLang's); the bytes of a row are laid out the same either way."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def block_scales(x: torch.Tensor, block: int, scale_fmt: str = "fp32") -> torch.Tensor:
    """Per-block scales of ``x [..., n]`` -> ``[..., n // block]`` float32."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantization block {block}")
    amax = x.float().unflatten(-1, (n // block, block)).abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # Divide by a tensor, not the Python scalar: CUDA torch computes ``t / scalar`` as
    # ``t * (1 / scalar)`` (one ulp off for some amax), CPU torch divides. An elementwise tensor
    # division is IEEE on every device, like the Triton kernels' ``div_rn``.
    scale = amax / amax.new_full((1,), FP8_MAX)
    if scale_fmt == "ue8m0":
        scale = round_up_pow2(scale)
    elif scale_fmt != "fp32":
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}")
    return scale


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= scale`` (positive normal float32), by exponent bits.

    DeepSeek's ``fast_log2_ceil``: the exponent plus one when any mantissa bit is set. Exact,
    unlike ``exp2(ceil(log2(s)))`` in float32, whose ``log2`` rounds to an integer a few ulps
    above a power of two and then returns half the right scale.
    """
    bits = scale.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def act_quant(x: torch.Tensor, block: int = 128, scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., n]`` to e4m3 with one scale per ``block`` values.

    Returns ``(x_fp8 [..., n] float8_e4m3fn, scale [..., n // block] float32)``.
    """
    scale = block_scales(x, block, scale_fmt)
    n = x.shape[-1]
    y = x.float().unflatten(-1, (n // block, block)) / scale.unsqueeze(-1)
    y = y.clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    return y.to(FP8_DTYPE), scale


def act_dequant(x_fp8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of :func:`act_quant` in float32."""
    n = x_fp8.shape[-1]
    y = x_fp8.float().unflatten(-1, (n // block, block)) * scale.unsqueeze(-1)
    return y.flatten(-2)


def hadamard_matrix(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, float32), built on ``device``
    (default: the current default device). A model keeps it as a buffer, so no forward builds it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``rotate_activation``: Sylvester Hadamard transform over the last dim, scaled by ``d^-0.5``.

    ``h`` is :func:`hadamard_matrix` of ``x.shape[-1]`` on ``x``'s device. Matches
    ``fast_hadamard_transform.hadamard_transform(x, scale=d**-0.5)``; computed in float32 and
    returned in ``x.dtype``.
    """
    d = x.shape[-1]
    if h.shape != (d, d):
        raise ValueError(f"Hadamard matrix {tuple(h.shape)} does not match the last dim {d}")
    return (x.float() @ h.float() * (1.0 / math.sqrt(d))).to(x.dtype)
