"""GLM-5.3 on a long-lived pool: several batches in one run, requests ``rN:P+E`` that hit an earlier request's
cached prefix, eviction under a pool budget (``pool_pages``), and a sharded store that allocates only the
slots its rank owns (the rules: docs/glm-5.3.md, "Prefix hits and eviction").

``tiny-glm53`` pools indexer keys over 16-token groups and runs its KDA layers in blocks (the in-seq split's
``2C`` per chunk, round-robin's ``C``), so the hit points below sit at the residues that change what a hit
carries: ``P mod 16`` (the pending raw indexer rows of the group incomplete at ``P``), ``P mod page`` (a
partial page copied to the hit's fresh page, on that page's owner), and ``P`` inside a KDA block (the state
there composed from the block's first tokens) or at the source's chunk boundary or end.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.config import PhaseSet, RunConfig, parse_batches
from reference_impl.cp.ownership import Ownership
from reference_impl.engine import replay_page_table, replay_pool, run_id_space
from reference_impl.errors import ConfigError
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.cp.store import Glm53Store, GroupKeyOwnership
from reference_impl.families.glm53.model.oracle import KDACache
from reference_impl.families.glm53.planner import bytes_per_token
from reference_impl.kvcache.allocator import PrefixCache
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefill

CFG = get_preset("tiny-glm53")
DSA_LAYERS = [i for i in range(CFG.n_layers) if not CFG.is_kda(i)]
INDEXED_LAYERS = [i for i in DSA_LAYERS if not CFG.shares_selection(i)]


def pool_run(spec: str, cp_size: int, level: int | str, **changes) -> RunConfig:  # noqa: ANN003
    requests, sizes = parse_batches(spec)
    phases = PhaseSet.level(level) if isinstance(level, int) else PhaseSet.parse(level)
    base = RunConfig(
        preset="tiny-glm53",
        cp_size=cp_size,
        requests=tuple(requests),
        batch_sizes=sizes,
        phases=phases,
        page_size=4,
        device="cpu",
    )
    return base.replace(**changes)


def _rows_by_position(result, layer: int, req: int, n: int) -> torch.Tensor:  # noqa: ANN001
    """Request ``req``'s first ``n`` latent rows of ``layer`` as stored, whichever rank holds each."""
    out: list[torch.Tensor | None] = [None] * n
    for rank in result.ranks:
        positions, rows = rank.stored[layer][req][:2]
        for p, row in zip(positions.tolist(), rows):
            if p < n:
                out[p] = row
    assert all(r is not None for r in out), (layer, req)
    return torch.stack(out)  # type: ignore[arg-type]


CASES = [
    # (spec, C, phases, changes): the hit point P of each rN:P+E as (P mod 16, P mod page)
    ("0+150;r0:70+30", 2, 2, {}),  # (6, 2): inside a block of r0's one chunk
    ("0+150;r0:69+30", 3, 8, {"chunk_size": 40}),  # (5, 1): r0's chunk boundaries 40 / 80 around it
    ("0+150;r0:80+30", 3, 3, {"chunk_size": 40}),  # (0, 0): P is r0's chunk boundary, nothing pending
    ("0+150;r0:64+30", 2, 0, {}),  # (0, 0): replicated tables, P at a group boundary
    ("0+150;r0:68+30", 3, "+1,2,3,6,7,8", {"split_mode": "round-robin"}),  # (4, 0): round-robin's blocks
    ("0+150;r0:71+30", 2, "+1,2,3,6,7,8", {"split_mode": "round-robin", "chunk_size": 50}),  # (7, 3)
    ("0+200,13+50;r0:131+20,r1:61+9", 4, 3, {}),  # (3, 3) past a 128-token span; (13, 1) inside r1's extend
    ("0+150;r0:70+30", 3, 8, {"page_size": 16}),  # (6, 6): a partial page moves to the fresh page's owner
    ("0+100;r0:100+20", 2, 8, {}),  # the whole request: the checkpoint is its end state
    ("0+150;r0:3+30", 2, 8, {}),  # (3, 3): no whole page, no complete group; everything is copied
    ("0+150;r0:70+30,r0:70+5", 2, 3, {"kv_dtype": "bf16"}),  # two requests hit one checkpoint; bf16 rows
    ("0+96,40+70;r0:64+50,13+37;r1:42+20", 2, 8, {}),  # frees between batches; P = 42 inside r1's cached 40
    ("0+120;r0:48+24", 2, 5, {}),  # phase 5: aligned pages, a hit at a page and group boundary
]


