"""Rotary position embedding with DeepSeek's YaRN frequency correction.

MLA applies RoPE **interleaved** (pairs ``(x[2i], x[2i+1])``). The indexer applies it
**non-interleaved** for DeepSeek-V3.2 (pairs ``(x[i], x[i + d/2])``; the first public demo had this
wrong, fixed 2025-11) and interleaved for GLM-5: :attr:`ModelConfig.index_rope_interleaved`.
"""

from __future__ import annotations

import math

import torch

from reference_impl.presets import ModelConfig


def rope_frequencies(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair angular frequencies ``[qk_rope_head_dim // 2]`` float32, YaRN-corrected when enabled.

    ``device=None`` allocates on the current default device (e.g. inside ``with torch.device(...)``).
    """
    yarn = cfg.max_seq_len > cfg.original_seq_len and cfg.rope_factor > 1.0
    freqs = yarn_frequencies(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        cfg.rope_factor,
        cfg.original_seq_len if yarn else 0,
        cfg.beta_fast,
        cfg.beta_slow,
    )
    return freqs if device is None else freqs.to(device)


def yarn_frequencies(
    dim: int, base: float, factor: float, original_seq_len: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """``base^(-2i/dim)`` per pair ``[dim // 2]`` float32; with ``original_seq_len > 0``, DeepSeek's
    YaRN correction: frequencies below the ``beta_slow`` rotation count divided by ``factor``, a
    linear ramp up to ``beta_fast`` (no attention scale: that is the caller's business)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:

        def correction_dim(num_rotations: float) -> float:
            return dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``positions [T] x freqs [d/2]`` -> two ``[T, d/2]`` float32 tensors."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.unsqueeze(0)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., d]`` by per-token ``cos, sin [T, d/2]``; returns ``x.dtype``.

    Interleaved pairs are ``(x[2i], x[2i+1])``; non-interleaved pairs are ``(x[i], x[i + d/2])``.
    """
    dtype, d = x.dtype, x.shape[-1]
    xf = x.float()
    # Broadcast [T, d/2] over any head dims between T and d.
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    c, s = cos.view(shape), sin.view(shape)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(dtype)
