"""Phase 5: compute-owner allocation and direct writes, with the phase-2 store path as fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError, PhaseSet, Request
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.compute_owner import direct_write_ok
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.split import build_split
from reference_impl.kvcache.allocator import PageAllocator


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_direct_write_matches_oracle(report_of, cp_size: int) -> None:
    rep = report_of(
        tiny(cp_size=cp_size, requests=(Request(16, 150), Request(0, 130)), page_size=8, phases=PhaseSet.level(5))
    )
    assert rep["store_path"] == "direct"
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


def test_partial_prefix_page_owned_elsewhere_takes_phase2_store_path(report_of) -> None:
    rep = report_of(
        tiny(cp_size=3, requests=(Request(13, 150), Request(40, 130)), page_size=8, phases=PhaseSet.level(5))
    )
    assert rep["store_path"] == "gathered"  # the prefix's partial page is owned by a rank that does not compute it
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


def test_short_request_is_not_page_aligned_so_no_direct_write(report_of) -> None:
    rep = report_of(tiny(cp_size=2, requests=(Request(0, 150), Request(0, 20)), page_size=8, phases=PhaseSet.level(5)))
    assert rep["store_path"] == "gathered" and rep["matches_oracle"] is True


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5).map(lambda k: 8 * k), st.integers(64, 200)), min_size=1, max_size=3),
    st.integers(1, 4),
)
def test_current_pages_get_their_compute_rank_as_owner(reqs, cp_size) -> None:
    meta = build_split("in-seq", cp_size, [e for _, e in reqs], [p for p, _ in reqs], 8, page_aligned=True)
    batch = BatchLocs.build(meta, compute_owner=True)
    by_page = Ownership(meta.cp_size, meta.page_size, meta.page_size)
    assert meta.page_aligned and direct_write_ok(meta, batch.extend_locs, by_page)  # page-multiple prefixes: always
    for rank, tokens in enumerate(meta.rank_tokens):
        pages = batch.extend_locs[list(tokens)] // 8
        assert bool((pages % cp_size == rank).all())
    assert len(set(torch.cat(batch.request_locs).tolist())) == batch.view_len  # no loc handed out twice


def test_lane_exhaustion_is_a_clear_error_and_frees_nothing_wrong() -> None:
    alloc = PageAllocator(8, 4)
    assert alloc.alloc_in_lane(2, 1, 4) == [1, 5]
    with pytest.raises(ConfigError, match="out of KV pages in lane 1 of 4.*fragmented across lanes.*without phase 5"):
        alloc.alloc_in_lane(1, 1, 4)
    assert alloc.lane_free_counts(4) == [2, 0, 2, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 30)), min_size=1, max_size=40), st.integers(1, 4))
def test_lane_allocation_across_chunks_and_frees_never_gives_a_wrong_owner(ops, n_lanes) -> None:
    """Chunked extends in owner lanes, interleaved with request frees: every page a request holds
    sits in the lane it was asked for, freed pages are reused, and the per-lane free counts (the
    fragmentation report) always add up. An extend a lane cannot satisfy is an error that changes nothing."""
    from reference_impl.kvcache.allocator import RequestPageTable

    table = RequestPageTable(PageAllocator(24, 4))
    alloc, wanted_lane = table.allocator, {}
    for req, n in ops:
        if n < 0:
            if req in table:
                table.free(req)
            continue
        have = table.n_tokens(req) if req in table else 0
        new_pages = -(-(have + n) // 4) - (len(table.pages(req)) if req in table else 0)
        lanes = [(req + i) % n_lanes for i in range(max(new_pages, 0))]
        before = (alloc.n_free, alloc.lane_free_counts(n_lanes))
        try:
            table.extend(req, n, lanes, n_lanes)
        except ConfigError as err:
            assert "out of KV pages in lane" in str(err)
            assert (alloc.n_free, alloc.lane_free_counts(n_lanes)) == before
            continue
        for page, lane in zip(table.pages(req)[-len(lanes) :] if lanes else [], lanes):
            wanted_lane[page] = lane
        for r in range(6):
            if r in table:
                assert all(page % n_lanes == wanted_lane[page] for page in table.pages(r))
        assert sum(alloc.lane_free_counts(n_lanes)) == alloc.n_free


def test_compute_owner_pools_stay_within_the_sharded_bound(report_of) -> None:
    """Lane allocation may leave holes, but no rank holds more than ceil(pages / C) + 1 per request."""
    requests = (Request(16, 150), Request(0, 130))
    run = tiny(cp_size=3, requests=requests, page_size=8, phases=PhaseSet.level(5))
    rep = report_of(run)
    bound_pages = sum(-(-((r.total + 7) // 8) // 3) + 1 for r in requests)  # ceil(ceil(total / 8) / 3) + 1
    for entry in rep["per_rank"]:
        assert entry["kv_bytes"] <= run.model.n_layers * bound_pages * 8 * 260


def test_round_robin_refuses_page_aligned_split() -> None:
    from reference_impl.config import RunConfig

    with pytest.raises(ConfigError, match="round-robin split cannot run phase 4"):
        RunConfig(split_mode="round-robin", phases=PhaseSet(frozenset({4})))
