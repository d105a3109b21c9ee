"""KV sharded at rest by an interleave: round-robin split with shared KV, and the interleave itself.

Round-robin computes the token at position ``t`` of every request on rank ``t % C``; at interleave 1
with ``C`` dividing the page size, that rank owns it, so every batch (every chunk) writes directly.
Elsewhere (``C`` not dividing the page size, or another interleave) the store takes the gathered
path, and the run agrees with the oracle all the same.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.ownership import Ownership, logical_page, page_owner, physical_page

# Prefixes that end mid-page (37, 5 with pages of 16), a current-only request, uneven extends.
MIXED = (Request(37, 70), Request(0, 45), Request(5, 9))
# Cumulative levels that apply to round-robin (phase 4, and so 5, are in-seq), then the phases on top.
ROUND_ROBIN_PHASES = ["0", "1", "2", "3", "+1,2,3,6", "+1,2,3,6,7", "+1,2,3,6,7,8"]


# ---- the ownership arithmetic ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.sampled_from([4, 16, 64]), st.integers(0, 6), st.integers(0, 40))
def test_ownership_is_compact_and_invertible(cp: int, page: int, log_interleave: int, n_pages: int) -> None:
    interleave = min(2**log_interleave, page)
    own = Ownership(cp, interleave, page)
    locs = torch.arange(n_pages * page)
    owner, physical = own.owner(locs), own.physical(locs)
    for rank in range(cp):
        mine = owner == rank
        # Compact: the rank's slots fill physical locs 0..n-1 in logical order, and come back.
        assert torch.equal(physical[mine], torch.arange(int(mine.sum())))
        assert torch.equal(own.logical(physical[mine], rank), locs[mine])
        assert own.pages_held(n_pages, rank) == -(-int(mine.sum()) // page)


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
def test_the_page_interleave_is_phase_2s_page_ownership(cp: int) -> None:
    own = Ownership(cp, 16, 16)
    pages = torch.arange(50)
    locs = pages * 16 + 5
    assert own.by_page and torch.equal(own.owner(locs), page_owner(pages, cp))
    assert torch.equal(own.physical(locs), physical_page(pages, cp) * 16 + 5)
    assert torch.equal(
        own.logical(physical_page(pages, cp) * 16, 0)[pages % cp == 0],
        logical_page(pages[pages % cp == 0] // cp, 0, cp) * 16,
    )


def test_interleave_one_follows_positions_when_c_divides_the_page() -> None:
    assert Ownership(4, 1, 16).follows_positions and Ownership(8, 1, 64).follows_positions
    assert not Ownership(3, 1, 16).follows_positions and not Ownership(2, 16, 16).follows_positions
    own = Ownership(4, 1, 16)
    request_start = 7 * 16  # requests start on a page boundary
    positions = torch.arange(100)
    assert torch.equal(own.owner(request_start + positions), positions % 4)


@pytest.mark.parametrize(
    ("interleave", "page", "words"),
    [(3, 16, "power of two"), (32, 16, "divides the page size 16"), (0, 16, "power of two")],
)
def test_an_interleave_the_page_cannot_hold_is_refused(interleave: int, page: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Ownership(2, interleave, page)


def test_config_rules() -> None:
    assert RunConfig(split_mode="round-robin", phases=PhaseSet.level(2)).interleave == 1
    assert RunConfig(phases=PhaseSet.level(2), page_size=16).interleave == 16
    with pytest.raises(ConfigError, match="needs phase 2"):
        RunConfig(kv_interleave=4)
    with pytest.raises(ConfigError, match="phase 5"):
        RunConfig(phases=PhaseSet.level(5), kv_interleave=4)
    with pytest.raises(ConfigError, match="round-robin split cannot run phase 4"):
        RunConfig(split_mode="round-robin", phases=PhaseSet.level(4))


# ---- runs against the oracle ------------------------------------------------------------------


@pytest.mark.parametrize("phases", ROUND_ROBIN_PHASES)
@pytest.mark.parametrize("cp_size", [2, 4])
def test_round_robin_with_shared_kv_matches_the_oracle_and_writes_directly(
    report_of, phases: str, cp_size: int
) -> None:
    run = tiny(cp_size=cp_size, split_mode="round-robin", requests=MIXED, page_size=16, phases=PhaseSet.parse(phases))
    rep = report_of(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    sharded = run.phases.sharded_kv
    assert rep["store_path"] == ("direct" if sharded else "replicated") and rep["store_path_identical"]
    if sharded:
        # At most ceil(tokens / C) + one page per request, per layer, on every rank.
        tokens = sum(r.total for r in MIXED)
        bound_rows = -(-tokens // cp_size) + 16 * len(MIXED)
        mla_row, index_row = 260, 132  # tiny fp8 rows
        for entry in rep["per_rank"]:
            assert entry["kv_bytes"] <= run.model.n_layers * bound_rows * mla_row
            assert entry["index_bytes"] <= run.model.n_layers * bound_rows * index_row


@pytest.mark.parametrize("phases", ["3", "+1,2,3,6,7,8"])
def test_round_robin_chunked_prefill_writes_every_chunk_directly(report_of, phases: str) -> None:
    rep = report_of(
        tiny(
            cp_size=4,
            split_mode="round-robin",
            requests=MIXED,
            page_size=16,
            chunk_size=20,
            phases=PhaseSet.parse(phases),
        )
    )
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["store_path"] == "direct"  # "direct+gathered" if any chunk had taken the other path


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_when_c_does_not_divide_the_page_the_store_gathers(report_of, kv_dtype: str) -> None:
    rep = report_of(
        tiny(
            cp_size=3,
            split_mode="round-robin",
            requests=MIXED,
            page_size=16,
            kv_dtype=kv_dtype,
            phases=PhaseSet.parse("+1,2,3,6,7,8"),
        )
    )
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True and rep["store_path"] == "gathered"


@pytest.mark.parametrize(
    ("split_mode", "interleave"), [("round-robin", 4), ("round-robin", 16), ("in-seq", 1), ("in-seq", 4)]
)
def test_any_interleave_matches_the_oracle(report_of, split_mode: str, interleave: int) -> None:
    rep = report_of(
        tiny(
            cp_size=2,
            split_mode=split_mode,
            requests=MIXED,
            page_size=16,
            kv_interleave=interleave,
            phases=PhaseSet.parse("+1,2,3,6,7,8"),
            chunk_size=30,
        )
    )
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["config"]["kv_interleave"] == interleave
    assert rep["store_path"] == "gathered"  # the computing rank is not the owner


def test_round_robin_phase_6_has_no_host_sync_in_the_layer_loop(report_of) -> None:
    rep = report_of(
        tiny(cp_size=2, split_mode="round-robin", requests=MIXED, page_size=16, phases=PhaseSet.parse("+1,2,3,6,7,8"))
    )
    assert rep["matches_oracle"] is True
    assert all(entry["host_syncs_in_layer_loop"] == 0 for entry in rep["per_rank"])
