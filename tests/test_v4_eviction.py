"""DeepSeek-V4 on a budgeted long-lived pool (``pool_pages``): the store drops a cached request's whole state
(entries, indexer keys, window tail, compressor state, checkpoints) when the page table evicts it, a hit is
served only while its source is cached, and a request whose source was evicted recomputes its whole prefix
(the rules: :mod:`reference_impl.families.deepseek_v4.cp.store` and :mod:`reference_impl.pool_timeline`).

The hand-computed scenario (``tiny-v4``, pages of 32 tokens, a budget of 10 pages):

* batch 0: r0 = 0+160 takes pages 0-4; cached after it.
* batch 1: r1 = 0+160 takes pages 5-9 (the pool is full); cached.
* batch 2: r2 = r0:131+16 makes r0 most recently used, hits its four whole pages (128 tokens by reference;
  ``131 mod 4, mod 8, mod 128 = 3, 3, 3``: an HCA entry complete, CSA carrying 3 + 4 rows) and needs one page:
  none is free, so r1 is evicted (5 pages back); r3 = 0+64 takes two of them.
* batch 3: r4 = r1:133+20 misses (r1 was evicted): it recomputes its 133 prefix tokens. It needs 5 pages, 2
  are free: r0 goes (1 page back, the other 4 are r2's too), then r2 (its 5 pages back).

So: 1 hit of 128 tokens, 1 miss recomputing 128 (the whole pages it would have shared), 3 requests and
5 + 1 + 5 = 11 pages evicted.
"""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet, RunConfig, parse_batches
from reference_impl.engine import replay_pool
from reference_impl.errors import RankFailedError
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.cp.store import V4Store
from reference_impl.kvcache.allocator import PrefixCache
from reference_impl.pool_timeline import pool_timeline
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefill

CFG = get_preset("tiny-v4")
CODEC = RunConfig(preset="tiny-v4").kv_dtype
CSA_ENTRY = main_entry_bytes(CODEC) + index_entry_bytes(CODEC, CFG.index_head_dim)
HCA_ENTRY = main_entry_bytes(CODEC)
SPEC = "0+160;0+160;r0:131+16,0+64;r1:133+20"
EXPECTED = {
    "pool_pages": 10,
    "hits": 1,
    "hit_tokens": 128,
    "misses": 1,
    "recomputed_tokens": 128,
    "evicted_requests": 3,
    "evicted_pages": 11,
}


def budget_run(spec: str, budget: int, cp_size: int, level: int, **changes) -> RunConfig:  # noqa: ANN003
    requests, sizes = parse_batches(spec)
    base = RunConfig(
        preset="tiny-v4",
        cp_size=cp_size,
        requests=tuple(requests),
        batch_sizes=sizes,
        page_size=32,
        pool_pages=budget,
        phases=PhaseSet.level(level),
        device="cpu",
    )
    return base.replace(**changes)


def at_rest(rep: dict, part: str) -> int:
    return sum(r[part] for r in rep["per_rank"])


def test_the_timeline_follows_the_page_table() -> None:
    run = budget_run(SPEC, 10, 2, 2)
    assert replay_pool(run).counts == EXPECTED
    timeline = pool_timeline(run)
    assert timeline.hits == {0: frozenset(), 1: frozenset(), 2: {2}, 3: frozenset()}  # r4 missed: r1 was gone
    assert list(timeline.resident.values()) == [{0}, {0, 1}, {0, 2, 3}, {3, 4}]


