"""Installing a prefix works in bounded memory: chunk by chunk, the oracle's bytes, KV-sized state.

The install (:func:`reference_impl.engine.install_prefixes` through
:func:`reference_impl.model.prefix_prefill.prefill_prefix`) runs the prefix in chunks and writes
each chunk's rows to the store as a layer makes them. Its CPU allocations are measured with the
profiler at two prefix lengths: beyond the KV it keeps (the dense caches), what it holds grows by
at most one layer's dequantized full view per token, where computing the whole prefix at once (the
earlier install) holds every layer's projections of every token.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny
from torch.profiler import ProfilerActivity, profile

from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.kvcache.layout import KVLayout
from reference_impl.model import prefix_prefill, sparse_attention
from reference_impl.model.oracle import run_oracle
from reference_impl.model.prefix_prefill import GrowingCache, prefill_prefix, prefix_spans
from reference_impl.runner import run_prefill
from reference_impl.workload import build_inputs, build_model


def cpu_peak_bytes(fn: object) -> int:
    """Peak of the CPU bytes allocated while ``fn()`` runs, above what was allocated before (the
    profiler's allocation events, frees negative, summed in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return peak


def test_prefix_spans_cut_the_prefix_into_chunks() -> None:
    assert prefix_spans(0, 4) == [] and prefix_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert prefix_spans(3) == [(0, 3)]
    with pytest.raises(ValueError, match="at least one token"):
        prefix_spans(10, 0)


def test_growing_cache_refuses_tokens_past_its_capacity() -> None:
    run = RunConfig(preset="tiny", cp_size=1, requests=(Request(0, 8),), check=False, device="cpu")
    model = build_model(run, torch.device("cpu"))
    layout = KVLayout.from_config(run.model, "fp8", 64)
    caches = prefill_prefix(model, build_inputs(run, torch.device("cpu"))[0], layout, lambda *a: None, chunk_tokens=3)
    assert len(caches[0]) == 8 and isinstance(caches[0], GrowingCache)
    proj = model.layers[0].attn.project(torch.zeros(1, run.model.dim), torch.tensor([8]))
    with pytest.raises(ValueError, match="cannot take tokens up to 9"):
        caches[0].append(proj)


@pytest.mark.parametrize("level", [0, 8])
def test_a_prefix_installed_in_chunks_gives_the_oracles_bytes(monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    """Prefixes of several chunks (not page multiples), a shared one among them: the CP run agrees
    with the oracle, whose prefix runs in the same chunks, cache bytes included."""
    monkeypatch.setattr(prefix_prefill, "PREFIX_CHUNK_TOKENS", 48)
    rep = run_prefill(
        tiny(cp_size=2, phases=PhaseSet.level(level), page_size=16, requests=(Request(150, 40), Request(61, 20)))
    )
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True


def test_the_oracle_prefix_chunks_change_no_math() -> None:
    """The same prefix in one chunk and in four: the same function (fp32 on a CPU), to FP8 rounding."""
    run = RunConfig(preset="tiny", cp_size=1, requests=(Request(100, 20),), check=False, device="cpu")
    model = build_model(run, torch.device("cpu"))
    x = build_inputs(run, torch.device("cpu"))[0]
    layout = KVLayout.from_config(run.model, "fp8", 64)
    whole = prefill_prefix(model, x[:100], layout, lambda *a: None, chunk_tokens=100)
    chunked = prefill_prefix(model, x[:100], layout, lambda *a: None, chunk_tokens=25)
    for a, b in zip(whole, chunked):  # FP8 codes may flip where a sum rounds the other way
        va, vb = layout.dequantize_mla(a.mla_rows), layout.dequantize_mla(b.mla_rows)
        assert float((va - vb).norm() / va.norm()) < 2e-2


def test_the_install_holds_the_kv_and_one_chunk_not_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU allocations of installing a 256- and a 1024-token prefix in 64-token chunks: above the
    dense KV it keeps, the peak grows by less than one layer's dequantized view per token (f32 and
    bf16: ``kv_width x 6`` B). Computed at once, as the install did before, it grows over ten times
    faster (every layer's projections of every token)."""
    monkeypatch.setattr(sparse_attention, "TORCH_KEY_TILE", 128)  # the indexer's tile, flat in the prefix
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: a thread pool on a shared 2-core machine only adds waiting
    try:
        _measure_install_growth()
    finally:
        torch.set_num_threads(threads)


def _measure_install_growth() -> None:
    run = RunConfig(preset="tiny", cp_size=1, requests=(Request(1024, 16),), check=False, device="cpu")
    model = build_model(run, torch.device("cpu"))
    x_all = build_inputs(run, torch.device("cpu"))[0]
    layout = KVLayout.from_config(run.model, "fp8", 64)
    cfg = run.model
    store = torch.empty(1024, layout.mla_bytes, dtype=torch.uint8)  # the pool, allocated before

    def write(layer: int, start: int, stop: int, cache: object) -> None:
        store[start:stop].copy_(cache.mla_rows[start:stop])  # type: ignore[attr-defined]

    above_kv, at_once = {}, {}
    for n in (256, 1024):
        x = x_all[:n]
        kv = cfg.n_layers * n * (layout.mla_bytes + layout.index_bytes)
        above_kv[n] = cpu_peak_bytes(lambda x=x: prefill_prefix(model, x, layout, write, chunk_tokens=64)) - kv
        at_once[n] = cpu_peak_bytes(lambda x=x: run_oracle(model, [0], [x], "fp8", 64)) - kv
    growth = (above_kv[1024] - above_kv[256]) / 768
    assert growth < cfg.kv_width * 6, f"{growth:.0f} B per prefix token beyond the KV"
    assert (at_once[1024] - at_once[256]) / 768 > 10 * max(growth, cfg.kv_width), "the test can tell the two apart"
