"""The Triton compute kernels against the torch references on the GPU, at DeepSeek-V3.2 widths (GPU tier).

Sparse MLA attention (576 / 512, 128 heads, top-k 2048 with -1 holes and an empty row) and the
indexer (64 heads x 128, FP8 keys, causal ranges of a zigzag rank): the logits to the reference's
rounding, the top-k as index sets up to boundary ties. The Gluon kernel has its own module.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.kernels import dispatch, fallback
from reference_impl.model import sparse_attention as ref
from reference_impl.fp8 import act_quant

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def test_triton_sparse_mla_matches_the_reference_at_deepseek_widths() -> None:
    from reference_impl.kernels.sparse_mla_triton import sparse_mla_attention_triton

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    n_tokens, n_heads, n_kv, topk = 48, 128, 6000, 2048
    q = torch.randn(n_tokens, n_heads, 576, device=DEVICE, generator=gen).to(torch.bfloat16)
    kv = torch.randn(n_kv, 576, device=DEVICE, generator=gen).to(torch.bfloat16)
    indices = torch.randint(0, n_kv, (n_tokens, topk), device=DEVICE, generator=gen, dtype=torch.int32)
    indices[1, 100:900] = -1
    indices[2] = -1
    scale = 192**-0.5
    out, lse = sparse_mla_attention_triton(q, kv, indices, scale, 512, out_dtype=torch.bfloat16)
    want_out, want_lse = ref.sparse_mla_attention(q, kv, indices, scale, 512)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (out[2] == 0).all()
    assert _rel(out, want_out) < 1e-2
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


def _indexer_case(n_rows: int, n_keys: int, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, q_scale = act_quant(torch.randn(n_rows, 64, 128, device=DEVICE, generator=gen), 128, "ue8m0")
    k, k_scale = act_quant(torch.randn(n_keys, 128, device=DEVICE, generator=gen), 128, "ue8m0")
    weights = torch.randn(n_rows, 64, device=DEVICE, generator=gen) * q_scale[..., 0] * (64 * 128) ** -0.5
    # A zigzag rank's rows: early positions then late ones, each seeing keys [0, position].
    positions = torch.cat([torch.arange(0, n_rows // 2), torch.arange(n_keys - n_rows // 2, n_keys)]).to(DEVICE)
    return q, weights, k, k_scale[:, 0], torch.zeros_like(positions), positions + 1


def test_triton_indexer_logits_and_topk_match_the_reference() -> None:
    from reference_impl.kernels.indexer_triton import indexer_logits_triton, indexer_topk_triton

    q, w, k, ks, start, end = _indexer_case(256, 5000, 1)
    logits = indexer_logits_triton(q, w, k, ks, start, end, 0, 5000)
    want = ref.indexer_scores(q, w, k, ks)
    cols = torch.arange(5000, device=DEVICE)
    visible = (cols >= start[:, None]) & (cols < end[:, None])
    assert torch.equal(torch.isinf(logits), ~visible)
    assert _rel(logits[visible], want[visible]) < 1e-3  # fp32 accumulation in another order
    got = indexer_topk_triton(q, w, k, ks, start, end, 2048)
    expected = ref.indexer_topk(q, w, k, ks, start, end, 2048)
    assert torch.equal(got < 0, expected < 0)  # the same number of selected keys per row
    for row in range(0, 256, 17):  # sets equal up to ties at the k-th score
        a, b = set(got[row][got[row] >= 0].tolist()), set(expected[row][expected[row] >= 0].tolist())
        if a != b:
            kth = want[row][expected[row][expected[row] >= 0].long()].min()
            diff = torch.tensor(sorted(a ^ b), device=DEVICE)
            assert bool(((want[row][diff] - kth).abs() <= 2e-3 * want[row][visible[row]].abs().max()).all()), row


def test_the_dispatch_takes_the_kernels_on_cuda() -> None:
    fallback.reset_fallbacks()
    q, w, k, ks, start, end = _indexer_case(64, 3000, 2)
    top = dispatch.indexer_topk(q, w, k, ks, start, end, 512)
    assert top.is_cuda and top.shape == (64, 512)
    assert fallback.use_kernels(DEVICE) and fallback.fallbacks_taken() == {}
