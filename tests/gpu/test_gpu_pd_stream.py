"""The layer-wise PD send on CUDA: the side-stream staging, its overlap figures, and the gloo
sender thread, against the rows the prefill holds at rest."""

from __future__ import annotations

import pytest
import torch

from gpu.conftest import PREFIX, V32
from reference_impl.config import PhaseSet, Request
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import replay_page_table, run_rank
from reference_impl.pd.stream import LayerStreamer
from reference_impl.pd.transport import InProcessTransport
from reference_impl.prefill_decode import run_prefill_and_decode

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]


def test_one_rank_of_eight_streams_from_a_side_stream_without_a_host_sync() -> None:
    """Rank 0 of C = 8 alone at level 8: every block staged on the side stream equals the rows at
    rest, the layer loop keeps zero host syncs, and the overlap figures are well formed."""
    run = V32.replace(
        cp_size=8, phases=PhaseSet.level(8), check=False, requests=(Request(4096, 8192), Request(0, 2048))
    )
    transport = InProcessTransport()
    streamer = LayerStreamer(transport, decode_rank=8)
    result = run_rank(LoopbackGroup(0, 8, "cuda"), run, keep_store=True, on_layer_stored=streamer)
    streamer.wait_all()
    assert result.stats["host_syncs_in_layer_loop"] == 0
    assert streamer.staging is not None and streamer.staging.stream != torch.cuda.current_stream()
    table = replay_page_table(run)
    for layer in range(run.model.n_layers):
        for req in range(len(run.requests)):
            got = transport.recv(0, dst=8)
            assert got.mla.is_pinned() and got.mla.device.type == "cpu"
            expect = result.store.stored_rows(layer, [table.locs(req, "cuda")])[0]
            assert all(torch.equal(a, b.cpu()) for a, b in zip((got.positions, got.mla, got.index, got.scale), expect))
    o = streamer.overlap
    assert o is not None and o.staging_ms > 0 and 0 <= o.hidden_fraction <= 1 and o.exposed_after_loop_ms >= 0


def test_the_pd_driver_on_the_gpu_delivers_the_rows_at_rest_byte_for_byte() -> None:
    """C = 2 prefill ranks and the decode share the GPU over gloo: the blocks go from pinned host
    memory through the sender thread; the decode equals the rows at rest, bytes sent = at rest."""
    run = V32.replace(phases=PhaseSet.level(8), requests=PREFIX)
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems  # on CUDA: against the prefill ranks' rows at rest
    assert not result.oracle_checked
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert all(s.staging_ms is not None and s.staging_ms > 0 for s in result.sent)