@pytest.mark.parametrize("spec,cp_size,level,changes", CASES, ids=[f"{c[0]}-C{c[1]}" for c in CASES])
def test_hits_match_the_oracle(spec: str, cp_size: int, level: int | str, changes: dict) -> None:
    run = pool_run(spec, cp_size, level, **changes)
    result = run_prefill(run, tensors=True)
    rep = result.report
    assert rep["problems"] == [] and rep["matches_oracle"] is True
    assert isinstance(rep["cache_equal"], bool)  # reported (a rank's GEMM over few rows may flip an FP8 code)
    if "host_syncs_in_layer_loop" in rep["per_rank"][0]:  # phase 6: the checkpoints read nothing in the loop
        assert all(r["host_syncs_in_layer_loop"] == 0 for r in rep["per_rank"])
    # A hit's prefix rows are its source's, byte for byte: by reference in whole pages, copied in the partial one.
    for req, r in enumerate(run.requests):
        if r.shares is None:
            continue
        for layer in DSA_LAYERS:
            want = _rows_by_position(result, layer, r.shares, r.prefix)
            assert torch.equal(_rows_by_position(result, layer, req, r.prefix), want), (req, layer)


def test_the_kda_checkpoint_is_the_state_at_the_hit_point(forked_ranks: pytest.MonkeyPatch) -> None:
    """The source's final KDA state served instead of its state at ``P`` (inside a block): caught."""
    real = Glm53Store.take_hit

    def final_state(self: Glm53Store, req: int, source: int, n_tokens: int, shared: int):  # noqa: ANN202
        hit = real(self, req, source, n_tokens, shared)
        for layer, part in hit.parts.items():
            if isinstance(part, KDACache):
                hit.parts[layer] = KDACache(self.kda[(layer, source)].state.clone(), part.conv)
        return hit

    forked_ranks.setattr(Glm53Store, "take_hit", final_state)
    rep = run_prefill(pool_run("0+150;r0:70+30", 2, 2))
    assert not rep["matches_oracle"] and any("hidden states" in p for p in rep["problems"])


def test_the_pending_rows_are_those_at_the_hit_point(forked_ranks: pytest.MonkeyPatch) -> None:
    """The hit's pending indexer rows (the six of the group incomplete at ``P = 70``) zeroed: the group the hit
    completes pools the wrong rows, and its key differs from the oracle's."""
    real = Glm53Store.take_hit

    def no_pending(self: Glm53Store, req: int, source: int, n_tokens: int, shared: int):  # noqa: ANN202
        hit = real(self, req, source, n_tokens, shared)
        for layer, part in hit.parts.items():
            if not isinstance(part, KDACache):
                hit.parts[layer] = (torch.zeros_like(part[0]), torch.zeros_like(part[1]))
        return hit

    forked_ranks.setattr(Glm53Store, "take_hit", no_pending)
    rep = run_prefill(pool_run("0+150;r0:70+30", 2, 2))
    assert not rep["matches_oracle"] and any("group keys differ" in p for p in rep["problems"])


def test_a_hit_inside_a_hit_is_refused() -> None:
    with pytest.raises(ConfigError, match="write it as r0:40"):
        pool_run("0+100;r0:60+20;r1:40+10", 2, 2)


