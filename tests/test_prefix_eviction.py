"""A budgeted long-lived pool (``pool_pages``): finished requests stay cached for later prefix hits and are
evicted least recently used first when a batch needs their pages; a request whose prefix was evicted writes
it again and still matches the oracle.

The hand-computed scenario (pages of 16 tokens, a budget of 8 pages):

* batch 0: r0 = 0+64 takes pages 0-3; cached after it.
* batch 1: r1 = 0+64 takes pages 4-7 (the pool is full); cached.
* batch 2: r2 = r0:32+16 makes r0 most recently used, hits its two whole pages (32 tokens by reference) and
  needs one page: none is free, so r1 (least recently used) is evicted, its 4 pages go back. r3 = 0+32 takes
  two of them.
* batch 3: r4 = r1:48+16 misses (r1 was evicted): it writes its 48 prefix tokens again. Its prefix needs 3
  pages, 1 is free: r0 is evicted (2 pages back: the other 2 are r2's too); its extend needs 1 more: r2 is
  evicted (its 3 pages back, the 2 it shared with r0 among them).

So: 1 hit of 32 tokens, 1 miss recomputing 48 tokens, 3 requests and 4 + 2 + 3 = 9 pages evicted.
"""

from __future__ import annotations

import pytest
from conftest import tiny

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, RunConfig, parse_batches
from reference_impl.engine import replay_pool
from reference_impl.kvcache.allocator import PageAllocator, PrefixCache, RequestPageTable

SPEC = "0+64;0+64;r0:32+16,0+32;r1:48+16"
REQUESTS, SIZES = parse_batches(SPEC)
PAGE = 16
BUDGET = 8
EXPECTED = {
    "pool_pages": BUDGET,
    "hits": 1,
    "hit_tokens": 32,
    "misses": 1,
    "recomputed_tokens": 48,
    "evicted_requests": 3,
    "evicted_pages": 9,
}


def budget_run(**changes) -> RunConfig:  # noqa: ANN003
    return tiny(
        **{"requests": tuple(REQUESTS), "batch_sizes": SIZES, "page_size": PAGE, "pool_pages": BUDGET, **changes}
    )


def test_the_hand_computed_counts_and_pages() -> None:
    pool = replay_pool(budget_run())
    assert pool.counts == EXPECTED
    table = pool.table
    assert table.requests == [3, 4] and pool.cache is not None and pool.cache.cached == [3]
    assert table.pages(3) == [5, 6]  # two of r1's evicted pages
    assert table.pages(4) == [2, 3, 7, 0]  # r0's evicted pages, the last free one, then r2's
    assert table.allocator.high_water == BUDGET  # the pools are built for the budget, no more


def test_without_a_budget_nothing_is_cached_or_counted() -> None:
    pool = replay_pool(budget_run(pool_pages=None))
    assert pool.counts is None and pool.cache is None
    assert pool.table.shared_tokens(4) == 48  # r1 was kept for r4: a hit by reference


@pytest.mark.parametrize(
    "changes",
    [
        {"cp_size": 2, "phases": PhaseSet.level(0)},
        {"cp_size": 2, "phases": PhaseSet.level(2)},
        {"cp_size": 3, "phases": PhaseSet.level(4)},
        {"cp_size": 3, "phases": PhaseSet.level(3), "chunk_size": 24},
    ],
    ids=["c2-level0", "c2-level2", "c3-level4", "c3-level3-chunked"],
)
def test_an_evicted_prefix_is_recomputed_and_matches_the_oracle(report_of, changes: dict) -> None:
    rep = report_of(budget_run(**changes))
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    counts = rep["prefix_cache"]
    assert counts == EXPECTED  # the lowest-free allocator, chunked or not: the hand-computed counts
    occupancy = rep["pool_occupancy"]
    assert [o["requests_freed"] for o in occupancy] == [0, 0, 0, 0]
    assert all(o["pages_in_use"] <= counts["pool_pages"] for o in occupancy)
    assert max(o["pool_pages"] for o in occupancy) <= counts["pool_pages"]


