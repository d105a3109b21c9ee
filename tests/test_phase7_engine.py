"""Phase 7 in the engine: the fused store / rerange / materialize ops agree with the oracle, both
through their torch paths (CPU default) and through the Triton kernels (forced, under the interpreter)."""

from __future__ import annotations

import pytest
from conftest import tiny

from reference_impl.config import PhaseSet, Request
from reference_impl.cp import fused_ops
from reference_impl.kernels import fallback
from reference_impl.runner import run_prefill

MIXED = (Request(16, 150), Request(13, 130))


@pytest.mark.parametrize("phases", [PhaseSet.level(7), PhaseSet(frozenset({7}))], ids=["level7", "phase7-alone"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_phase7_torch_paths_match_oracle(report_of, phases: PhaseSet, kv_dtype: str) -> None:
    rep = report_of(tiny(cp_size=3, requests=MIXED, page_size=8, kv_dtype=kv_dtype, phases=phases))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


def _force_kernels_and_spy(monkeypatch) -> list[str]:
    """Run the (interpreted) Triton kernels on CPU tensors, recording each kernel the ops launch;
    forked ranks inherit the patches."""
    calls: list[str] = []
    original = fallback.run_with_fallback

    def spy(kernel, fast, slow, **kw):
        calls.append(kernel.removeprefix("Triton "))
        return original(kernel, fast, slow, **kw)

    monkeypatch.setattr(fused_ops, "_use_kernels", lambda device, debug, force_torch: not (debug or force_torch))
    monkeypatch.setattr(fallback, "run_with_fallback", spy)
    return calls


@pytest.mark.parametrize(("kv_dtype", "cp_size"), [("fp8", 1), ("bf16", 1), ("fp8", 2)])
def test_phase7_triton_kernels_match_oracle(forked_ranks, kv_dtype: str, cp_size: int) -> None:
    """Force the Triton kernels on CPU tensors (interpreter); forked ranks inherit the patch."""
    calls = _force_kernels_and_spy(forked_ranks)
    run = tiny(
        cp_size=cp_size,
        requests=(Request(16, 90), Request(5, 40)),
        page_size=8,
        kv_dtype=kv_dtype,
        phases=PhaseSet.level(7),
    )
    rep = run_prefill(run)
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    if cp_size == 1:  # the ranks' calls happen in this process only without forking
        assert {"fused_store_index", "rerange_padded", "materialize_rows", "fill_current"} <= set(calls)
        assert "fused_store_mla" in calls


def test_phase7_debug_takes_torch_paths_and_audits_clean(report_of) -> None:
    rep = report_of(tiny(cp_size=2, requests=MIXED, page_size=8, debug=True, phases=PhaseSet.level(7)))
    assert rep["matches_oracle"] is True and rep["per_rank"][0]["host_syncs_in_layer_loop"] == 0


def test_phase8_prefetch_through_the_mla_kernel_matches_oracle(monkeypatch) -> None:
    """Level 8 with the kernels forced: the prefetch writes history through the MLA-only materialize."""
    calls = _force_kernels_and_spy(monkeypatch)
    rep = run_prefill(tiny(cp_size=1, requests=MIXED, page_size=8, n_layers=3, phases=PhaseSet.level(8)))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert "materialize_mla_rows" in calls and "materialize_rows" not in calls and "fill_current" in calls


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_the_triton_kernels_on_round_robin_shards(forked_ranks, kv_dtype: str) -> None:
    """Round-robin at interleave 1 with the kernels forced (interpreter): the fused store writes each
    rank's own rows at scattered physical locs, the materialize and the prefetch read physical pages
    that pack several logical pages."""
    _force_kernels_and_spy(forked_ranks)
    run = tiny(
        cp_size=2,
        split_mode="round-robin",
        requests=(Request(13, 40), Request(5, 21)),
        page_size=8,
        kv_dtype=kv_dtype,
        phases=PhaseSet.parse("+1,2,3,6,7,8"),
        n_layers=2,
    )
    rep = run_prefill(run)
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True and rep["store_path"] == "direct"
