"""The Triton compute kernels against the torch references on the GPU, at DeepSeek-V3.2 widths (GPU tier).

Sparse MLA attention (576 / 512, 128 heads, top-k 2048 with -1 holes and an empty row) and the
indexer (64 heads x 128, FP8 keys, causal ranges of a zigzag rank): the logits to the reference's
rounding, the top-k as index sets up to boundary ties. The Gluon kernel has its own module.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.fp8 import act_quant
from reference_impl.kernels import dispatch, fallback
from reference_impl.model import sparse_attention as ref

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


def test_topk_selection_is_exact_at_the_per_rank_width() -> None:
    """The Triton selection against the exact reference (indices) and torch.topk (the selected
    values) over 128K-key rows with random ranges, plus rows of ties (path 1) and rows of
    increasing scores (the tightest bound)."""
    from reference_impl.kernels.topk_select import selected_scores, topk_select_reference, topk_select_triton

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    n_rows, n_keys, k = 96, 131072, 2048
    logits = torch.randn(n_rows, n_keys, device=DEVICE, generator=gen)
    logits[:8] = torch.randint(0, 4, (8, n_keys), device=DEVICE, generator=gen).float()  # ties at the bound
    logits[8:16] = torch.arange(n_keys, device=DEVICE).float()  # increasing scores: the bound is tight
    ends = torch.cat(
        [
            torch.randint(1, n_keys + 1, (n_rows - 4,), device=DEVICE, generator=gen),
            torch.tensor([1, 100, 2048, 2049], device=DEVICE),
        ]
    )
    ends[:16] = n_keys  # the tie rows and the increasing rows see every key
    starts = torch.zeros_like(ends)
    starts[40:48] = 1000  # rows whose range starts past column 0
    paths = torch.full((n_rows,), -1, dtype=torch.int8, device=DEVICE)
    got = topk_select_triton(logits, starts, ends, k, paths=paths)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, k))
    assert (paths[:8] == 1).all() and (paths[8:] == 0).all(), paths.tolist()  # ties at the bound; candidates
    for row in range(16, n_rows, 11):
        lo, hi = int(starts[row]), int(ends[row])
        values = logits[row, lo:hi].topk(min(k, hi - lo)).values
        assert torch.equal(selected_scores(logits[row : row + 1], got[row : row + 1])[0, : values.numel()], values)


def test_topk_selection_whole_row_path() -> None:
    """The largest keys folded into a few columns of pass 1 (block i is rotated by i * 1031
    columns): the column maxima cannot separate them, so the rows take path 2 (radix select over
    the whole row), exact. Scores repeating with a period of G stay on path 0."""
    from reference_impl.kernels.topk_select import candidate_slots, topk_select_reference, topk_select_triton

    k, n, hot_columns = 2048, 131072, 128
    g = candidate_slots(k)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    logits = torch.rand(4, n, device=DEVICE, generator=gen)
    blocks = torch.arange(n // g, device=DEVICE)[:, None]
    hot = (blocks * g + (torch.arange(hot_columns, device=DEVICE)[None] + blocks * 1031) % g).flatten()
    logits[:2, hot] = 100.0 + torch.rand(2, hot.numel(), device=DEVICE, generator=gen)
    logits[2:] = torch.rand(g, device=DEVICE, generator=gen).repeat(n // g)  # period G
    starts = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    ends = torch.full((4,), n, device=DEVICE)
    paths = torch.full((4,), -1, dtype=torch.int8, device=DEVICE)
    got = topk_select_triton(logits, starts, ends, k, paths=paths)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, k))
    assert paths.tolist() == [2, 2, 0, 0]


def test_indexer_topk_selectors_pick_the_same_scores() -> None:
    """indexer_topk_triton with the selection kernel and with torch.topk: the same scores selected."""
    from reference_impl.kernels.indexer_triton import indexer_logits_triton, indexer_topk_triton
    from reference_impl.kernels.topk_select import selected_scores, topk_select_reference

    q, w, k, ks, start, end = _indexer_case(256, 20000, 4)
    logits = indexer_logits_triton(q, w, k, ks, start, end, 0, 20000)
    kernel = indexer_topk_triton(q, w, k, ks, start, end, 2048, rows_per_chunk=100, selector="triton")
    torch_topk = indexer_topk_triton(q, w, k, ks, start, end, 2048, rows_per_chunk=100, selector="torch")
    assert torch.equal(kernel < 0, torch_topk < 0)
    assert torch.equal(selected_scores(logits, kernel), selected_scores(logits, torch_topk))
    assert torch.equal(kernel, topk_select_reference(logits, start, end, 2048))


def test_the_fused_bound_on_the_gpu_writes_the_reference_maxima_and_selects_exactly() -> None:
    """Rows long enough (at k = 2048) for the bound to read the logits kernel's group maxima: the
    maxima are the torch reference's, bit for bit, and the selection with them is the exact one, the
    same as with the bound read from the logits; the long rows stay on the fast path."""
    from reference_impl.kernels.indexer_triton import indexer_logits_triton, indexer_topk_triton
    from reference_impl.kernels.topk_select import (
        group_maxima_reference,
        maxima_width,
        topk_select_reference,
        topk_select_triton,
    )

    n_keys = 70000
    q, w, k, ks, start, end = _indexer_case(128, n_keys, 5)
    maxima = torch.empty(128, maxima_width(n_keys), dtype=torch.uint32, device=DEVICE)
    logits = indexer_logits_triton(q, w, k, ks, start, end, 0, n_keys, maxima=maxima)
    assert torch.equal(maxima.view(torch.int32).long() & 0xFFFFFFFF, group_maxima_reference(logits, start, end))
    paths = torch.full((128,), -1, dtype=torch.int8, device=DEVICE)
    fused = topk_select_triton(logits, start, end, 2048, maxima=maxima, paths=paths)
    assert torch.equal(fused, topk_select_reference(logits, start, end, 2048))
    assert (paths[64:] == 0).all()  # the late rows, 69,936+ keys: their candidates fit
    plain = indexer_topk_triton(q, w, k, ks, start, end, 2048, selector="triton")
    assert torch.equal(indexer_topk_triton(q, w, k, ks, start, end, 2048, selector="triton", fused_bound=True), plain)
    assert torch.equal(plain, fused)


def test_streamed_indexer_topk_selects_what_one_pass_selects() -> None:
    """Keys streamed in tiles (the running top-k in the selection's buffer, right to left) give the
    one-pass selection's keys exactly, at DeepSeek widths over 300K keys, with and without ties; the
    streamed buffer is the tile's, not the context's."""
    from reference_impl.kernels.indexer_triton import indexer_logits_triton, indexer_tile_bytes, indexer_topk_triton
    from reference_impl.kernels.topk_select import topk_select_reference

    q, w, k, ks, start, end = _indexer_case(128, 300_000, 4)
    fallback.reset_fallbacks()
    one_pass = indexer_topk_triton(q, w, k, ks, start, end, 2048, selector="triton", key_tile=1 << 20)
    streamed = indexer_topk_triton(q, w, k, ks, start, end, 2048, selector="triton", key_tile=32768)
    assert fallback.fallbacks_taken() == {}
    assert torch.equal(streamed, one_pass)
    ties = q.clone()
    ties[:, :, 1:] = 0  # scores from one coordinate: many keys tie
    rows = slice(60, 68)
    logits = indexer_logits_triton(ties[rows], w[rows], k, ks, start[rows], end[rows], 0, 300_000)
    assert logits[0].isfinite().sum() > logits[0][logits[0].isfinite()].unique().numel()  # ties
    want = topk_select_reference(logits, start[rows], end[rows], 2048)  # the kernel's own scores, one pass
    got = indexer_topk_triton(
        ties[rows], w[rows], k, ks, start[rows], end[rows], 2048, selector="triton", key_tile=32768
    )
    assert torch.equal(got, want)
    assert indexer_tile_bytes(16384, 1 << 20, 2048) == indexer_tile_bytes(16384, 1 << 22, 2048)
