"""The glue kernels (query preparation, RMSNorm) on the GPU at DeepSeek-V3.2 widths, against the torch
references (GPU tier).

RoPE into the absorbed query must equal the reference bit for bit (no FMA contraction). The
indexer query's Hadamard sums run in another order than the reference's float32 GEMM, so a few
rotated values round to the neighbouring bf16 and their FP8 codes move by one step; everything
else (RoPE, scaling, weights) follows the reference's roundings. RMSNorm's sum and ``rsqrt`` are
the kernel's own: bf16 results equal, or one bf16 step apart.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.fp8 import hadamard_matrix
from reference_impl.kernels import dispatch, fallback
from reference_impl.kernels.query_prep_triton import indexer_query_triton, rope_into_triton
from reference_impl.kernels.rms_norm_triton import rms_norm_triton
from reference_impl.model import norm
from reference_impl.model import query_prep as ref
from reference_impl.model.rope import rope_cos_sin, rope_frequencies
from reference_impl.presets import get_preset

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
V32 = get_preset("deepseek-v3.2")


def _tables(n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(120_000, 120_000 + n_tokens, device=DEVICE)
    return rope_cos_sin(rope_frequencies(V32, DEVICE), positions)


def test_rope_into_equals_the_reference_bit_for_bit_on_the_gpu() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(4096, 128, 192, device=DEVICE, generator=gen).to(torch.bfloat16)  # wq_b's output
    cos, sin = _tables(4096)
    want = torch.zeros(4096, 128, 576, dtype=torch.bfloat16, device=DEVICE)
    got = want.clone()
    ref.rope_into(want[..., 512:], q[..., 128:], cos, sin, True)
    rope_into_triton(got[..., 512:], q[..., 128:], cos, sin, True)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_indexer_query_matches_the_reference_up_to_the_rotations_last_bit(scale_fmt: str) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    n_tokens, n_heads = 4096, 64
    q = (torch.randn(n_tokens, n_heads, 128, device=DEVICE, generator=gen) * 2).to(torch.bfloat16)
    cos, sin = _tables(n_tokens)
    h = hadamard_matrix(128, DEVICE)
    w = torch.randn(n_tokens, n_heads, device=DEVICE, generator=gen)
    want_q, want_w = ref.indexer_query(q, cos, sin, h, w, 64, False, scale_fmt)
    got_q, got_w = indexer_query_triton(q, cos, sin, h, w, 64, False, scale_fmt)
    codes_equal = (got_q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean().item()
    assert codes_equal > 0.995, codes_equal
    # A moved code is the neighbouring e4m3 value: at most one step, 1/8 of the value (3 mantissa bits).
    got_v, want_v = got_q.float(), want_q.float()
    assert ((got_v - want_v).abs() <= 0.125 * want_v.abs() + 2.0**-9).all()
    weights_equal = (got_w == want_w).float().mean().item()
    assert weights_equal > 0.99, weights_equal  # a head's scale moves only with its amax's bf16
    assert torch.allclose(got_w, want_w, rtol=2e-2, atol=0)


def test_the_dispatch_runs_the_query_kernels_in_a_kernel_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from reference_impl.kernels import query_prep_triton

    calls: list[str] = []
    for name in ("indexer_query_triton", "rope_into_triton"):
        real = getattr(query_prep_triton, name)
        monkeypatch.setattr(
            query_prep_triton, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1]
        )
    fallback.reset_fallbacks()
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(64, 64, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
    cos, sin = _tables(64)
    dispatch.indexer_query(
        q, cos, sin, hadamard_matrix(128, DEVICE), torch.randn(64, 64, device=DEVICE), 64, False, "ue8m0"
    )
    dispatch.rope_into(torch.empty(64, 64, 64, dtype=torch.bfloat16, device=DEVICE), q[..., 64:], cos, sin, True)
    assert calls == ["indexer_query_triton", "rope_into_triton"]
    x = torch.randn(64, 7168, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(
        dispatch.rms_norm(x, torch.ones(7168, device=DEVICE), 1e-6),
        rms_norm_triton(x, torch.ones(7168, device=DEVICE), 1e-6),
    )
    assert not fallback.fallbacks_taken()


@pytest.mark.parametrize("width", [7168, 1536, 512])
def test_rms_norm_matches_the_reference_to_one_bf16_step(width: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = (torch.randn(16384, width, device=DEVICE, generator=gen) * 3).to(torch.bfloat16)
    weight = 1.0 + 0.1 * torch.randn(width, device=DEVICE, generator=gen)
    got, want = rms_norm_triton(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6)
    assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs()).all()
    equal = (got == want).float().mean().item()
    assert equal > 0.99, equal
