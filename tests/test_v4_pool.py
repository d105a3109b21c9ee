"""DeepSeek-V4 on a long-lived pool: several batches in one run, and requests ``rN:P+E`` that hit an
earlier request's cached prefix (the hit rules are in :mod:`reference_impl.families.deepseek_v4.cp.store`).

``tiny-v4`` has a CSA layer (4-token entries over 8-token overlapping windows), an HCA layer
(128-token entries) and a 128-token sliding window, so the prefix lengths below sit at the residues
that change what a hit carries: ``P mod 4`` (rows of CSA's incomplete block), ``P mod 8`` (whether
the overlap's previous block is complete), ``P mod 128`` (HCA's incomplete block, one prefix past
128), with chunk boundaries of the first request inside and at the end of a block.
"""

from __future__ import annotations

import pytest

from reference_impl.config import ConfigError, PhaseSet, RunConfig, parse_batches
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.split import build_split
from reference_impl.engine import request_locs
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.cp.plan import build_plan
from reference_impl.families.deepseek_v4.cp.store import V4Store
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefill, run_prefills

CFG = get_preset("tiny-v4")
CSA_LAYER = CFG.compress_ratios.index(4)
CFG_CODEC = RunConfig(preset="tiny-v4").kv_dtype


def pool_run(spec: str, cp_size: int, level: int | str, **changes) -> RunConfig:  # noqa: ANN003
    requests, sizes = parse_batches(spec)
    phases = PhaseSet.level(level) if isinstance(level, int) else PhaseSet.parse(level)
    base = RunConfig(
        preset="tiny-v4", cp_size=cp_size, requests=tuple(requests), batch_sizes=sizes, phases=phases, device="cpu"
    )
    return base.replace(**changes)


CASES = [
    # (spec, C, phases, changes): the hit point P of each rN:P+E is noted as (P mod 4, P mod 8, P mod 128)
    ("0+150;r0:70+30", 2, 2, {}),  # (2, 6, 70)
    ("0+150;r0:69+30", 3, 8, {"chunk_size": 40}),  # (1, 5, 69): r0's chunk boundary 40 / 80 around it
    ("0+150;r0:80+30", 3, 3, {"chunk_size": 40}),  # (0, 0, 80): P is r0's chunk boundary
    ("0+200,13+50;r0:131+20,r1:61+9", 4, 3, {}),  # (3, 3, 3) past one HCA entry; (1, 5, 61)
    ("0+200;r0:128+9", 2, 5, {}),  # (0, 0, 0): HCA carries nothing, CSA the overlap's 4 rows
    ("0+150;r0:68+30", 3, "+1,2,3,6,7,8", {"split_mode": "round-robin"}),  # (0, 4, 68)
    ("0+130;r0:126+30", 4, 0, {"chunk_size": 30}),  # (2, 6, 126): replicated entries, window across chunks
    ("0+150;r0:70+30", 3, 8, {"page_size": 16}),  # a partial page of entries moves to the fresh page's owner
    ("0+100;r0:100+20", 2, 8, {}),  # the whole request: the checkpoint is its end state
    ("0+150;r0:3+30", 2, 8, {}),  # (3, 3, 3): no complete entry, no whole page; the carry is everything
    ("0+300;r0:257+20,r0:130+9", 4, 8, {"chunk_size": 100}),  # two hit points of one request, past 2 HCA entries
    ("0+150;r0:70+30,r0:70+5", 2, 3, {}),  # two requests hit the same checkpoint
    ("0+96,40+70;r0:64+50,13+37;r1:42+20", 2, 8, {}),  # frees between batches; P = 42 inside r1's cached 40+70
    ("0+96,40+70;r0:64+50,13+37;r1:40+20", 3, 2, {"chunk_size": 30}),  # P = r1's own cached prefix
]


