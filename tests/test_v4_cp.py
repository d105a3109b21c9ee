"""CP prefill of DeepSeek-V4 (``tiny-v4``: sliding, CSA and HCA layers) against the V4 oracle.

Requests and chunk sizes are not multiples of 4 or 128, so compression windows and 128-token
sliding windows straddle split and chunk boundaries; at C = 4 a 203-token request is cut into
blocks of ~25 tokens, and a window reaches back over five of them.
"""

from __future__ import annotations

import math

import pytest
import torch

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.split import build_split
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.cp.plan import build_plan
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefills

CFG = get_preset("tiny-v4")
REQUESTS = (Request(0, 203), Request(29, 110))
LEVELS = (0, 2, 3, 8)
ENTRY = main_entry_bytes("fp8") + index_entry_bytes("fp8")


def _runs(cp_size: int, chunk_size: int | None) -> list[dict]:
    base = RunConfig(preset="tiny-v4", cp_size=cp_size, requests=REQUESTS, chunk_size=chunk_size)
    return run_prefills([base.replace(phases=PhaseSet.level(level)) for level in LEVELS])


@pytest.mark.parametrize("cp_size,chunk_size", [(2, None), (3, 71), (4, 71)])
def test_matches_the_oracle_and_shards_csa_entries(cp_size, chunk_size):
    reports = _runs(cp_size, chunk_size)
    for level, rep in zip(LEVELS, reports):
        assert rep["matches_oracle"], (level, rep["problems"])
        assert rep["cache_equal"] and rep["collectives_identical"], level
    replicated = reports[0]["per_rank"]
    total_csa = replicated[0]["csa_bytes"]
    assert all(r["csa_bytes"] == total_csa for r in replicated)  # the baseline keeps everything everywhere
    pages = [math.ceil(r.total / 4 / 16) for r in REQUESTS]  # CSA entry pages (16 entries per 64-token page)
    bound = (
        (sum(math.ceil(p / cp_size) for p in pages) + 1) * 16 * ENTRY * CFG.count("csa")
    )  # V3.2's bar, in entry pages
    for level, rep in zip(LEVELS[1:], reports[1:]):
        ranks = rep["per_rank"]
        assert sum(r["csa_bytes"] for r in ranks) == total_csa, level  # each entry on exactly one rank
        assert max(r["csa_bytes"] for r in ranks) <= bound < total_csa, level  # ~1/C per rank
        for r, base in zip(ranks, replicated):  # HCA entries, window tails, compressor states: replicated
            assert (r["hca_bytes"], r["window_bytes"], r["compressor_state_bytes"]) == (
                base["hca_bytes"],
                base["window_bytes"],
                base["compressor_state_bytes"],
            )
    assert reports[0]["per_rank"][0]["materialized_bytes"] == 0 < reports[1]["per_rank"][0]["materialized_bytes"]
    assert all(r["host_syncs_in_layer_loop"] == 0 for r in reports[-1]["per_rank"])  # phase 6's audit, level 8


def test_round_robin_runs_with_its_whole_chunk_halo():
    base = RunConfig(preset="tiny-v4", cp_size=2, requests=REQUESTS, split_mode="round-robin", chunk_size=71)
    seq, rr = run_prefills(
        [base.replace(split_mode="in-seq", phases=PhaseSet.level(3)), base.replace(phases=PhaseSet.level(3))]
    )
    assert seq["matches_oracle"] and rr["matches_oracle"], rr["problems"]
    assert rr["per_rank"][0]["gather_bytes"] > 1.5 * seq["per_rank"][0]["gather_bytes"]


# ---- the plan: halos from the split alone (no processes) ------------------------------------------


def _halo_sizes(meta, rank: int) -> tuple[int, dict[int, int]]:
    plan = build_plan(meta, CFG, rank)
    return len(plan.raw.need), {m: len(rp.pool.need) for m, rp in plan.ratios.items()}


def test_halos_of_the_in_seq_split():
    """A block needs at most ``window - 1`` raw rows and ``2m - 1`` (CSA) / ``m - 1`` (HCA) pre-pool
    rows from before its start, plus every request's next window tail and compressor state."""
    meta = build_split("in-seq", 4, [1021], [0], 64)
    tail_raw, tail_pool = 127, {4: 4 + 1021 % 4, 128: 1021 % 128}
    for rank in range(4):
        raw, pool = _halo_sizes(meta, rank)
        starts = sum(1 for seg in meta.segments[rank] if seg.q_abs_start > 0)
        assert raw <= starts * 127 + tail_raw
        assert pool[4] <= starts * 7 + tail_pool[4] and pool[128] <= starts * 127 + tail_pool[128]


