"""The serving-shaped PD transfer: row blocks by request position, a decode that allocates its own pages.

C prefill processes and one decode process over gloo (:func:`run_prefill_and_decode` with
``transfer="rows"``); the decode cache is compared with the oracle byte for byte.
"""

from __future__ import annotations

import json

import pytest
import torch

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.pd.transport import RowBlock
from reference_impl.prefill_decode import run_prefill_and_decode

MIXED = (Request(37, 70), Request(0, 45), Request(5, 9))  # prefixes 37 and 5 end mid-page


def pd_run(**changes) -> RunConfig:  # noqa: ANN003
    base = RunConfig(preset="tiny", cp_size=2, requests=MIXED, page_size=16, phases=PhaseSet.level(3), device="cpu")
    return base.replace(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # prefixed
        {"chunk_size": 20, "cp_size": 3},  # chunked
        {"phases": PhaseSet.level(5), "chunk_size": 30},  # phase 5: lanes leave holes in the prefill's page ids
        {"split_mode": "round-robin", "cp_size": 4, "phases": PhaseSet.parse("+1,2,3,6,7,8")},  # interleave 1
    ],
    ids=["prefixed", "chunked", "phase5-chunked", "round-robin"],
)
def test_rows_transfer_matches_the_oracle_with_no_holes(changes: dict) -> None:
    run = pd_run(**changes)
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems
    assert result.manifests == ()  # no page ids travel
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert all(s.blocks_sent == run.model.n_layers * len(MIXED) for s in result.sent)
    assert sum(s.rows_sent for s in result.sent) == run.model.n_layers * sum(r.total for r in MIXED)
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent)
    # The decode's pages: its own, just enough for each request's tokens.
    assert [len(p) for p in result.decode_pages] == [-(-r.total // 16) for r in MIXED]


def test_the_decode_page_ids_are_its_own() -> None:
    """Phase 5 allocates the prefill's pages in compute-rank lanes (ids with holes); the decode
    allocates lowest-first from its own allocator: the ids differ and the bytes still match."""
    from reference_impl.engine import replay_page_table

    run = pd_run(phases=PhaseSet.level(5), cp_size=4)
    result = run_prefill_and_decode(run, transfer="rows")
    prefill = replay_page_table(run)
    assert result.matches_oracle
    assert [list(p) for p in result.decode_pages] != [prefill.pages(req) for req in range(len(MIXED))]
    assert sorted(p for pages in result.decode_pages for p in pages) == list(
        range(sum(len(p) for p in result.decode_pages))
    )


def test_rows_send_fewer_bytes_than_pages_when_pages_are_partial() -> None:
    run = pd_run()
    rows, pages = run_prefill_and_decode(run, transfer="rows"), run_prefill_and_decode(run, transfer="pages")
    assert rows.matches_oracle and pages.matches_oracle
    assert rows.bytes_received < pages.bytes_received  # the empty slots of partial pages stay home


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="transfer='wire'"):
        run_prefill_and_decode(pd_run(), transfer="wire")
    with pytest.raises(ConfigError, match="needs phase 2"):
        run_prefill_and_decode(pd_run(phases=PhaseSet.level(1)), transfer="rows")
    with pytest.raises(ConfigError, match="whole owned pages"):
        run_prefill_and_decode(pd_run(split_mode="round-robin", phases=PhaseSet.level(2)), transfer="pages")
    with pytest.raises(ConfigError, match="page transfer runs on CPU"):
        run_prefill_and_decode(pd_run(device="cuda"), transfer="pages")
    with pytest.raises(ConfigError, match="disagree on the row count"):
        RowBlock(
            0,
            0,
            torch.arange(3),
            torch.zeros(2, 8, dtype=torch.uint8),
            torch.zeros(3, 4, dtype=torch.uint8),
            torch.zeros(3),
        )


def test_the_pd_command(capsys) -> None:
    argv = ["pd", "--cp-size", "2", "--requests", "37+70,5+9", "--page-size", "16", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode_matches_oracle"] is True and doc["transfer"] == "rows" and doc["phases"] == "1,2"
    assert doc["decode_matches_prefill"] is True  # and the rows at rest, byte for byte
    assert all(r["staging_ms"] is None for r in doc["prefill_ranks"])  # CPU: no side stream
    assert all(r["bytes_sent"] == r["bytes_at_rest"] for r in doc["prefill_ranks"])
    assert main(["pd", "--split-mode", "round-robin", "--transfer", "pages", "--page-size", "16"]) == 2
    assert "whole owned pages" in capsys.readouterr().err


def test_the_send_streams_from_inside_the_layer_loop_without_host_syncs() -> None:
    """Debug mode and phase 6: a host sync in the layer loop would raise; the streamed blocks
    leave from inside the loop (one per layer and finished request) and the decode still matches."""
    run = pd_run(phases=PhaseSet.level(8), debug=True, chunk_size=30)
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems
    assert all(p.stats["host_syncs_in_layer_loop"] == 0 for p in result.prefill)
    assert all(s.blocks_sent_in_layer_loop == s.blocks_sent == run.model.n_layers * len(MIXED) for s in result.sent)
    assert all(len(s.wait_ms_after_prefill) == len(MIXED) for s in result.sent)  # one wait per request


def test_the_engine_hook_hears_each_layer_of_each_chunk_and_the_finished_requests() -> None:
    from reference_impl.cp.comm import CPGroup
    from reference_impl.engine import run_rank

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def begin_chunk(self, store, finished) -> None:  # noqa: ANN001
            self.calls.append(
                ("chunk", tuple(sorted(finished)), {r: int(locs.numel()) for r, locs in finished.items()})
            )

        def layer_stored(self, layer: int) -> None:
            self.calls.append(("layer", layer))

        def loop_done(self) -> None:
            self.calls.append(("done",))

    run = pd_run(cp_size=1, chunk_size=30, phases=PhaseSet.level(2))  # extends 70, 45, 9: chunks of 30
    recorder = Recorder()
    run_rank(CPGroup.single("cpu"), run, on_layer_stored=recorder)
    layers = [("layer", layer) for layer in range(run.model.n_layers)]
    # Chunk 1 finishes request 2 (9 tokens); chunk 2 request 1 (45); chunk 3 request 0 (70).
    assert recorder.calls == [
        ("chunk", (2,), {2: 14}),
        *layers,
        ("done",),
        ("chunk", (1,), {1: 45}),
        *layers,
        ("done",),
        ("chunk", (0,), {0: 107}),
        *layers,
        ("done",),
    ]


@pytest.mark.parametrize("level", [2, 5, 8])
def test_a_run_of_several_batches_streams_every_request_freed_ones_included(level: int) -> None:
    """``--batches`` with PD: requests of earlier batches (their pages freed, or shared by
    reference with a later request) are sent as they finish; the decode gets every request's rows,
    shared prefixes copied into its own pages, byte-equal to the oracle, bytes sent = at rest."""
    from reference_impl.config import parse_batches

    requests, sizes = parse_batches("0+40,21+30;r0:32+20,5+9;r2:16+8")
    run = pd_run(requests=tuple(requests), batch_sizes=sizes, phases=PhaseSet.level(level), cp_size=3)
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert all(s.blocks_sent == run.model.n_layers * len(requests) for s in result.sent)
    assert [len(p) for p in result.decode_pages] == [-(-r.total // 16) for r in requests]
    with pytest.raises(ConfigError, match="use transfer='rows'"):
        run_prefill_and_decode(run, transfer="pages")
