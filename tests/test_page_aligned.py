"""Phase 4: page-aligned in-seq split."""

from __future__ import annotations

import pytest
from conftest import tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import PhaseSet, Request
from reference_impl.cp.page_aligned import page_aligned_block_sizes, page_units
from reference_impl.cp.split import build_split


def test_units_follow_absolute_page_boundaries() -> None:
    assert page_units(13, 100, 16) == [3, 16, 16, 16, 16, 16, 16, 1]
    assert page_units(0, 32, 16) == [16, 16]
    assert page_units(16, 5, 16) == [5]


def test_short_request_keeps_token_balanced_blocks() -> None:
    assert page_aligned_block_sizes(0, 30, 2, 16) is None  # 2 units < 2C = 4
    meta = build_split("in-seq", 2, [100, 30], [13, 0], 16, page_aligned=True)
    assert not meta.page_aligned
    assert meta.block_sizes[1] == (8, 8, 7, 7)


requests = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 200)), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(1, 4), st.sampled_from([4, 8, 16]))
def test_split_covers_every_token_once_and_aligned_pages_have_one_owner(reqs, cp_size, page_size) -> None:
    prefix, extend = [p for p, _ in reqs], [e for _, e in reqs]
    if max(extend) < cp_size:
        return
    try:
        meta = build_split("in-seq", cp_size, extend, prefix, page_size, page_aligned=True)
    except Exception as exc:  # a rank left without tokens is refused, with a message
        assert "without tokens" in str(exc)
        return
    everything = sorted(g for tokens in meta.rank_tokens for g in tokens)
    assert everything == list(range(sum(extend)))
    owners: dict[tuple[int, int], set[int]] = {}
    for rank, tokens in enumerate(meta.rank_tokens):
        for g in tokens:
            owners.setdefault((meta.token_request[g], meta.token_position[g] // page_size), set()).add(rank)
    aligned_requests = [
        i for i in range(len(reqs)) if page_aligned_block_sizes(prefix[i], extend[i], cp_size, page_size) is not None
    ]
    for (req, _page), ranks in owners.items():
        if req in aligned_requests:
            assert len(ranks) == 1
    assert meta.page_aligned == (len(aligned_requests) == len(reqs))


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_engine_with_page_aligned_split_matches_oracle(report_of, cp_size: int) -> None:
    run = tiny(cp_size=cp_size, requests=(Request(13, 150), Request(40, 130)), page_size=8, phases=PhaseSet.level(4))
    rep = report_of(run)
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True


def test_phase4_alone_without_sharding(report_of) -> None:
    rep = report_of(tiny(cp_size=3, requests=(Request(5, 120),), page_size=8, phases=PhaseSet(frozenset({4}))))
    assert rep["matches_oracle"] is True


def test_aligned_segments_have_unequal_lengths() -> None:
    meta = build_split("in-seq", 2, [100], [13], 16, page_aligned=True)
    prev, nxt = meta.segments[0]
    assert prev.length != nxt.length  # consumers must not split local queries by halves