def test_page_aligned_split_leaves_csa_only_its_overlap_halo():
    """Blocks on page boundaries (multiples of 64, hence of 4): a CSA entry straddles a boundary only
    through its overlap, the 4 tokens of the previous window's first half."""
    meta = build_split("in-seq", 2, [1021], [0], 64, page_aligned=True)
    assert meta.page_aligned
    plan = build_plan(meta, CFG, 1)  # rank 1: blocks 1 and 2, neither at position 0
    csa = plan.ratios[4]
    tail = {(0, p) for p in range((1021 // 4 - 1) * 4, 1021)}
    before = sorted(p for _, p in csa.pool.need if (0, p) not in tail)
    starts = [seg.q_abs_start for seg in meta.segments[1] if seg.q_abs_start - 1 not in plan.positions]
    assert before == [s - 4 + j for s in starts for j in range(4)]


def test_every_new_entry_has_one_compute_owner_holding_its_last_token():
    meta = build_split("round-robin", 3, [301, 150], [0, 37], 64)
    plans = [build_plan(meta, CFG, r) for r in range(3)]
    for m in (4, 128):
        entries = plans[0].ratios[m].entries
        assert entries == [(0, w) for w in range(301 // m)] + [(1, w) for w in range(37 // m, 187 // m)]
        owned = sorted(k for p in plans for k in p.ratios[m].owned)
        assert owned == list(range(len(entries)))
        for (i, w), owner in zip(entries, plans[0].ratios[m].entry_owner):
            assert (w + 1) * m - 1 in plans[owner].positions or i == 1  # request 1's positions are offset
    # Round-robin: each rank needs nearly every other rank's raw rows (the window covers them all).
    assert len(plans[0].raw.need) >= (301 + 150) * 2 // 3 - 10


def test_v4_refuses_what_is_not_wired():
    from reference_impl.planner import PlannerConfig

    # Several batches and hits are wired (tests/test_v4_pool.py); a hit inside another request's hit is not.
    RunConfig(preset="tiny-v4", requests=(Request(0, 130), Request(64, 9, 0)), batch_sizes=(1, 1))
    with pytest.raises(ConfigError, match="hits inside r1's own hit"):
        RunConfig(
            preset="tiny-v4", requests=(Request(0, 130), Request(64, 9, 0), Request(30, 5, 1)), batch_sizes=(1, 1, 1)
        )
    with pytest.raises(ConfigError, match="planner.v4"):
        PlannerConfig(preset="deepseek-v4-flash")


def test_the_api_builds_v4_models_and_runs_their_oracle():
    import torch

    from reference_impl import api

    model = api.make_model("tiny-v4", dtype=torch.float32, kernels=False)
    requests = [Request(5, 140)]
    result = api.oracle(model, requests, api.make_inputs(model.cfg, requests, dtype=torch.float32), chunk_size=61)
    assert result.hidden[0].shape == (140, CFG.dim) and result.caches[1][0].entries.shape == (145 // 4, 584)


def test_cache_check_compares_by_value_when_bytes_differ():
    """A rank whose entries differ in their last bits (a GPU's GEMM rounding) passes by value; a
    corrupted entry fails; a missing entry fails."""
    from types import SimpleNamespace

    import torch

    from reference_impl.families.deepseek_v4.cache_layout import decode_main, encode_main
    from reference_impl.families.deepseek_v4.check import _compare_caches
    from reference_impl.families.deepseek_v4.cp.store import pack_pool
    from reference_impl.families.deepseek_v4.model.oracle import build_v4_model, run_v4_oracle

    model = build_v4_model(CFG, torch.float32, 0, "cpu")
    oracle = run_v4_oracle(model, [0], [torch.randn(150, CFG.dim, generator=torch.Generator().manual_seed(0))], "fp8")

    def stored(main_of):
        return [
            {
                0: (
                    torch.tensor(c.n_tokens),
                    c.window_tail(128),
                    pack_pool(c),
                    torch.arange(c.entries.shape[0]),
                    main_of(c.entries),
                    c.index_keys,
                )
            }
            for c in (caches[0] for caches in oracle.caches)
        ]

    def check(main_of):
        problems: list[str] = []
        equal, _ = _compare_caches(oracle, [SimpleNamespace(rank=0, stored=stored(main_of))], 128, 6e-2, problems)
        return equal, problems

    assert check(lambda m: m) == (True, [])
    nudged = lambda m: encode_main(decode_main(m, "fp8") * (1 + 1e-3), "fp8")  # noqa: E731
    equal, problems = check(nudged)
    assert not equal and not problems
    broken = lambda m: encode_main(decode_main(m, "fp8") + 1.0, "fp8")  # noqa: E731
    assert any("entries differs" in p for p in check(broken)[1])
    assert any("shape" in p for p in check(lambda m: m[1:])[1])


def test_the_keys_the_ranks_hold_rebuild_the_oracles_index_keys():
    """The top-k check's second reading (GPU runs) scores rows with the indexer keys the ranks hold:
    rebuilt from every rank's store they are the oracle's keys (byte-equal on CPU), and the scores
    with them are the oracle's own."""
    from reference_impl.families.deepseek_v4.cache_layout import decode_index
    from reference_impl.families.deepseek_v4.check import rank_held_keys
    from reference_impl.runner import run_prefill

    run = RunConfig(
        preset="tiny-v4",
        cp_size=3,
        requests=(Request(0, 203), Request(29, 110)),
        chunk_size=71,
        device="cpu",
        compute_dtype="fp32",
        phases=PhaseSet.level(8),
    )
    result = run_prefill(run, tensors=True)
    assert result.report["matches_oracle"] is True
    layer = next(i for i, t in enumerate(run.model.layer_types) if t == "csa")
    for req in range(2):
        cache = result.oracle.caches[layer][req]
        keys = rank_held_keys(result.ranks, layer, req, cache)
        assert keys is not None and torch.equal(keys, decode_index(cache.index_keys, cache.codec, cache.index_head_dim))
        assert torch.equal(result.oracle.index_scores(layer, req, 5, keys), result.oracle.index_scores(layer, req, 5))
        held = [len(r.stored[layer][req][3]) if req in r.stored[layer] else 0 for r in result.ranks]
        first = held.index(max(held))
        dropped = [
            r if i != first else r.__class__(**{**r.__dict__, "stored": [{} for _ in r.stored]})
            for i, r in enumerate(result.ranks)
        ]
        assert rank_held_keys(dropped, layer, req, cache) is None  # an entry on no rank: no second reading


def test_the_rounding_tolerant_top_k_check_reads_the_band_on_the_keys_the_ranks_hold(monkeypatch):
    """GPU runs are judged by the rounding-tolerant rule. One rank's selection is edited to swap the
    row's k-th entry for its worst visible one: the oracle's scores put that far outside the band,
    so the check reports it; when the ranks' stored key of that entry is made the k-th's (as an FP4
    code flip would move it), the second reading, on the keys the ranks hold, accepts the swap."""
    from reference_impl.engine import build_metadata
    from reference_impl.families.deepseek_v4 import check as check_v4
    from reference_impl.families.deepseek_v4.model.sparse import index_scores
    from reference_impl.runner import run_prefill
    from reference_impl.workload import build_model

    run = RunConfig(
        preset="tiny-v4",
        cp_size=2,
        requests=(Request(0, 203),),
        device="cpu",
        compute_dtype="fp32",
        phases=PhaseSet.level(8),
    )
    result = run_prefill(run, tensors=True)
    oracle, ranks = result.oracle, result.ranks
    layer = next(i for i, t in enumerate(run.model.layer_types) if t == "csa")
    k = run.model.index_topk
    rank = ranks[-1]
    row = max(range(len(rank.token_ids)), key=lambda i: rank.token_ids[i])  # its last token sees the most entries
    pos = build_metadata(run).token_position[rank.token_ids[row]]
    visible = (pos + 1) // 4
    assert visible >= k + round(0.1 * k) + 3, "the row must see entries well past the band"
    scores = oracle.index_scores(layer, 0, pos)[:visible]
    order = scores.argsort(descending=True)
    kth, worst = int(order[k - 1]), int(order[-1])
    topk = rank.local_topk[layer]
    assert kth in topk[row].tolist() and worst not in topk[row].tolist()
    topk[row] = torch.where(topk[row] == kth, torch.full_like(topk[row], worst), topk[row])

    monkeypatch.setattr(check_v4, "exact_arithmetic", lambda *a: False)
    model, meta = build_model(run, torch.device("cpu")), build_metadata(run)

    def topk_problems() -> list[str]:
        agreement = check_v4.compare_v4(run, meta, model, oracle, ranks, torch.float32)
        return [p for p in agreement.problems if "top-k" in p]

    assert topk_problems(), "a swap far outside the band must be reported"
    for r in ranks:  # the ranks' key of the worst entry becomes the k-th's: a tie at the boundary
        if 0 in r.stored[layer]:
            n_tokens, tail, pool, ids, main, index = r.stored[layer][0]
            at = {int(e): i for i, e in enumerate(ids)}
            if worst in at and kth in at:
                index[at[worst]] = index[at[kth]]
            elif worst in at:
                index[at[worst]] = oracle.caches[layer][0].index_keys[kth]
    held = check_v4.rank_held_keys(ranks, layer, 0, oracle.caches[layer][0])
    assert torch.equal(held[worst], held[kth])
    q, w = (
        oracle.projections[layer][0].index_q[pos : pos + 1],
        oracle.projections[layer][0].index_weights[pos : pos + 1],
    )
    assert index_scores(q, w, held)[0, worst] == index_scores(q, w, held)[0, kth]
    assert topk_problems() == []
