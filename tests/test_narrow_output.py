"""Phase 1: narrow output collection agrees with the full gather and the oracle, and falls back."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.config import PhaseSet, Request
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.narrow_output import collect_narrow, narrow_eligible, rows_per_rank, tail_gather_bytes
from reference_impl.cp.split import build_split
from reference_impl.cp.tail import OutputSpec, collect_full
from reference_impl.engine import run_rank
from reference_impl.launch import launch

REQUESTS = (Request(0, 96), Request(40, 70), Request(13, 37))


def test_eligibility_is_batch_level() -> None:
    assert narrow_eligible(OutputSpec())
    assert narrow_eligible(OutputSpec(extra_rows=(3, 5)))
    assert not narrow_eligible(OutputSpec(input_logprobs=True))
    assert not narrow_eligible(OutputSpec(return_hidden_states=True))


def test_in_seq_last_tokens_live_on_rank_0() -> None:
    meta = build_split("in-seq", 4, [96, 70, 37], [0, 40, 13])
    per_rank = rows_per_rank(meta, OutputSpec().rows(meta))
    assert len(per_rank[0]) == 3 and all(not sel for sel in per_rank[1:])


def _both_paths(group: CPGroup, spec: OutputSpec) -> tuple:
    meta = build_split("in-seq", group.size, [96, 70, 37], [0, 40, 13])
    torch.manual_seed(0)  # same values on every rank; each rank takes its own tokens
    full = torch.randn(meta.total_tokens, 8)
    local = full[list(meta.local_tokens(group.rank))]
    narrow = collect_narrow(group, meta, local, spec)
    wide = collect_full(group, meta, local, spec)
    return narrow.mode, narrow.row_ids, narrow.rows, wide.rows, full[list(narrow.row_ids)]


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("extra", [(), (5, 100, 7)])
def test_narrow_rows_equal_full_rows(cp_size: int, extra: tuple) -> None:
    for mode, _ids, narrow, wide, expected in launch(_both_paths, cp_size, OutputSpec(extra_rows=extra)):
        assert mode == "narrow"
        assert torch.equal(narrow, wide) and torch.equal(narrow, expected)


def test_narrow_matches_full_and_oracle(report_of) -> None:
    narrow = report_of(tiny(cp_size=4, phases=PhaseSet.level(1), requests=REQUESTS))
    full = report_of(tiny(cp_size=4, phases=PhaseSet.level(0), requests=REQUESTS))
    assert narrow["tail_mode"] == "narrow" and full["tail_mode"] == "full"
    assert narrow["matches_oracle"] is True and full["matches_oracle"] is True
    assert narrow["logits_max_abs_err"] <= 1e-3


def test_narrow_bytes_n_req_rows(report_of) -> None:
    run = tiny(cp_size=4, phases=PhaseSet.level(1), requests=REQUESTS)
    rep = report_of(run)
    row_bytes = run.model.dim * 4  # fp32 hidden on CPU
    for entry in rep["per_rank"]:
        # padded all-gather of n_req rows from each of C ranks
        assert entry["output_gather_bytes"] == 4 * len(REQUESTS) * row_bytes
    full = report_of(tiny(cp_size=4, phases=PhaseSet.level(0), requests=REQUESTS))
    max_len = max(p["tokens"] for p in full["per_rank"])
    assert full["per_rank"][0]["output_gather_bytes"] == 4 * max_len * row_bytes
    meta = build_split("in-seq", 4, [r.extend for r in REQUESTS], [r.prefix for r in REQUESTS])
    assert tail_gather_bytes(meta, row_bytes, OutputSpec(), narrow=True) == rep["per_rank"][0]["output_gather_bytes"]
    assert tail_gather_bytes(meta, row_bytes, OutputSpec(), narrow=False) == full["per_rank"][0]["output_gather_bytes"]


@pytest.mark.parametrize("flag", ["input_logprobs", "return_hidden_states"])
def test_fallback_to_full_gather(report_of, flag: str) -> None:
    rep = report_of(tiny(cp_size=3, phases=PhaseSet.level(1), requests=REQUESTS, **{flag: True}))
    assert rep["tail_mode"] == "full"
    assert rep["matches_oracle"] is True


def _collectives(group: CPGroup, run) -> list[str]:
    return run_rank(group, run).collectives


@pytest.mark.parametrize("flag", [None, "input_logprobs"])
def test_collective_sequence_identical(flag: str | None) -> None:
    run = tiny(cp_size=3, phases=PhaseSet.level(1), requests=REQUESTS, check=False)
    if flag:
        run = run.replace(**{flag: True})
    sequences = launch(_collectives, 3, run, debug=True)
    assert len({tuple(s) for s in sequences}) == 1
    assert sequences[0][-1].startswith("all_gather:tail")