@pytest.mark.parametrize(
    "cp_size,level,changes",
    [(2, 2, {}), (3, 4, {"chunk_size": 40}), (2, 3, {"split_mode": "round-robin"})],
    ids=["c2-level2", "c3-level4-chunked", "c2-level3-round-robin"],
)
def test_an_evicted_prefix_is_recomputed_and_matches_the_oracle(cp_size: int, level: int, changes: dict) -> None:
    rep = run_prefill(budget_run(SPEC, 10, cp_size, level, **changes))
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["prefix_cache"] == EXPECTED
    # At the end the pool holds r3 (cached) and r4: their entries only, the evicted requests' are gone.
    assert at_rest(rep, "csa_bytes") == (64 // 4 + 153 // 4) * CSA_ENTRY * CFG.count("csa")  # sharded: once
    assert all(r["hca_bytes"] == (153 // 128) * HCA_ENTRY * CFG.count("hca") for r in rep["per_rank"])


def test_a_hit_is_served_before_the_same_batch_evicts_its_source() -> None:
    """r1 = r0:100+36 takes r0's three whole pages; r2 = 0+96 then needs pages only r0's eviction gives: the
    hit's partial-page entries (tokens 96..99) and its checkpoint at 100 are taken before r0's state goes."""
    run = budget_run("0+160;r0:100+36,0+96", 8, 3, 4)
    assert pool_timeline(run).hits == {0: frozenset(), 1: {1}} and pool_timeline(run).resident[160] == {1, 2}
    rep = run_prefill(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["prefix_cache"]["hits"] == 1 and rep["prefix_cache"]["evicted_requests"] == 1
    assert at_rest(rep, "csa_bytes") == (136 // 4 + 96 // 4) * CSA_ENTRY * CFG.count("csa")


CHUNKED = "0+96;0+128"  # r1's third 32-token chunk evicts r0, whose pages no new request of a batch opens


def test_a_chunk_that_evicts_drops_the_state_with_the_pages() -> None:
    rep = run_prefill(budget_run(CHUNKED, 5, 2, 2, chunk_size=32))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["prefix_cache"]["evicted_requests"] == 1 and rep["prefix_cache"]["evicted_pages"] == 3
    assert at_rest(rep, "csa_bytes") == (128 // 4) * CSA_ENTRY * CFG.count("csa")  # r1's entries, no more


def test_state_kept_past_its_eviction_is_caught(forked_ranks) -> None:
    """A store that keeps an evicted request's state (stale entries at rest, beyond the budget) computes the
    right values -- the state is the request's own -- but its bytes at rest are not the pool's: r0's 24
    CSA entries are still there."""
    forked_ranks.setattr(V4Store, "keep_only", lambda self, resident: None)
    rep = run_prefill(budget_run(CHUNKED, 5, 2, 2, chunk_size=32))
    assert rep["prefix_cache"]["evicted_requests"] == 1
    assert at_rest(rep, "csa_bytes") == (128 // 4 + 96 // 4) * CSA_ENTRY * CFG.count("csa")


def _stale_evict(self: PrefixCache) -> bool:
    """An eviction that forgets to drop the request from the table: its pages go back to the allocator, but a
    later ``rN:P+E`` still takes them by reference (they hold other requests' state by then)."""
    if not self._lru:
        return False
    req, _ = self._lru.popitem(last=False)
    self.table.allocator.free([p for p in self.table.pages(req) if self.table._holders.get(p) == 1])
    self.evicted_requests += 1
    return True


def test_a_prefix_served_stale_after_its_eviction_is_refused(forked_ranks) -> None:
    """r1's pages went to r2 and r3 in batch 2 and its state with them; the stale table says r4 hits r1."""
    forked_ranks.setattr(PrefixCache, "evict", _stale_evict)
    with pytest.raises(RankFailedError, match="request 4 hits request 1, whose state this store dropped"):
        run_prefill(budget_run(SPEC, 10, 2, 2), timeout_s=120)


def test_a_recomputed_miss_is_hit_in_turn_under_phase_5_lanes() -> None:
    """Level 8 at C = 3, 16-token pages, a budget of 41 pages (18 of them lane slack): r4 = r1:266+20 misses
    (r1 was evicted) and recomputes 266 tokens; r5 = r4:280+6 then hits r4 at a point its own prefill
    passed (280 mod 4, 8, 128 = 0, 0, 24: the overlap's four rows and 24 HCA rows carried)."""
    run = budget_run("0+320;0+320;r0:262+16,0+64;r1:266+20;r4:280+6", 41, 3, 8, page_size=16)
    assert pool_timeline(run).hits == {0: frozenset(), 1: frozenset(), 2: {2}, 3: frozenset(), 4: {5}}
    rep = run_prefill(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["prefix_cache"] == replay_pool(run).counts
    assert rep["prefix_cache"]["hits"] == 2 and rep["prefix_cache"]["misses"] == 1
    assert rep["prefix_cache"]["evicted_requests"] == 2


_drop = V4Store.drop


def _drop_and_reuse(self: V4Store, old: int) -> None:
    """An eviction whose memory the pool hands out again at once: every tensor of the dropped request (its
    entries, keys, window tail, compressor state and checkpoints) is overwritten in place, then dropped."""
    for states in self.layers:
        if old in states:
            st = states[old]
            for part in (st.main, st.index, st.window):
                part.fill_(0x7E)  # a large FP8 value in every byte
            st.pool.fill_(1e4)
    for (req, _), parts in self.checkpoints.items():
        for part in parts if req == old else ():
            if part is not None:
                part[0].fill_(0x7E)
                part[1].fill_(1e4)
    _drop(self, old)


@pytest.mark.parametrize("cp_size,level", [(2, 0), (3, 4)], ids=["c2-replicated", "c3-sharded"])
def test_no_hit_reads_the_memory_of_a_request_evicted_after_it(forked_ranks, cp_size: int, level: int) -> None:
    """r1 = r0:100+36 hits, then r2's pages evict r0 in the same batch; with r0's memory overwritten as it goes,
    r1 still matches the oracle: a hit copies what it keeps (entries of the partial page, the checkpoint), so
    nothing it computes with is the evicted request's memory. Served from it, the check would see the overwrite."""
    forked_ranks.setattr(V4Store, "drop", _drop_and_reuse)
    rep = run_prefill(budget_run("0+160;r0:100+36,0+96", 8, cp_size, level))
    assert rep["prefix_cache"]["hits"] == 1 and rep["prefix_cache"]["evicted_requests"] == 1
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
