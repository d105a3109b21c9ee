"""Phase 7 in the engine: the fused store / rerange / materialize ops agree with the oracle, both
through their torch paths (CPU default) and through the Triton kernels (forced, under the interpreter)."""

from __future__ import annotations

import os

import pytest

from conftest import tiny
from reference_impl.config import PhaseSet, Request
from reference_impl.kernels import cp_dispatch
from reference_impl.runner import run_prefill

MIXED = (Request(16, 150), Request(13, 130))


@pytest.mark.parametrize("phases", [PhaseSet.level(7), PhaseSet(frozenset({7}))], ids=["level7", "phase7-alone"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_phase7_torch_paths_match_oracle(report_of, phases: PhaseSet, kv_dtype: str) -> None:
    rep = report_of(tiny(cp_size=3, requests=MIXED, page_size=8, kv_dtype=kv_dtype, phases=phases))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize(("kv_dtype", "cp_size"), [("fp8", 1), ("bf16", 1), ("fp8", 2)])
def test_phase7_triton_kernels_match_oracle(monkeypatch, kv_dtype: str, cp_size: int) -> None:
    """Force the Triton kernels on CPU tensors (interpreter); forked ranks inherit the patch."""
    calls = []
    original = cp_dispatch._run_triton

    def spy(kernel, fn):
        calls.append(kernel)
        return original(kernel, fn)

    monkeypatch.setattr(cp_dispatch, "_fused", lambda tensor, debug, force_torch: not force_torch and not debug)
    monkeypatch.setattr(cp_dispatch, "_run_triton", spy)
    run = tiny(cp_size=cp_size, requests=(Request(16, 90), Request(5, 40)), page_size=8, kv_dtype=kv_dtype,
               phases=PhaseSet.level(7))
    rep = run_prefill(run)
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    if cp_size == 1:  # the ranks' calls happen in this process only without forking
        assert {"fused_store_index", "rerange_padded", "materialize_rows"} <= set(calls)
        assert "fused_store_mla" in calls


def test_phase7_debug_takes_torch_paths_and_audits_clean(report_of) -> None:
    rep = report_of(tiny(cp_size=2, requests=MIXED, page_size=8, debug=True, phases=PhaseSet.level(7)))
    assert rep["matches_oracle"] is True and rep["per_rank"][0]["host_syncs_in_layer_loop"] == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_phase8_prefetch_through_the_mla_kernel_matches_oracle(monkeypatch) -> None:
    """Level 8 with the kernels forced: the prefetch writes history through the MLA-only materialize."""
    calls = []
    original = cp_dispatch._run_triton

    def spy(kernel, fn):
        calls.append(kernel)
        return original(kernel, fn)

    monkeypatch.setattr(cp_dispatch, "_fused", lambda tensor, debug, force_torch: not force_torch and not debug)
    monkeypatch.setattr(cp_dispatch, "_run_triton", spy)
    rep = run_prefill(tiny(cp_size=1, requests=MIXED, page_size=8, n_layers=3, phases=PhaseSet.level(8)))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert "materialize_mla_rows" in calls and "materialize_rows" not in calls
