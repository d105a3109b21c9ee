"""The V4 sparse attention kernel (Triton, under the interpreter on CPU) against the torch reference,
and the dispatch's fallback path."""

from __future__ import annotations

import pytest
import torch

from reference_impl.families.deepseek_v4.kernels import dispatch as v4_dispatch
from reference_impl.families.deepseek_v4.kernels.attention_triton import v4_sparse_attention_triton
from reference_impl.families.deepseek_v4.model.sparse import sparse_attention_sinks
from reference_impl.kernels import fallback

SCALE = 512**-0.5


def _inputs(n_tok: int, heads: int, n_view: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tok, heads, 512, generator=g) / 4
    view = torch.randn(n_view, 512, generator=g)
    idx = torch.randint(-1, n_view, (n_tok, k), generator=g)
    return q, view, idx, torch.randn(heads, generator=g)


@pytest.mark.parametrize("heads", [4, 20])  # one head block; two, the second partly masked
def test_kernel_matches_reference_on_index_lists_and_dense_runs(heads):
    q, view, idx, sinks = _inputs(6, heads, 90, 37, seed=heads)
    start = torch.tensor([0, 5, 40, 0, 89, 3])
    length = torch.tensor([0, 17, 50, 1, 1, 33])  # 0: no run; a run to the view's last row
    ref = sparse_attention_sinks(q, view, idx, sinks, SCALE, start, length)
    out = v4_sparse_attention_triton(q, view, idx, sinks, SCALE, start, length)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_a_query_with_no_key_attends_to_its_sink_only():
    q, view, _, sinks = _inputs(2, 4, 10, 3)
    none = torch.full((2, 3), -1)
    out = v4_sparse_attention_triton(q, view, none, sinks, SCALE)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(
        sparse_attention_sinks(q, view, none, sinks, SCALE), out
    )


def test_the_sink_takes_probability_mass():
    """A large sink logit drives the output to zero; removing the sink (-inf) gives plain softmax."""
    q, view, idx, _ = _inputs(3, 4, 20, 8)
    idx = idx.clamp(min=0)
    big = v4_sparse_attention_triton(q, view, idx, torch.full((4,), 60.0), SCALE)
    plain = v4_sparse_attention_triton(q, view, idx, torch.full((4,), float("-inf")), SCALE)
    scores = torch.einsum("thd,tkd->thk", q, view[idx]) * SCALE
    expect = torch.einsum("thk,tkd->thd", scores.softmax(-1), view[idx])
    assert big.abs().max() < 1e-12 and torch.allclose(plain, expect, atol=1e-5)


def test_dispatch_falls_back_to_torch_when_the_kernel_raises(monkeypatch):
    """Off CUDA the dispatch takes torch; told kernels run and given one that raises, it falls back."""
    q, view, idx, sinks = _inputs(3, 4, 20, 8)
    ref = sparse_attention_sinks(q, view, idx, sinks, SCALE)
    assert torch.equal(v4_dispatch.sparse_attention(q, view, idx, sinks, SCALE), ref)
    assert v4_dispatch.attention_kernel_name(q.device) == "torch"
    import reference_impl.families.deepseek_v4.kernels.attention_triton as kernel

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(fallback, "use_kernels", lambda *a, **k: True)
    monkeypatch.setattr(kernel, "v4_sparse_attention_triton", broken)
    monkeypatch.setattr(fallback, "_FAILED", {})
    assert torch.equal(v4_dispatch.sparse_attention(q, view, idx, sinks, SCALE), ref)
    assert "Triton V4 sparse attention" in fallback.fallbacks_taken()


# ---- the indexer over compressed keys ------------------------------------------------------------


def _index_inputs(n_tok: int, n_keys: int, heads: int = 8, dim: int = 64, seed: int = 0):
    """FP4-simulated (power-of-two block scales) queries and keys in bf16, as a V4 rank holds them."""
    from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate

    g = torch.Generator().manual_seed(seed)
    q = fp4_simulate(torch.randn(n_tok, heads, dim, generator=g)).bfloat16()
    keys = fp4_simulate(torch.randn(n_keys, dim, generator=g)).bfloat16()
    weights = torch.randn(n_tok, heads, generator=g)
    return q, weights, keys


