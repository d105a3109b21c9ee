"""A KV pool that lives across batches: batches in sequence on one pool per rank, shared prefixes
reused by reference (radix-style), pages freed between batches.

``--batches "0+96,40+70;r0:64+50,13+37;r1:40+20"``: requests are numbered across the run (r0..r4);
r2 starts with the first 64 tokens of r0 and r4 with the first 40 of r1. The check compares every
request's cache with the oracle's, including requests whose pages were freed (their rows are read
before the pages go back).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, RunConfig, parse_batches
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.engine import replay_page_table, run_id_space, run_rank
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable
from reference_impl.schedule import chunk_schedule, frees_after_batch

SPEC = "0+96,40+70;r0:64+50,13+37;r1:40+20"
REQUESTS, SIZES = parse_batches(SPEC)
PAGE = 16


def pool_run(**changes) -> RunConfig:  # noqa: ANN003
    return tiny(requests=tuple(REQUESTS), batch_sizes=SIZES, page_size=PAGE, **changes)


def test_the_spec() -> None:
    assert SIZES == (2, 2, 1)
    assert [(r.prefix, r.extend, r.shares) for r in REQUESTS] == [
        (0, 96, None),
        (40, 70, None),
        (64, 50, 0),
        (13, 37, None),
        (40, 20, 1),
    ]
    run = pool_run()
    assert [run.batch_of(i) for i in range(5)] == [0, 0, 1, 1, 2]
    # r0 goes after batch 1 (r2 shared it there); r1 stays for r4; the last batch's stay to the end.
    assert frees_after_batch(run) == {1: [0, 2, 3], 2: [1, 4]}
    assert [(c.batch, c.requests, c.last_of_batch) for c in chunk_schedule(run.replace(chunk_size=60))] == [
        (0, (0, 1), False),
        (0, (0, 1), True),
        (1, (2, 3), True),
        (2, (4,), True),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        "0+96;r1:4+5",  # r1 is not of an earlier batch
        "0+96;r0:97+5",  # longer than r0
        "0+96;;1",  # an empty batch
        "0+96;rx:4+5",  # not a request number
        "0+96;r0:5",  # no extend
    ],
)
def test_bad_specs_are_one_line_exit_2(capsys, bad: str) -> None:
    assert main(["run", "--batches", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_batches_and_requests_are_exclusive(capsys) -> None:
    assert main(["run", "--batches", "0+9", "--requests", "0+9"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize(
    "changes",
    [
        {"phases": PhaseSet.level(0)},
        {"phases": PhaseSet.level(5)},
        {"phases": PhaseSet.level(8)},
        {"phases": PhaseSet.level(8), "chunk_size": 30, "cp_size": 3},
        {"phases": PhaseSet.parse("+1,2,3,6,7,8"), "split_mode": "round-robin"},
    ],
    ids=["level0", "level5", "level8", "level8-chunked-c3", "round-robin"],
)
def test_several_batches_with_frees_and_shared_prefixes_match_the_oracle(report_of, changes: dict) -> None:
    rep = report_of(pool_run(**changes))
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    occupancy = rep["pool_occupancy"]
    assert [o["batch"] for o in occupancy] == [0, 1, 2]
    assert [o["requests_freed"] for o in occupancy] == [0, 3, 0]
    assert occupancy[1]["pages_in_use_after_frees"] < occupancy[1]["pages_in_use"]
    assert rep["config"]["batch_sizes"] == [2, 2, 1]


def test_shared_pages_are_referenced_and_freed_ids_reused() -> None:
    run = pool_run(phases=PhaseSet.level(2))
    table = replay_page_table(run)
    assert table.requests == [1, 4]  # r0, r2, r3 were freed after batch 1
    # r4 = r1:40+20 takes r1's two whole pages by reference; its 8-token tail is in a fresh page.
    assert table.pages(4)[:2] == table.pages(1)[:2] and table.pages(4)[2] not in table.pages(1)
    all_pages = sum(-(-r.total // PAGE) for r in REQUESTS)
    assert run_id_space(table) < all_pages  # the pool is smaller than every request's pages at once


def test_a_shared_prefix_installs_only_its_tail(monkeypatch) -> None:
    writes: list[tuple[int, int, int]] = []
    original = ShardedKV.write_prefix

    def recording(self, layer, request, rows, k_fp8, k_scale, start=0):  # noqa: ANN001
        if layer == 0:
            writes.append((self.batch.meta.prefix_lens[request], start, rows.shape[0]))
        return original(self, layer, request, rows, k_fp8, k_scale, start)

    monkeypatch.setattr(ShardedKV, "write_prefix", recording)
    run_rank(CPGroup.single("cpu"), pool_run(cp_size=1, phases=PhaseSet.level(2)))
    # (prefix, first position written, rows written): r1 whole; r2 = r0:64+50 shares 4 whole pages,
    # nothing to write; r3 whole; r4 = r1:40+20 shares 2 pages, writes its 8-token tail.
    assert writes == [(40, 0, 40), (13, 0, 13), (40, 32, 8)]


def test_a_page_goes_back_when_its_last_holder_is_freed() -> None:
    table = RequestPageTable(PageAllocator(8, 4))
    table.extend("a", 10)  # pages 0, 1, 2 (the last one partial)
    assert table.share("b", "a", 9) == 8  # two whole pages by reference, a fresh one for the 9th token
    assert table.pages("b")[:2] == [0, 1] and table.pages("b")[2] == 3
    table.free("a")
    assert table.allocator.n_free == 8 - 3  # pages 0, 1 (held by b) and 3 stay
    table.free("b")
    assert table.allocator.n_free == 8 and table.allocator.high_water == 4
    with pytest.raises(ConfigError, match="has 0 tokens|unknown request"):
        table.share("c", "a", 4)


def test_the_page_transfer_refuses_several_batches() -> None:
    """The page transfer mirrors one batch's page ids; the row transfer streams several
    (``tests/test_pd_rows.py::test_a_run_of_several_batches_streams_every_request_freed_ones_included``)."""
    from reference_impl.prefill_decode import run_prefill_and_decode

    with pytest.raises(ConfigError, match="several batches"):
        run_prefill_and_decode(pool_run(phases=PhaseSet.level(2)), transfer="pages")


def test_a_single_batch_run_is_unchanged() -> None:
    """No batch_sizes: one batch, nothing freed, the occupancy reports it."""
    run = tiny(page_size=PAGE)
    table = replay_page_table(run)
    assert table.requests == [0, 1] and run.batch_of(1) == 0
    assert torch.equal(table.locs(0), torch.arange(96))


def test_a_chain_of_shared_prefixes(report_of) -> None:
    """r1 shares r0's prefix, r2 shares r1's (which includes r0's pages), r3 shares r0 again two
    batches later: the page references keep every shared page until its last holder is freed."""
    requests, sizes = parse_batches("0+96;r0:64+50;r1:100+10,r0:20+5")
    rep = report_of(tiny(requests=tuple(requests), batch_sizes=sizes, page_size=PAGE, phases=PhaseSet.level(5)))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    table = replay_page_table(
        tiny(requests=tuple(requests), batch_sizes=sizes, page_size=PAGE, phases=PhaseSet.level(5))
    )
    assert table.pages(2)[:4] == table.pages(1)[:4] == table.pages(0)[:4]  # r0's pages, through r1
    assert table.pages(3)[:1] == table.pages(0)[:1]
