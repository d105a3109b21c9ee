"""Chunked prefill: consecutive CP batches whose later chunks read history the ranks stored."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.config import ConfigError, PhaseSet, Request
from reference_impl.model.oracle import run_oracle
from reference_impl.runner import run_prefill
from reference_impl.schedule import chunk_schedule
from reference_impl.workload import build_inputs, build_model

UNEVEN = (Request(16, 150), Request(8, 100), Request(0, 70))


def test_schedule_covers_every_token_once_in_order() -> None:
    chunks = chunk_schedule(tiny(requests=UNEVEN, chunk_size=64))
    assert [c.extend_lens for c in chunks] == [(64, 64, 64), (64, 36, 6), (22,)]
    assert [c.prefix_lens for c in chunks] == [(16, 8, 0), (80, 72, 64), (144,)]
    ids = [g for c in chunks for g in c.token_ids]
    assert sorted(ids) == list(range(320)) and len(ids) == 320


@pytest.mark.parametrize("level", [0, 3, 5])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_chunked_runs_match_the_oracle(report_of, level: int, cp_size: int) -> None:
    rep = report_of(tiny(cp_size=cp_size, requests=UNEVEN, page_size=8, chunk_size=64, phases=PhaseSet.level(level)))
    assert rep["config"]["chunks"] == 3
    assert rep["problems"] == [] and rep["matches_oracle"] is True
    assert rep["cache_equal"] is True and rep["collectives_identical"] is True


def test_chunked_bf16_cache(report_of) -> None:
    rep = report_of(
        tiny(cp_size=2, kv_dtype="bf16", requests=UNEVEN, page_size=16, chunk_size=80, phases=PhaseSet.level(5))
    )
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


def test_later_chunks_write_directly_when_aligned(report_of) -> None:
    """Page-multiple chunk and prefix sizes keep every chunk page-aligned: direct writes throughout."""
    rep = report_of(
        tiny(
            cp_size=2, requests=(Request(16, 128), Request(0, 96)), page_size=8, chunk_size=64, phases=PhaseSet.level(5)
        )
    )
    assert rep["store_path"] == "direct" and rep["matches_oracle"] is True


def test_chunked_oracle_agrees_with_one_pass_oracle() -> None:
    run = tiny(requests=UNEVEN, page_size=8)
    model, inputs = build_model(run, torch.device("cpu")), build_inputs(run, torch.device("cpu"))
    prefixes = [r.prefix for r in UNEVEN]
    one = run_oracle(model, prefixes, inputs, "fp8", 8)
    chunked = run_oracle(model, prefixes, inputs, "fp8", 8, chunk_size=48)
    for a, b in zip(one.hidden, chunked.hidden):
        assert (a - b).abs().max() < 1e-3 * max(1.0, a.abs().max().item())


def test_chunk_too_small_for_cp_is_refused() -> None:
    with pytest.raises(ConfigError, match="larger than the tokens allow"):
        run_prefill(tiny(cp_size=4, requests=(Request(0, 66),), chunk_size=64))  # last chunk: 2 tokens