def _two_requests(n_tok: int):
    """Rows of two requests: the first's keys at view rows 0..29, the second's from row 30; each
    query sees a causal prefix of its own request's entries (0 to all, some below top-k)."""
    key_start = torch.tensor([0] * (n_tok // 2) + [30] * (n_tok - n_tok // 2))
    n_visible = torch.cat([torch.arange(n_tok // 2) % 31, torch.arange(n_tok - n_tok // 2) * 3 % 70])
    return key_start, n_visible


def _as_sets(sel: torch.Tensor) -> list[set[int]]:
    return [set(row[row >= 0].tolist()) for row in sel]


def _assert_same_sets_up_to_ties(got: torch.Tensor, want: torch.Tensor, q, weights, keys) -> None:
    """``got`` and ``want`` select the same keys per row, but where their scores tie within rounding.

    The two sides add the index score ``sum_h w_h ReLU(q_h . k)`` in different orders (the kernel's
    ``tl.dot`` and head loop, torch's einsums), so a key whose score sits within rounding of the k-th
    may trade places. A float32 sum of ``n`` products, in any order, is within ``gamma_n * sum |terms|``
    of the exact one (``gamma_n = n u / (1 - n u)``; Higham, *Accuracy and Stability of Numerical
    Algorithms*, eq. 3.5); the dot product (``D`` terms), the ReLU (exact) and the weighted head sum
    (``H`` terms) compose to ``gamma_(D+H) * A`` per side, ``A = sum_h |w_h| sum_d |q_hd k_d|``
    (Higham's lemma 3.3). A differing key must score within both sides' errors of the k-th key:
    ``2 gamma_(D+H) (A_key + A_kth)``."""
    from reference_impl.families.deepseek_v4.model.sparse import index_scores

    n = q.shape[-1] + q.shape[-2]
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    scores = index_scores(q, weights, keys).double()
    magnitude = torch.einsum("th,thd,sd->ts", weights.double().abs(), q.double().abs(), keys.double().abs())
    for row, (g, w) in enumerate(zip(_as_sets(got), _as_sets(want))):
        assert len(g) == len(w) == int((got[row] >= 0).sum()), f"row {row}: count or duplicates differ"
        if g == w:
            continue
        kth = min(w, key=lambda c: float(scores[row, c]))
        for col in g ^ w:
            bound = 2 * gamma * float(magnitude[row, col] + magnitude[row, kth])
            gap = abs(float(scores[row, col] - scores[row, kth]))
            assert gap <= bound, f"row {row}: key {col} scores {gap:.3g} from the k-th (ties within {bound:.3g})"


@pytest.fixture
def kernels_on(monkeypatch):
    """The dispatch told that kernels run (the Triton interpreter on CPU)."""
    monkeypatch.setattr(fallback, "use_kernels", lambda *a, **k: True)
    monkeypatch.setattr(fallback, "_FAILED", {})


@pytest.mark.parametrize("topk", [5, 16])
def test_indexer_kernel_selects_the_reference_sets(kernels_on, topk):
    """Two requests' keys in one view, causal entry ranges from 0 keys to past ``topk``; with host
    bounds (the CP layer's) and without, the kernel's sets are the reference's."""
    from reference_impl.families.deepseek_v4.model.sparse import select_entries

    q, weights, keys = _index_inputs(40, 100)
    key_start, n_visible = _two_requests(40)
    ref = select_entries(q, weights, keys, key_start, n_visible, topk)
    assert v4_dispatch.indexer_kernel_name(q, keys) == "triton"
    bounds = (key_start.tolist(), (key_start + n_visible).tolist())
    for host_bounds in (None, bounds):
        got = v4_dispatch.select_entries(q, weights, keys, key_start, n_visible, topk, host_bounds=host_bounds)
        assert got.shape == ref.shape and got.dtype == torch.int32
        _assert_same_sets_up_to_ties(got, ref, q, weights, keys)
    assert (got[n_visible == 0] == -1).all() and fallback.fallbacks_taken() == {}


def test_the_tie_rule_catches_a_key_that_does_not_tie():
    """The rule above lets rounding ties through and nothing else: a selection with one key swapped
    for the row's lowest-scoring key fails."""
    from reference_impl.families.deepseek_v4.model.sparse import index_scores, select_entries

    q, weights, keys = _index_inputs(4, 30)
    key_start, n_visible = torch.zeros(4, dtype=torch.long), torch.full((4,), 30)
    want = select_entries(q, weights, keys, key_start, n_visible, 5)
    _assert_same_sets_up_to_ties(want, want, q, weights, keys)
    wrong = want.clone()
    wrong[2, 0] = int(index_scores(q, weights, keys)[2].argmin())
    with pytest.raises(AssertionError, match="row 2"):
        _assert_same_sets_up_to_ties(wrong, want, q, weights, keys)


def test_indexer_kernel_streams_keys_past_one_tile(kernels_on, monkeypatch):
    """A 1M-token context's entries take several key tiles: the running top-k gives the same sets."""
    from reference_impl.families.deepseek_v4.model.sparse import select_entries
    from reference_impl.kernels import indexer_triton

    q, weights, keys = _index_inputs(24, 300, seed=1)
    key_start = torch.zeros(24, dtype=torch.long)
    n_visible = torch.linspace(0, 300, 24).long()
    real = indexer_triton.indexer_topk_triton
    monkeypatch.setattr(indexer_triton, "indexer_topk_triton", lambda *a, **k: real(*a, **{**k, "key_tile": 128}))
    got = v4_dispatch.select_entries(q, weights, keys, key_start, n_visible, 12)
    assert fallback.fallbacks_taken() == {}  # the kernel ran: a failure would have fallen back silently
    _assert_same_sets_up_to_ties(got, select_entries(q, weights, keys, key_start, n_visible, 12), q, weights, keys)


def test_indexer_takes_the_reference_for_keys_bf16_cannot_hold(kernels_on, monkeypatch):
    """float32 keys (the ``fp32`` codec) are not exact in bf16: the reference runs, not the kernel."""
    from reference_impl.kernels import indexer_triton

    q, weights, keys = _index_inputs(6, 20)
    monkeypatch.setattr(indexer_triton, "indexer_topk_triton", lambda *a, **k: pytest.fail("kernel ran"))
    assert v4_dispatch.indexer_kernel_name(q, keys.float()) == "torch"
    key_start, n_visible = torch.zeros(6, dtype=torch.long), torch.full((6,), 20)
    got = v4_dispatch.select_entries(q, weights, keys.float(), key_start, n_visible, 4)
    scores = torch.einsum("thd,sd->ths", q.float(), keys.float()).relu().mul(weights[:, :, None]).sum(1)
    want = torch.topk(scores, 4).indices
    _assert_same_sets_up_to_ties(got, want, q, weights, keys.float())  # the head sums in another order


def test_indexer_falls_back_to_the_reference_when_the_kernel_raises(kernels_on, monkeypatch):
    from reference_impl.families.deepseek_v4.model.sparse import select_entries
    from reference_impl.kernels import indexer_triton

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    q, weights, keys = _index_inputs(10, 30)
    key_start, n_visible = torch.zeros(10, dtype=torch.long), torch.arange(10) * 3
    monkeypatch.setattr(indexer_triton, "indexer_topk_triton", broken)
    got = v4_dispatch.select_entries(q, weights, keys, key_start, n_visible, 4)
    assert torch.equal(got, select_entries(q, weights, keys, key_start, n_visible, 4))
    assert "Triton V4 indexer" in fallback.fallbacks_taken()


# ---- the compressors' pooling --------------------------------------------------------------------


def _pool_inputs(ratio: int, n_entries: int, width: int, seed: int = 0):
    """A wide table whose column slices are the value and score rows (as the CP layer passes them),
    slot rows of consecutive windows, entry 0's previous window absent (CSA)."""
    from reference_impl.families.deepseek_v4.model.compressor import overlaps, slot_positions

    g = torch.Generator().manual_seed(seed)
    coff = 2 if overlaps(ratio) else 1
    n_rows = n_entries * ratio + 3
    table = torch.randn(n_rows, 2 * coff * width + 5, generator=g) * 3
    slots = slot_positions(torch.arange(n_entries), ratio)
    return table[:, : coff * width], table[:, coff * width : 2 * coff * width], torch.where(slots >= 0, slots, -1)


@pytest.mark.parametrize("ratio, width", [(4, 160), (128, 64)])  # CSA with a partial feature block; HCA
def test_pool_kernel_matches_the_reference(ratio, width):
    from reference_impl.families.deepseek_v4.kernels.compressor_triton import pool_triton
    from reference_impl.families.deepseek_v4.model.compressor import pool

    kv, score, slots = _pool_inputs(ratio, 6, width)
    ref = pool(kv, score, slots, ratio)
    out = pool_triton(kv, score, slots, ratio)
    assert out.shape == ref.shape == (6, width)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_pool_kernel_reads_each_half_where_the_overlap_says():
    """CSA entry 1 pools Ca (first half) of tokens 0..3 and Cb (second half) of 4..7: with the
    scores zero the result is the plain mean of exactly those halves."""
    from reference_impl.families.deepseek_v4.kernels.compressor_triton import pool_triton

    kv = torch.arange(8 * 2 * 16, dtype=torch.float32).reshape(8, 32)
    slots = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    out = pool_triton(kv, torch.zeros_like(kv), slots, 4)
    expect = torch.cat([kv[0:4, :16], kv[4:8, 16:]]).mean(0, keepdim=True)
    assert torch.allclose(out, expect)


def test_pool_kernel_refuses_a_slot_count_its_ratio_does_not_pool():
    from reference_impl.families.deepseek_v4.kernels.compressor_triton import pool_triton

    kv, score, slots = _pool_inputs(4, 3, 32)
    with pytest.raises(ValueError, match="slots per entry"):
        pool_triton(kv, score, slots[:, :4], 4)


def test_pool_dispatch_runs_the_kernel_and_falls_back(kernels_on, monkeypatch):
    from reference_impl.families.deepseek_v4.kernels import compressor_triton as v4_compressor_triton
    from reference_impl.families.deepseek_v4.model.compressor import pool

    kv, score, slots = _pool_inputs(4, 5, 32)
    ref = pool(kv, score, slots, 4)
    assert torch.allclose(v4_dispatch.pool(kv, score, slots, 4), ref, rtol=1e-5, atol=1e-6)
    assert fallback.fallbacks_taken() == {}  # the kernel ran, not the fallback

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(v4_compressor_triton, "pool_triton", broken)
    assert torch.equal(v4_dispatch.pool(kv, score, slots, 4), ref)
    assert "Triton V4 compressor pool" in fallback.fallbacks_taken()


# ---- the per-head norm and tail RoPE -------------------------------------------------------------


def _rope_inputs(n_tok: int, heads: int, dim: int, rope_dim: int, dtype=torch.float32, seed: int = 0):
    from reference_impl.model.rope import rope_cos_sin, yarn_frequencies

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n_tok, heads, dim, generator=g) * 3).to(dtype)
    cos, sin = rope_cos_sin(yarn_frequencies(rope_dim, 10000.0, 1.0, 0, 32, 1), torch.arange(n_tok) * 37 + 5)
    return x, cos, sin


@pytest.mark.parametrize("heads, rms, inverse", [(3, True, False), (1, False, False), (5, False, True)])
def test_rope_tail_kernel_matches_the_reference_in_float32(heads, rms, inverse):
    """Query (norm + RoPE), raw entry (one head, RoPE) and output (inverse): 11 tokens, so the last
    program's rows are partly masked; the first dims pass through untouched unless normed."""
    from reference_impl.families.deepseek_v4.kernels.rope_triton import rope_tail_triton
    from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail

    x, cos, sin = _rope_inputs(11, heads, 96, 32)
    sin = -sin if inverse else sin
    eps = 1e-6 if rms else None
    ref = rope_tail(x, cos, sin, 32, rms_eps=eps)
    out = rope_tail_triton(x, cos, sin, 32, rms_eps=eps)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    if not rms:
        assert torch.equal(out[..., :64], x[..., :64])
        assert not torch.allclose(out[..., 64:], x[..., 64:])  # the tail did rotate


def test_rope_tail_kernel_casts_like_the_reference():
    """float32 in, bf16 out (the attention output's inverse RoPE): the dtype, and values within one
    bf16 step. Inputs that bf16 holds exactly, so that each output is one rounding of the same
    float32 value; the interpreter's casts truncate where the GPU's round, hence the step. This
    cannot tell the reference's cast before the rotation from a single rounding after it; the GPU
    tier's test, which compares bf16 bits, can."""
    from reference_impl.families.deepseek_v4.kernels.rope_triton import rope_tail_triton
    from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail

    x, cos, sin = _rope_inputs(9, 4, 64, 16)
    x = x.bfloat16().float()
    ref = rope_tail(x, cos, -sin, 16, out_dtype=torch.bfloat16)
    out = rope_tail_triton(x, cos, -sin, 16, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=1e-6)


def test_rope_tail_kernel_refuses_tables_of_the_wrong_shape():
    from reference_impl.families.deepseek_v4.kernels.rope_triton import rope_tail_triton

    x, cos, sin = _rope_inputs(4, 2, 64, 16)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_tail_triton(x, cos[:3], sin[:3], 16)
    with pytest.raises(ValueError, match="rope_dim"):
        rope_tail_triton(x, cos, sin, 12)


def test_rope_tail_dispatch_runs_the_kernel_and_falls_back(kernels_on, monkeypatch):
    from reference_impl.families.deepseek_v4.kernels import rope_triton as v4_rope_triton
    from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail

    x, cos, sin = _rope_inputs(6, 2, 64, 16)
    ref = rope_tail(x, cos, sin, 16, rms_eps=1e-6)
    assert torch.allclose(v4_dispatch.rope_tail(x, cos, sin, 16, 1e-6), ref, rtol=1e-5, atol=1e-5)
    assert fallback.fallbacks_taken() == {}  # the kernel ran, not the fallback

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(v4_rope_triton, "rope_tail_triton", broken)
    assert torch.equal(v4_dispatch.rope_tail(x, cos, sin, 16, 1e-6), ref)
    assert "Triton V4 rope tail" in fallback.fallbacks_taken()


# ---- the indexer query's FP4 round trip ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_kernel_is_bit_exact(dtype):
    """Random values over six decades, plus every midpoint of the e2m1 grid (the ties), both signs,
    zeros and a subnormal: the kernel's bits are the reference's."""
    from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate
    from reference_impl.families.deepseek_v4.kernels.fp4_triton import fp4_simulate_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 128, generator=g) * torch.logspace(-3, 3, 128)
    x[0, 0, :16] = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -3.5, 0.0, -0.0, 1e-40, 0.1]
    )
    x = x.to(dtype)
    ref, out = fp4_simulate(x), fp4_simulate_triton(x)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert out.dtype == dtype and torch.equal(out.view(bits), ref.view(bits))


def test_fp4_dispatch_runs_the_kernel_and_falls_back(kernels_on, monkeypatch):
    from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate
    from reference_impl.families.deepseek_v4.kernels import fp4_triton as v4_fp4_triton

    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(v4_dispatch.fp4_simulate(x), fp4_simulate(x))
    assert fallback.fallbacks_taken() == {}  # the kernel ran, not the fallback

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(v4_fp4_triton, "fp4_simulate_triton", broken)
    assert torch.equal(v4_dispatch.fp4_simulate(x), fp4_simulate(x))
    assert "Triton V4 FP4 round trip" in fallback.fallbacks_taken()
