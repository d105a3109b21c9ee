"""The V4 sparse attention kernel (Triton, under the interpreter on CPU) against the torch reference,
and the dispatch's fallback path."""

from __future__ import annotations

import pytest
import torch

from reference_impl.kernels import fallback, v4_dispatch
from reference_impl.kernels.v4_attention_triton import v4_sparse_attention_triton
from reference_impl.model.v4.sparse import sparse_attention_sinks

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
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(sparse_attention_sinks(q, view, none, sinks, SCALE), out)


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
    import reference_impl.kernels.v4_attention_triton as kernel

    def broken(*args, **kwargs):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(fallback, "use_kernels", lambda *a, **k: True)
    monkeypatch.setattr(kernel, "v4_sparse_attention_triton", broken)
    monkeypatch.setattr(fallback, "_FAILED", {})
    assert torch.equal(v4_dispatch.sparse_attention(q, view, idx, sinks, SCALE), ref)
    assert "Triton V4 sparse attention" in fallback.fallbacks_taken()