def test_phase_5_lanes_evict_within_the_budget_and_its_slack(report_of) -> None:
    """Phase 5 takes pages in compute-owner lanes; the budget must hold a batch's pages plus the lane slack
    (2 per rank per request, plus 2 per rank: 18 at C = 3 and two requests)."""
    requests, sizes = parse_batches("0+256;0+256;r0:128+32,0+64;r1:192+32")
    run = tiny(
        requests=tuple(requests),
        batch_sizes=sizes,
        page_size=PAGE,
        cp_size=3,
        phases=PhaseSet.level(8),
        chunk_size=100,
        pool_pages=10 + 4 + 18,
    )
    rep = report_of(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    counts = rep["prefix_cache"]
    assert counts == replay_pool(run).counts  # the ranks evicted as the metadata replay says
    # r1's 16 pages in their lanes do not fit beside r0's: r0 goes already in batch 1, so r2 misses it;
    # r1 is still cached for r4.
    assert counts["misses"] == 1 and counts["recomputed_tokens"] == 128
    assert counts["hits"] == 1 and counts["hit_tokens"] == 192 and counts["evicted_pages"] > 0


def test_a_budget_with_room_for_everything_hits_and_evicts_nothing(report_of) -> None:
    rep = report_of(budget_run(pool_pages=64))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["prefix_cache"] | {"pool_pages": 0} == {
        "pool_pages": 0,
        "hits": 2,
        "hit_tokens": 32 + 48,
        "misses": 0,
        "recomputed_tokens": 0,
        "evicted_requests": 0,
        "evicted_pages": 0,
    }


def _stale_evict(self: PrefixCache) -> bool:
    """An eviction that forgets to drop the share: the pages go back to the allocator, but the table still
    lists the request, so a later ``rN:P+E`` hits page ids that now hold another request's KV."""
    if not self._lru:
        return False
    req, _ = self._lru.popitem(last=False)
    pages = self.table.pages(req)
    self.table.allocator.free([p for p in pages if self.table._holders.get(p) == 1])
    self.evicted_requests += 1
    return True


def test_a_prefix_served_stale_after_its_eviction_fails_the_check(forked_ranks) -> None:
    from reference_impl.runner import run_prefill

    forked_ranks.setattr(PrefixCache, "evict", _stale_evict)
    rep = run_prefill(budget_run(), timeout_s=120)
    assert rep["prefix_cache"]["misses"] == 0 and rep["prefix_cache"]["hits"] == 2  # r4 believed it hit r1
    # r1's pages went to r2 and r3 in batch 2: r4 attends over their KV, and its cache is not the oracle's.
    assert rep["matches_oracle"] is False and rep["cache_equal"] is False


def test_the_cache_evicts_least_recently_used_and_keeps_shared_pages() -> None:
    table = RequestPageTable(PageAllocator(6, 4))
    cache = PrefixCache(table)
    table.extend("a", 8)  # pages 0, 1
    table.extend("b", 8)  # pages 2, 3
    cache.hold("a")
    cache.hold("b")
    assert cache.touch("a") and cache.cached == ["b", "a"]
    assert table.share("c", "a", 8) == 8  # a's pages by reference
    table.extend("d", 12)  # 3 pages, 2 free: b (least recently used) goes
    assert cache.cached == ["a"] and "b" not in table and cache.evicted_pages == 2
    assert table.pages("d") == [2, 3, 4]
    with pytest.raises(ConfigError, match="out of KV pages"):  # 2 pages, 1 free: a goes, its pages stay with c
        table.extend("e", 8)
    assert cache.cached == [] and cache.evicted_requests == 2 and cache.evicted_pages == 2
    assert table.pages("c") == [0, 1] and table.allocator.n_free == 1 and "e" not in table
    assert not cache.touch("b")


def test_a_budget_too_small_for_one_batch_is_refused_by_name(capsys) -> None:
    with pytest.raises(ConfigError, match=r"pool_pages=4 is too small for one batch: batch 2's .* need 5 pages"):
        budget_run(pool_pages=4)
    with pytest.raises(ConfigError, match="pool_pages=0"):
        budget_run(pool_pages=0)
    assert main(["run", "--page-size", "16", "--batches", SPEC, "--pool-pages", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --pool-pages=4 is too small") and err.count("\n") == 1
    assert main(["run", "--pool-pages", "x"]) == 2
    assert "--pool-pages" in capsys.readouterr().err


def test_the_environment_variable_sets_the_budget(monkeypatch, capsys) -> None:
    monkeypatch.setenv("DSACP_POOL_PAGES", "3")
    assert main(["run", "--page-size", "16", "--batches", SPEC]) == 2
    assert capsys.readouterr().err.startswith("error: DSACP_POOL_PAGES=3 is too small")


def test_the_pd_transfer_refuses_the_budget() -> None:
    from reference_impl.prefill_decode import run_prefill_and_decode

    with pytest.raises(ConfigError, match="pool_pages=8: the PD transfer"):
        run_prefill_and_decode(budget_run(phases=PhaseSet.level(2)), transfer="rows")