# ---- eviction under a pool budget ----------------------------------------------------------------------------
# tiny-glm53, pages of 32 tokens, a budget of 10 pages (the hand-computed scenario of tests/test_v4_eviction.py):
# r1 is evicted when r2 = r0:131+16 needs a page; r4 = r1:133+20 then misses and recomputes its prefix, and its
# pages evict r0 and r2. At the end the pool holds r3 (0+64, cached) and r4 (153 tokens).
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
    return pool_run(spec, cp_size, level, **({"page_size": 32, "pool_pages": budget} | changes))


def _at_rest(rep: dict, part: str) -> int:
    return sum(r[part] for r in rep["per_rank"])


def _rows_at_rest(tokens: list[int], kv_dtype: str = "fp8") -> tuple[int, int]:
    """Latent-row and group-key bytes of requests of ``tokens`` tokens, each held once."""
    row = LatentRows.for_run(CFG.kv_lora_rank, kv_dtype, CFG.mla_scale_fmt).row_bytes
    keys = sum(n // CFG.index_kpool for n in tokens) * len(INDEXED_LAYERS) * CFG.index_head_dim * 4
    return sum(tokens) * len(DSA_LAYERS) * row, keys


@pytest.mark.parametrize(
    "cp_size,level,changes",
    [(2, 2, {}), (3, 4, {"chunk_size": 40}), (2, 3, {"split_mode": "round-robin"})],
    ids=["c2-level2", "c3-level4-chunked", "c2-level3-round-robin"],
)
def test_an_evicted_prefix_is_recomputed_and_matches_the_oracle(cp_size: int, level: int, changes: dict) -> None:
    rep = run_prefill(budget_run(SPEC, 10, cp_size, level, **changes))
    assert rep["problems"] == [] and rep["matches_oracle"] is True
    assert rep["prefix_cache"] == EXPECTED
    # Only r3's and r4's rows and KDA states at rest: the evicted requests' went with their pages.
    assert (_at_rest(rep, "kv_bytes"), _at_rest(rep, "index_bytes")) == _rows_at_rest([64, 153])
    kda = len(CFG.layer_types) - len(DSA_LAYERS)
    assert all(r["kda_state_bytes"] == 2 * kda * KDA_BYTES for r in rep["per_rank"])


KDA_BYTES = CFG.kda_state_bytes + (CFG.linear_conv_kernel_dim - 1) * CFG.conv_dim * 4  # state and tail, float32


def test_a_hit_is_served_before_the_same_batch_evicts_its_source() -> None:
    """r1 = r0:100+36 takes r0's three whole pages; r2 = 0+96 then needs pages only r0's eviction gives: the
    partial page's rows (tokens 96..99) and the checkpoint at 100 are copied before r0's state goes."""
    rep = run_prefill(budget_run("0+160;r0:100+36,0+96", 8, 3, 4))
    assert rep["problems"] == [] and rep["matches_oracle"] is True
    assert rep["prefix_cache"]["hits"] == 1 and rep["prefix_cache"]["evicted_requests"] == 1
    assert (_at_rest(rep, "kv_bytes"), _at_rest(rep, "index_bytes")) == _rows_at_rest([136, 96])


CHUNKED = "0+96;0+128"  # r1's third 32-token chunk evicts r0, whose pages no new request of a batch opens


def test_a_chunk_that_evicts_drops_the_state_with_the_pages() -> None:
    rep = run_prefill(budget_run(CHUNKED, 5, 2, 2, chunk_size=32))
    assert rep["matches_oracle"] is True
    assert rep["prefix_cache"]["evicted_requests"] == 1 and rep["prefix_cache"]["evicted_pages"] == 3
    assert (_at_rest(rep, "kv_bytes"), _at_rest(rep, "index_bytes")) == _rows_at_rest([128])


def test_rows_kept_past_their_eviction_are_caught(forked_ranks: pytest.MonkeyPatch) -> None:
    """A store that keeps an evicted request's state computes the right values (the state is the request's own)
    but holds more than the pool: r0's page that r1 did not take back still counts as held, with its KDA states."""
    forked_ranks.setattr(Glm53Store, "keep_only", lambda self, resident, live=None: None)
    rep = run_prefill(budget_run(CHUNKED, 5, 2, 2, chunk_size=32))
    assert rep["prefix_cache"]["evicted_requests"] == 1
    assert _at_rest(rep, "kv_bytes") > _rows_at_rest([128])[0]


def _stale_evict(self: PrefixCache) -> bool:
    """An eviction that forgets to drop the request from the table: its pages go back to the allocator, but a
    later ``rN:P+E`` still takes them by reference (they hold other requests' rows by then)."""
    if not self._lru:
        return False
    req, _ = self._lru.popitem(last=False)
    self.table.allocator.free([p for p in self.table.pages(req) if self.table._holders.get(p) == 1])
    self.evicted_requests += 1
    return True


def test_a_prefix_served_stale_after_its_eviction_is_caught(forked_ranks: pytest.MonkeyPatch) -> None:
    """r1's pages went to r2 and r3 in batch 2; the stale table says r4 hits r1, whose pages now hold their rows."""
    forked_ranks.setattr(PrefixCache, "evict", _stale_evict)
    rep = run_prefill(budget_run(SPEC, 10, 2, 2), timeout_s=120)
    assert not rep["matches_oracle"] and any("hidden states" in p for p in rep["problems"])


_drop = Glm53Store.drop


def _drop_and_reuse(self: Glm53Store, old: int) -> None:
    """An eviction whose memory is handed out again at once: the dropped request's KDA states, pending rows and
    checkpoints are overwritten in place, then dropped."""
    for (_, req), cache in self.kda.items():
        if req == old:
            cache.state.fill_(1e4)
            cache.conv.fill_(1e4)
    for (req, _), parts in self.checkpoints.items():
        for part in parts.values() if req == old else ():
            for t in (part.state, part.conv) if isinstance(part, KDACache) else part:
                t.fill_(1e4)
    _drop(self, old)


@pytest.mark.parametrize("cp_size,level", [(2, 0), (3, 4)], ids=["c2-replicated", "c3-sharded"])
def test_no_hit_reads_the_memory_of_a_request_evicted_after_it(
    forked_ranks: pytest.MonkeyPatch, cp_size: int, level: int
) -> None:
    """r1 = r0:100+36 hits, then r2's pages evict r0 in the same batch; with r0's memory overwritten as it goes,
    r1 still matches the oracle: a hit copies what it keeps."""
    forked_ranks.setattr(Glm53Store, "drop", _drop_and_reuse)
    rep = run_prefill(budget_run("0+160;r0:100+36,0+96", 8, cp_size, level))
    assert rep["prefix_cache"]["hits"] == 1 and rep["prefix_cache"]["evicted_requests"] == 1
    assert rep["problems"] == [] and rep["matches_oracle"] is True


def test_a_recomputed_miss_is_hit_in_turn_under_phase_5_lanes() -> None:
    """Level 8 at C = 3, 16-token pages, a budget of 41 pages: r4 = r1:266+20 misses (r1 was evicted) and
    recomputes 266 tokens, keeping the checkpoint at 280 as its prefill passes it; r5 = r4:280+6 hits it there
    (``280 mod 16 = 8`` pending rows, the KDA state inside r4's last block)."""
    run = budget_run("0+320;0+320;r0:262+16,0+64;r1:266+20;r4:280+6", 41, 3, 8, page_size=16)
    rep = run_prefill(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True
    assert rep["prefix_cache"] == replay_pool(run).counts
    assert rep["prefix_cache"]["hits"] == 2 and rep["prefix_cache"]["misses"] == 1


def test_the_timeline_is_the_page_tables() -> None:
    assert replay_pool(budget_run(SPEC, 10, 2, 2)).counts == EXPECTED


# ---- a sharded store allocates only what its rank owns --------------------------------------------------------
@pytest.mark.parametrize("split_mode", ["in-seq", "round-robin"])
def test_a_sharded_store_allocates_its_share(split_mode: str) -> None:
    """Per slot: a latent row and its held flag per indexed layer; per key cell (a page of 4 slots here, which can
    end one group of 16): a group key and its flag per layer with its own indexer. Replicated: every logical slot
    and cell on every rank; sharded: the rank's packed runs only, so the ranks together allocate what one
    replicated rank does (up to a run per rank)."""
    spec, cp_size = "37+61,0+45", 3
    row = LatentRows.for_run(CFG.kv_lora_rank, "fp8", CFG.mla_scale_fmt).row_bytes
    per_slot = len(DSA_LAYERS) * (row + 1)
    per_key = len(INDEXED_LAYERS) * (CFG.index_head_dim * 4 + 1)
    replicated = run_prefill(pool_run(spec, cp_size, 0, split_mode=split_mode))
    sharded_run = pool_run(spec, cp_size, 2, split_mode=split_mode)
    sharded = run_prefill(sharded_run)
    assert replicated["matches_oracle"] and sharded["matches_oracle"]
    n_pages = run_id_space(replay_page_table(sharded_run))
    own = Ownership(cp_size, sharded_run.interleave, sharded_run.page_size)
    keys = GroupKeyOwnership.of(own, CFG.index_kpool)
    assert keys.cell == 4  # gcd(page size 4, kpool 16): one key row per page, not per slot
    whole = n_pages * 4 * per_slot + n_pages * per_key
    assert [r["table_bytes"] for r in replicated["per_rank"]] == [whole] * cp_size
    want = [
        own.pages_held(n_pages, rank) * 4 * per_slot + keys.rows_held(n_pages * 4, rank, True) * per_key
        for rank in range(cp_size)
    ]
    assert [r["table_bytes"] for r in sharded["per_rank"]] == want
    run_bytes = 4 * per_slot + keys.interleave * per_key  # what a rank may allocate past its share: a run of each
    assert sum(want) <= whole + cp_size * run_bytes and max(want) < whole / 2


@pytest.mark.parametrize("page_size", [16, 64])
def test_the_tables_match_the_planners_bytes_per_token(page_size: int) -> None:
    """Pages that hold whole groups: the key table has a row per ``kpool`` slots, so the tables' bytes are the
    planner's bytes per token (a latent row per indexed layer, a sixteenth of a key per layer with its own
    indexer) over every slot, plus the held flags (a byte per latent row and per key row)."""
    run = pool_run("37+61,0+45", 2, 0, page_size=page_size)
    report = run_prefill(run)
    assert report["matches_oracle"]
    slots = run_id_space(replay_page_table(run)) * page_size
    per_token = bytes_per_token(CFG, "fp8")
    n_shared = len(DSA_LAYERS) - len(INDEXED_LAYERS)
    tables = slots * (len(INDEXED_LAYERS) * per_token["indexed"] + n_shared * per_token["indexed_shared"])
    flags = slots * len(DSA_LAYERS) + slots // CFG.index_kpool * len(INDEXED_LAYERS)
    assert [r["table_bytes"] for r in report["per_rank"]] == [tables + flags] * 2


def test_glm53_flash_keys_take_a_sixteenth_of_the_slots() -> None:
    """GLM-5.3-Flash's pages of 64 and groups of 16: a key row per 16 slots, replicated or sharded (C = 4, in-seq
    pages or round-robin's interleave 1), and the ranks' rows add up to the replicated table's."""
    kpool, slots = get_preset("glm-5.3-flash").index_kpool, 64 * 40
    assert kpool == 16
    for interleave in (64, 1):
        keys = GroupKeyOwnership.of(Ownership(4, interleave, 64), kpool)
        assert keys.rows_held(slots, 0, False) == slots // 16
        assert [keys.rows_held(slots, r, True) for r in range(4)] == [slots // 64] * 4