@pytest.mark.parametrize("spec,cp_size,level,changes", CASES, ids=[f"{c[0]}-C{c[1]}" for c in CASES])
def test_hits_match_the_oracle_with_entries_sharded_at_rest(spec, cp_size, level, changes) -> None:
    run = pool_run(spec, cp_size, level, **changes)
    result = run_prefill(run, tensors=True)
    rep = result.report
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    if not run.phases.sharded_kv:
        return
    # Every CSA entry on exactly the rank a single-batch run puts it: the owner of its token's page
    # in the request's own locs (a hit's entries included, whichever rank computed them).
    owners = V4Store(run.model, run.kv_dtype, None, Ownership(run.cp_size, run.interleave, run.page_size))
    owners.locs = request_locs(run)
    for req in range(len(run.requests)):
        n_entries = run.requests[req].total // 4
        expected = owners.entry_owner(req, range(n_entries))
        for r in result.ranks:
            held = r.stored[CSA_LAYER][req][3].tolist() if req in r.stored[CSA_LAYER] else []
            assert held == [w for w in range(n_entries) if expected[w] == r.rank], (req, r.rank)


def test_a_partial_page_of_a_hit_changes_owner() -> None:
    """With 16-token pages, r1 = r0:70+30 takes r0's first four pages by reference; entry 16 (tokens
    64..67) sits in r1's fresh page, whose owner is another rank: the hit moves it there."""
    run = pool_run("0+150;r0:70+30", 3, 8, page_size=16)
    owners = V4Store(run.model, run.kv_dtype, None, Ownership(run.cp_size, run.interleave, run.page_size))
    owners.locs = request_locs(run)
    assert owners.entry_owner(0, range(16)) == owners.entry_owner(1, range(16))
    assert owners.entry_owner(0, [16]) != owners.entry_owner(1, [16])


def test_dropping_the_carried_rows_at_a_hit_breaks_the_match(forked_ranks) -> None:
    """The hit's compressor state (the incomplete block's pre-pool rows and CSA's overlap rows) is
    what the first new entry is pooled from: zeroed, the run no longer matches the oracle."""
    run = pool_run("0+150;r0:70+30", 2, 2)
    assert run_prefills([run])[0]["matches_oracle"] is True
    forked_ranks.setattr(V4Store, "carry_at_hits", False)
    rep = run_prefills([run])[0]
    assert rep["matches_oracle"] is False and rep["cache_equal"] is False
    assert any("request 1" in p and "compressor state" in p for p in rep["problems"])


@pytest.mark.parametrize("q", [1, 5, 8, 69, 128, 131])
def test_a_checkpoint_keeps_the_window_tail_and_the_carried_rows(q: int) -> None:
    """The plan's checkpoint at ``Q``: the raw rows of ``[Q - 127, Q)`` and, per ratio, the pre-pool
    rows of ``[state_start(Q, m), Q)`` -- ``Q mod m`` rows, plus CSA's previous block of 4."""
    meta = build_split("in-seq", 3, [150], [0], 64)
    for rank in range(3):
        plan = build_plan(meta, CFG, rank, [[q]])
        assert len(plan.checkpoint_tail_rows[(0, q)]) == min(q, CFG.window_size - 1)
        for m, rp in plan.ratios.items():
            assert len(rp.checkpoint_state_rows[(0, q)]) == q - state_start(q, m)
            assert all(row >= 0 for row in rp.checkpoint_state_rows[(0, q)])
    assert q - state_start(q, 4) == (4 if q % 4 == 0 else 4 + q % 4) or q < 4


def test_a_hit_inside_a_hit_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="r2 = r1:30"):
        pool_run("0+96;r0:64+20;r1:30+5", 2, 2)
    pool_run("0+96;r0:64+20;r1:70+5", 2, 2)  # past r1's own hit: r1 computed it


def test_entries_in_shared_pages_are_counted_once() -> None:
    """r1 = r0:64+30 shares r0's first 64-token page: its 16 CSA entries are at rest once, so the
    ranks' CSA bytes sum to r0's 37 entries and r1's 23 - 16 own ones; HCA's first entry is past 64,
    so r1's HCA has no entry, and r0's has one (150 // 128)."""
    rep = run_prefills([pool_run("0+150;r0:64+30", 2, 2)])[0]
    assert rep["matches_oracle"] is True
    per_entry = main_entry_bytes(CFG_CODEC) + index_entry_bytes(CFG_CODEC, CFG.index_head_dim)
    assert sum(r["csa_bytes"] for r in rep["per_rank"]) == (37 + 23 - 16) * per_entry * CFG.count("csa")
    assert all(r["hca_bytes"] == 1 * main_entry_bytes(CFG_CODEC) * CFG.count("hca") for r in rep["per_rank"])
