"""The engines' competing KV designs as KV stores of this engine (``--kv-design``).

Each design (layer split, rotated page shard, DCP-interleave gather) agrees with the single-device
oracle at C = 2, 3, 4 on runs with prefixes that end mid-page, chunked prefill and several batches
(a shared prefix, a request freed between batches): outputs, top-k sets and the cache rebuilt from
every rank byte for byte; the ranks issue the same collectives, the design's own gathers among them,
and the layer loop syncs with the host zero times. Then each design's contract on its own: layer
ownership, the rotated allocator's cyclic owners and regular gather, the broadcast, and the
refusals of the knob.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.cli import main
from reference_impl.config import DESIGN_PHASES, KV_DESIGNS, ConfigError, PhaseSet, Request, RunConfig, parse_batches
from reference_impl.cp.batch import BatchLocs, new_page_table
from reference_impl.cp.designs import (
    RotatedShardKV,
    layer_owner,
    layer_shard_range,
    owners_cyclic,
    rotated_page_lanes,
)
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.cp.split import build_split
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable
from reference_impl.kvcache.layout import KVLayout
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefills

DESIGNS = [d for d in KV_DESIGNS if d != "phases"]
# Two batches on one pool: prefixes ending mid-page (pages of 16), a current-only request; then a
# request sharing r0's first 40 tokens (two whole pages by reference, a partial one written), and a
# fresh one; r1 is freed after the first batch, so the second allocates into its hole.
BATCHES = "0+45,37+30;r0:40+30,5+25"
DESIGN_RUN_PHASES = PhaseSet(frozenset({1, 7}))  # narrow output and the fused kernels beside the design


def _design_run(design: str, cp: int, **changes: object) -> RunConfig:
    requests, sizes = parse_batches(BATCHES)
    return tiny(
        cp_size=cp,
        kv_design=design,
        phases=DESIGN_RUN_PHASES,
        requests=tuple(requests),
        batch_sizes=sizes,
        chunk_size=16,
        page_size=16,
        **changes,
    )


CASES = [(d, cp, "in-seq") for cp in (2, 3, 4) for d in DESIGNS] + [(d, 2, "round-robin") for d in DESIGNS]


@pytest.fixture(scope="module")
def design_reports() -> dict[tuple[str, int, str], dict]:
    """Every design at C = 2, 3, 4 (in-seq) and C = 2 round-robin: one launch per C."""
    runs = {(d, cp, split): _design_run(d, cp, split_mode=split) for d, cp, split in CASES}
    return dict(zip(runs, run_prefills(list(runs.values()), timeout_s=600)))


@pytest.mark.parametrize(("design", "cp", "split"), CASES)
def test_each_design_matches_the_oracle(design_reports, design: str, cp: int, split: str) -> None:
    report = design_reports[(design, cp, split)]
    assert report["matches_oracle"], report["problems"]
    assert report["cache_equal"] and report["topk_agreement"] == 1.0
    assert report["config"]["kv_design"] == design and report["config"]["chunks"] > 2
    assert report["collectives_identical"] and report["store_path_identical"]
    ranks = report["per_rank"]
    assert [r["host_syncs_in_layer_loop"] for r in ranks] == [0] * cp
    # The design's own gathers ran (history or, for dcp-gather, every shard) and filled the views.
    assert all(r["gather_bytes"] > 0 and r["materialized_bytes"] > 0 for r in ranks)
    assert report["pool_occupancy"][0]["requests_freed"] == 1


def test_the_designs_store_what_they_promise(design_reports) -> None:
    """At rest: layer split holds whole layers on their owners; the shards hold about 1/C each."""
    split = design_reports[("layer-split", 3, "in-seq")]["per_rank"]
    # 2 layers over 3 ranks: ranks 0 and 1 own one layer each, rank 2 none.
    assert split[2]["kv_bytes"] == 0 and split[0]["kv_bytes"] == split[1]["kv_bytes"] > 0
    for design in ("rotated-shard", "dcp-gather"):
        ranks = design_reports[(design, 4, "in-seq")]["per_rank"]
        assert all(r["kv_bytes"] > 0 for r in ranks)
        assert max(r["kv_bytes"] for r in ranks) <= 2 * min(r["kv_bytes"] for r in ranks)


# ---- layer split ---------------------------------------------------------------------------------


def test_layer_ownership_is_contiguous_and_even() -> None:
    ranges = [layer_shard_range(r, 8, 61) for r in range(8)]
    assert [e - s for s, e in ranges] == [8, 8, 8, 8, 8, 7, 7, 7]
    assert ranges[0][0] == 0 and ranges[-1][1] == 61 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert [layer_owner(layer, 8, 61) for layer in (0, 7, 8, 60)] == [0, 0, 1, 7]
    assert [layer_shard_range(r, 8, 4) for r in range(8)][4:] == [(4, 4)] * 4  # more ranks than layers
    with pytest.raises(ConfigError, match="outside"):
        layer_owner(61, 8, 61)


# ---- rotated page shard -------------------------------------------------------------------------


def test_the_rotated_allocator_keeps_every_chain_cyclic_through_frees_and_shares() -> None:
    cp, page = 4, 16
    table = RequestPageTable(PageAllocator(64, page))

    def grow(req: int, tokens: int) -> None:
        table.extend(req, tokens, lanes=rotated_page_lanes(table, req, tokens, cp), n_lanes=cp)

    grow(0, 5 * page + 3)
    grow(1, 2 * page)
    grow(0, 3 * page)  # a later chunk continues the cycle
    table.free(1)
    grow(2, 7 * page)  # lands in the hole r1 left, in its own lanes
    table.share(3, 0, 3 * page)
    grow(3, 4 * page)  # continues r0's cycle after the shared pages
    for req in (0, 2, 3):
        assert owners_cyclic(table.pages(req), cp), (req, [p % cp for p in table.pages(req)])
    assert table.pages(2)[0] % cp == 2 and table.pages(0)[0] % cp == 0  # fresh chains start at their id mod C
    assert not owners_cyclic([0, 1, 3], 4) and owners_cyclic([3, 0, 1], 4)


def test_one_request_gathers_a_regular_block_and_translates_by_arithmetic() -> None:
    """One request of 11 history pages over C = 4: every rank sends ceil(11 / 4) = 3 pages (owners
    cyclic, trash-padded), and history page k of the plan lands at ``owner * 3 + k // 4``."""
    cp, page = 4, 16
    meta = build_split("in-seq", cp, [40], [11 * page - 5], page)
    table = new_page_table([11 * page + 35], page, cp, compute_owner=True)
    batch = BatchLocs.build(
        meta, "cpu", table=table, request_ids=(1,), id_space=table.allocator.n_pages, page_lanes=rotated_page_lanes
    )
    layout = KVLayout.from_config(get_preset("tiny"), "fp8", page)
    pages = table.pages(1)
    assert owners_cyclic(pages, cp) and pages[0] % cp == 1
    for rank in range(cp):
        store = RotatedShardKV(batch, layout, 1, LoopbackGroup(rank, cp, "cpu"), debug=True)
        assert store.cyclic and store.block == 3
        mine = [p // cp for p in pages[:11] if p % cp == rank]
        assert store._send.tolist() == mine + [store.trash_page] * (3 - len(mine))
        k_of = {p: k for k, p in enumerate(pages[:11])}
        expected = [(p % cp) * 3 + k_of[p] // cp for p in (batch.view_locs[: 11 * page - 5] // page).tolist()]
        assert (store._row_source // page).tolist() == expected


# ---- the broadcast ------------------------------------------------------------------------------


def test_the_broadcast_is_recorded_and_refuses_bad_input() -> None:
    rows = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    owner = LoopbackGroup(1, 3, "cpu")
    assert torch.equal(owner.broadcast_rows(rows.clone(), 1, "materialize"), rows)  # the source keeps its rows
    receiver = LoopbackGroup(0, 3, "cpu")
    receiver.broadcast_rows(rows.clone(), 1, "materialize")
    (sent,), (got,) = owner.stats, receiver.stats
    assert (sent.op, sent.bytes_sent, sent.bytes_received) == ("broadcast", 12, 0)
    assert (got.bytes_sent, got.bytes_received, got.buffer_bytes) == (0, 12, 12)
    with pytest.raises(ConfigError, match="source rank 3"):
        receiver.broadcast_rows(rows, 3, "x")
    with pytest.raises(ConfigError, match="contiguous"):
        receiver.broadcast_rows(rows.t(), 1, "x")


# ---- the knob -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "layer_split", "Phases", None, 1])
def test_a_design_outside_the_set_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="kv_design=.*use one of phases, layer-split, rotated-shard, dcp-gather"):
        tiny(kv_design=value)


@pytest.mark.parametrize("phases", ["2", "8", "1,2,3", "+2,6,7"])
def test_a_design_refuses_the_phases_it_replaces(phases: str) -> None:
    with pytest.raises(ConfigError, match=r"replaces the KV path of phases 2, 3, 5, 6 and 8"):
        tiny(kv_design="rotated-shard", phases=PhaseSet.parse(phases))


@pytest.mark.parametrize("design", DESIGNS)
def test_each_design_installs_a_prefix_of_several_chunks(monkeypatch: pytest.MonkeyPatch, design: str) -> None:
    """A prefix longer than one install chunk (the benchmark's 24K prefix is two of 16K): each chunk's
    rows land at their own positions, in every design."""
    from reference_impl.model import prefix_prefill

    monkeypatch.setattr(prefix_prefill, "PREFIX_CHUNK_TOKENS", 24)
    report = run_prefills(
        [
            tiny(
                cp_size=2,
                kv_design=design,
                phases=DESIGN_RUN_PHASES,
                page_size=16,
                requests=(Request(70, 30), Request(33, 20)),
            )
        ]
    )[0]
    assert report["matches_oracle"] and report["cache_equal"], report["problems"]


@pytest.mark.parametrize("design", DESIGNS)
def test_a_design_refuses_index_share(design: str) -> None:
    with pytest.raises(ConfigError, match=f"kv_design={design}: its stores keep indexer K on every layer.*FS"):
        tiny(kv_design=design, phases=DESIGN_RUN_PHASES, index_topk_pattern="FS")


@pytest.mark.parametrize("design", [d for d in KV_DESIGNS if d != "phases"])
def test_a_design_refuses_deepseek_v4s_compressed_caches(design: str) -> None:
    with pytest.raises(ConfigError, match=f"kv_design={design} is built for the DSA cache.*tiny-v4"):
        RunConfig(requests=(Request(0, 40),), cp_size=2, preset="tiny-v4", kv_design=design)


def test_a_design_runs_beside_phases_1_4_7_and_dcp_gather_takes_the_interleave() -> None:
    assert DESIGN_PHASES == {1, 4, 7}
    assert tiny(kv_design="layer-split", phases=PhaseSet(frozenset(DESIGN_PHASES))).kv_design == "layer-split"
    assert tiny(kv_design="dcp-gather").interleave == 1  # vLLM's default interleave
    assert tiny(kv_design="dcp-gather", kv_interleave=16).interleave == 16
    with pytest.raises(ConfigError, match="kv_interleave"):
        tiny(kv_design="layer-split", kv_interleave=16)


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--kv-design", "bogus"], {}, "--kv-design"),
        ([], {"DSACP_KV_DESIGN": ""}, "DSACP_KV_DESIGN"),
        ([], {"DSACP_KV_DESIGN": "vmm"}, "DSACP_KV_DESIGN"),
        (["--kv-design", "dcp-gather", "--phases", "3"], {}, "replaces the KV path"),
    ],
)
def test_the_cli_refuses_in_one_line(capsys, monkeypatch, argv: list[str], env: dict[str, str], words: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--cp-size", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err
