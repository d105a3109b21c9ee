"""The layer-wise send's parts on CPU: the streamer over an in-process transport, the transport's
wait for a staging event, and the check that compares the decode's rows with the rows at rest.
The CUDA leg (side stream, pinned host memory, the overlap figures) runs in the GPU tier:
``tests/gpu/test_gpu_pd_stream.py``."""

from __future__ import annotations

import time

import pytest
import torch

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import replay_page_table, run_rank
from reference_impl.launch import launch
from reference_impl.pd.stream import LayerStreamer
from reference_impl.pd.transport import InProcessTransport, RowBlock, TorchDistributedTransport
from reference_impl.prefill_decode import store_mismatches

REQUESTS = (Request(37, 70), Request(0, 45))


@pytest.mark.parametrize("level", [2, 5, 8])
def test_the_streamer_delivers_every_row_a_rank_holds_once_per_layer(level: int) -> None:
    """Rank 1 of C = 4 alone (loopback): one block per (layer, request) reaches the decode's
    mailbox, in layer order, holding exactly the rows this rank stores at rest."""
    run = RunConfig(
        preset="tiny",
        cp_size=4,
        requests=REQUESTS,
        page_size=16,
        phases=PhaseSet.level(level),
        device="cpu",
        check=False,
    )
    transport = InProcessTransport(sender_rank=1)
    streamer = LayerStreamer(transport, decode_rank=4)
    result = run_rank(LoopbackGroup(1, 4, "cpu"), run, keep_store=True, on_layer_stored=streamer)
    table = replay_page_table(run)
    for layer in range(run.model.n_layers):
        for req in range(len(REQUESTS)):
            got = transport.recv(1, dst=4)
            assert (got.request, got.layer) == (req, layer)
            expect = result.store.stored_rows(layer, [table.locs(req)])[0]
            assert all(torch.equal(a, b) for a, b in zip((got.positions, got.mla, got.index, got.scale), expect))
    with pytest.raises(ConfigError, match="none was sent"):
        transport.recv(1, dst=4)
    assert streamer.wait_all() and streamer.overlap is None  # CPU: no staging, nothing to overlap
    assert streamer.blocks_sent == run.model.n_layers * len(REQUESTS)


def test_the_check_names_a_decode_row_that_differs_from_the_rows_at_rest() -> None:
    positions = [torch.tensor([0, 2]), torch.tensor([1])]  # two ranks' positions of one 3-token request
    rows = [
        torch.arange(6, dtype=torch.uint8).view(3, 2),
        torch.arange(3, dtype=torch.uint8).view(3, 1),
        torch.arange(3, dtype=torch.float32),
    ]
    stored = [[{0: (p, *(r[p] for r in rows))}] for p in positions]  # per rank, per layer
    assert store_mismatches([{0: tuple(rows)}], stored) == []
    bad = (rows[0].clone(), rows[1], rows[2])
    bad[0][2, 1] += 1
    assert store_mismatches([{0: bad}], stored) == [
        "layer 0 request 0: decode rows differ from the prefill ranks' rows at rest"
    ]
    twice = [stored[0], stored[0]]
    assert "exactly once" in store_mismatches([{0: tuple(rows)}], twice)[0]


class _SlowCopy:
    """Stands in for a staging event: the block's bytes land only when ``synchronize`` returns."""

    def __init__(self, block: RowBlock) -> None:
        self.block = block

    def synchronize(self) -> None:
        time.sleep(0.3)
        self.block.mla.fill_(7)


def _staged_send(group: CPGroup, _: None) -> tuple[float, list[int]]:
    transport = TorchDistributedTransport("cpu")
    if group.rank == 0:
        block = RowBlock(
            3,
            1,
            torch.arange(4),
            torch.zeros(4, 8, dtype=torch.uint8),
            torch.zeros(4, 2, dtype=torch.uint8),
            torch.ones(4),
        )
        start = time.perf_counter()
        pending = transport.isend(block, 1, ready=_SlowCopy(block))  # type: ignore[arg-type]
        returned_after = time.perf_counter() - start
        pending.wait()
        transport.close()
        return returned_after, []
    got = transport.recv(0)
    return 0.0, [got.request, got.layer, *got.mla.flatten().tolist()]


def test_a_staged_block_leaves_only_when_its_bytes_are_there_and_the_caller_never_waits() -> None:
    (returned_after, _), (_, received) = launch(_staged_send, 2, None, device="cpu", backend="gloo", timeout_s=60)
    assert returned_after < 0.1  # isend returned before the copy "landed"
    assert received == [3, 1] + [7] * 32  # what went on the wire is what the copy wrote, not the zeros before


def test_the_stream_bench_dry_run_checks_what_arrived(tmp_path) -> None:  # noqa: ANN001
    import json

    from reference_impl.bench import pd_stream

    out = tmp_path / "pd_stream.json"
    assert (
        pd_stream.main(
            [
                "--out",
                str(out),
                "--device",
                "cpu",
                "--preset",
                "tiny",
                "--cp-size",
                "4",
                "--workloads",
                "a:0+96,b:64+40",
                "--repeats",
                "1",
                "--layers",
                "2",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert [w["received_equal_rows_at_rest"] for w in doc["workloads"]] == [True, True]
    assert all(w["bytes_sent_per_layer"] > 0 and w["staging_ms_per_layer"] is None for w in doc["workloads"])
    with pytest.raises(SystemExit):
        pd_stream.main(["--out", str(out), "--device", "cpu", "--level", "1"])  # nothing sharded to stream
