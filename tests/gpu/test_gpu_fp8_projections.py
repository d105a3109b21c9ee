"""Block-scaled FP8 projections and the block-pointer logits kernel on the GPU (GPU tier)."""

from __future__ import annotations

import pytest
import torch

from reference_impl.fp8 import act_quant
from reference_impl.kernels import fallback, fp8_gemm
from reference_impl.model.fp8_linear import emulated_block_fp8_gemm, quantize_weight

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("m", "k", "n"), [(1000, 7168, 640), (64, 1536, 1024), (3, 256, 128)])
def test_triton_and_dispatch_gemms_match_the_emulation(m: int, k: int, n: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x_fp8, x_scale = act_quant(torch.randn(m, k, device=DEVICE, generator=gen), 128, "ue8m0")
    w_fp8, w_scale = quantize_weight(torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5)
    want = emulated_block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    assert _rel(fp8_gemm.block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, torch.float32), want) < 1e-3
    fallback.reset_fallbacks()
    got = fp8_gemm.block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2
    assert "Triton block FP8 GEMM" not in fallback.fallbacks_taken()


def test_scaled_mm_takes_deepseeks_recipe_where_torch_has_it() -> None:
    """cuBLAS's block scaling on sm_90: the emulation's result, or a clear refusal (then the
    dispatch runs Triton, checked above)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x_fp8, x_scale = act_quant(torch.randn(130, 1280, device=DEVICE, generator=gen), 128, "ue8m0")
    w_fp8, w_scale = quantize_weight(torch.randn(384, 1280, device=DEVICE, generator=gen))
    want = emulated_block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    try:
        got = fp8_gemm.scaled_mm_block_fp8(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    except RuntimeError as exc:
        pytest.skip(f"torch._scaled_mm does not take the block recipe here: {exc}")
    assert got.shape == (130, 384) and _rel(got, want) < 1e-2


def test_block_pointer_logits_equal_the_default_kernels() -> None:
    from reference_impl.kernels.indexer_triton import indexer_logits_triton

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    q, _ = act_quant(torch.randn(200, 64, 128, device=DEVICE, generator=gen), 128, "ue8m0")
    k, ks = act_quant(torch.randn(5000, 128, device=DEVICE, generator=gen), 128, "ue8m0")
    w = torch.randn(200, 64, device=DEVICE, generator=gen)
    start = torch.zeros(200, dtype=torch.long, device=DEVICE)
    end = torch.randint(1, 5001, (200,), device=DEVICE, generator=gen)
    plain = indexer_logits_triton(q, w, k, ks[:, 0], start, end, 100, 4900, block_pointers=False)
    for warps in (4, 8):
        via_blocks = indexer_logits_triton(
            q, w, k, ks[:, 0], start, end, 100, 4900, block_pointers=True, num_warps=warps
        )
        assert torch.equal(via_blocks, plain)
