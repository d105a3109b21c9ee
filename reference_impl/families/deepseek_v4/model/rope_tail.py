"""The V4 layer's per-head elementwise step: an optional unweighted RMS norm, then interleaved RoPE
on the last ``rope_dim`` dims of every head.

V4 puts RoPE on the last 64 of a head's dims (q, the raw entry, the indexer query) and, because
K = V carries the rotation into the output, rotates the output back (inverse RoPE, ``sin``
negated). The query also gets an unweighted RMS norm per head first. Order and roundings, as the
released model::

    y = x * rsqrt(mean(x^2) + eps)     (float32; only with rms_eps)
    y = y in x's dtype, then in out_dtype
    y[..., -rope_dim:] = RoPE(y[..., -rope_dim:])    (float32, rounded to out_dtype)

On a query of V4-Flash at 16,384 tokens (one rank of 8 at 128K) ``x`` is ``[T, 64, 512]`` bf16,
1 GiB; the torch reference below passes over it about ten times (float copies, strided products
of the interleaved pairs, a stack, casts). The kernel of :mod:`reference_impl.families.deepseek_v4.kernels.rope_triton`
reads it once and writes it once.
"""

from __future__ import annotations

import torch

from reference_impl.model.rope import apply_rope


def rope_tail(
    x: torch.Tensor,  # [T, ..., D]
    cos: torch.Tensor,  # [T, rope_dim // 2] float32 (rope_cos_sin of the tokens' positions)
    sin: torch.Tensor,  # [T, rope_dim // 2] float32 (negated for the inverse rotation)
    rope_dim: int,
    rms_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[T, ..., D]`` in ``out_dtype`` (default ``x.dtype``); see the module docstring."""
    if rms_eps is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)).to(x.dtype)
    out = x.to(out_dtype or x.dtype, copy=True)
    out[..., -rope_dim:] = apply_rope(out[..., -rope_dim:], cos, sin, True)
    return out
