"""FP8 projections with 128-block scales, as DeepSeek runs its checkpoints (opt-in; bf16 is the reference).

DeepSeek ships the attention's linear maps as FP8 (e4m3) weights with one float32 scale per
128 x 128 block, and multiplies them by activations quantized on the fly with one scale per
1 x 128 block (per token, per 128 input features):

``y[t, n] = sum_b  a_scale[t, b] * w_scale[n // 128, b] * sum_{k in block b} a_fp8[t, k] * w_fp8[n, k]``

Scales are ``amax / 448`` (:func:`reference_impl.fp8.act_quant`); the activations' use the model's
scale format (V3.2: powers of two, ``ue8m0``), the weights' are plain float32. This module holds
the math as a torch emulation (:func:`emulated_block_fp8_gemm`: dequantize both, one fp32
product; the reference the GPU GEMMs are checked against) and :class:`Fp8BlockLinear`, which
replaces a bf16 linear map; :func:`quantize_projections` swaps them into a model. The GEMM the
module runs is injected (:mod:`reference_impl.kernels.fp8_gemm` on a GPU), so this layer imports no
kernel. Which maps: ``wq_a, wq_b, wkv_a, wo`` and the indexer's ``wq_b, wk``; ``wkv_b`` stays bf16
(its halves are absorbed into the query and the output, products of the weights themselves) and
the indexer's ``weights_proj`` stays float32, as in DeepSeek's inference code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from reference_impl.fp8 import FP8_MAX, act_quant
from reference_impl.model.attention import DSAAttention, pad_rows

BLOCK = 128
PROJECTIONS = ("wq_a", "wq_b", "wkv_a", "wo", "indexer.wq_b", "indexer.wk")
"""The linear maps :func:`quantize_projections` turns into FP8 ones (names in a DSA attention layer)."""

BlockGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
"""``(x_fp8 [M, K], x_scale [M, K/128] f32, w_fp8 [N, K], w_scale [N/128, K/128] f32, out_dtype) -> [M, N]``."""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(w_fp8 [N', K] e4m3, scale [N'/128, K/128] f32)`` with one ``amax / 448`` scale
    per 128 x 128 block; ``N' = N`` rounded up to a multiple of 128 (zero rows; the GEMMs need whole
    blocks). ``K`` must be a multiple of 128."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    n_pad = -(-n // BLOCK) * BLOCK
    padded = torch.zeros(n_pad, k, dtype=torch.float32, device=w.device)
    padded[:n] = w.float()
    blocks = padded.view(n_pad // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [N'/128, K/128]
    scale = amax / amax.new_full((1,), FP8_MAX)
    w_fp8 = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(n_pad, k).to(torch.float8_e4m3fn)
    return w_fp8, scale


def dequantize_weight(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_weight` in float32 (the padded ``[N', K]``)."""
    n, k = w_fp8.shape
    blocks = w_fp8.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * scale[:, None, :, None]
    return blocks.view(n, k)


def emulated_block_fp8_gemm(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The block-scaled FP8 GEMM in torch: both operands dequantized exactly to float32, one fp32
    product (rows padded on a CPU so a row's bits do not depend on how many rows there are)."""
    m, k = x_fp8.shape
    x = (x_fp8.float().view(m, k // BLOCK, BLOCK) * x_scale[..., None]).view(m, k)
    out = pad_rows(x) @ dequantize_weight(w_fp8, w_scale).t()
    return out[:m].to(out_dtype)


class Fp8BlockLinear(nn.Module):
    """A bias-free linear map with FP8 weights in 128 x 128 blocks; activations are quantized per
    1 x 128 block (``scale_fmt``) and multiplied by ``gemm`` (:data:`BlockGemm`)."""

    weight: torch.Tensor  # a buffer (float8)
    weight_scale: torch.Tensor  # a buffer
    in_features: int
    out_features: int
    out_dtype: torch.dtype
    scale_fmt: str
    gemm: BlockGemm

    def __init__(self, linear: nn.Linear, scale_fmt: str, gemm: BlockGemm = emulated_block_fp8_gemm) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Fp8BlockLinear takes bias-free linear maps")
        w_fp8, w_scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight", w_fp8)
        self.register_buffer("weight_scale", w_scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.scale_fmt = scale_fmt
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp8, x_scale = act_quant(x.reshape(-1, self.in_features), BLOCK, self.scale_fmt)
        out = self.gemm(x_fp8, x_scale, self.weight, self.weight_scale, self.out_dtype)
        if out.shape[1] != self.out_features:  # the padded rows of the weight (wkv_a: 576 of 640)
            out = out[:, : self.out_features].contiguous()
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_projections(model: nn.Module, scale_fmt: str, gemm: BlockGemm = emulated_block_fp8_gemm) -> int:
    """Replace every DSA layer's :data:`PROJECTIONS` in ``model`` with :class:`Fp8BlockLinear` ->
    how many maps were replaced. The bf16 weights go (the FP8 ones are what remains). A map whose
    input width is not a multiple of 128 (the ``tiny`` preset's ``q_lora`` of 96) stays as it is."""
    replaced = 0
    for layer in [m for m in model.modules() if isinstance(m, DSAAttention)]:
        for proj in PROJECTIONS:
            owner_name, _, leaf = proj.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            linear = getattr(owner, leaf)
            if isinstance(linear, nn.Linear) and linear.in_features % BLOCK == 0:
                setattr(owner, leaf, Fp8BlockLinear(linear, scale_fmt, gemm))
                replaced += 1
    return replaced
