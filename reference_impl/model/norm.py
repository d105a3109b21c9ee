"""The torch reference of RMSNorm, the normalization around a DSA layer's projections.

DeepSeek-V3.2's ``RMSNorm``: in float32, ``x * rsqrt(mean(x^2) + eps)`` times a float32 weight,
returned in the input dtype. A layer runs it three times per token: ``attn_norm`` on the hidden
state (7,168 wide), ``q_norm`` on the query's low-rank latent (1,536) and ``kv_norm`` on the KV
latent (512). The model calls it through :class:`~reference_impl.model.sparse_attention.ComputeOps`,
so the GPU can run it as one kernel (:mod:`reference_impl.kernels.rms_norm_triton`).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., n]`` with ``weight [n]`` float32 -> ``x.dtype``, computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype)
