"""The layer-wise PD send through the Mooncake Transfer Engine on CUDA: the staged blocks written
into a decode pool in GPU memory, registered directly, and the multi-process driver. Skipped where
the Mooncake wheel does not import (its reason); the CUDA build (``mooncake-transfer-engine-cuda13``)
writes GPU memory, the CPU one does not."""

from __future__ import annotations

import pytest
import torch

from gpu.conftest import PREFIX, V32
from reference_impl.config import PhaseSet, Request
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import replay_page_table, run_rank
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpDecodeShard, DcpLayout
from reference_impl.pd.mooncake import MooncakeReceiver, MooncakeTransport
from reference_impl.pd.mooncake_engine import MooncakeEngine, mooncake_unavailable
from reference_impl.pd.stream import LayerStreamer
from reference_impl.prefill_decode import run_prefill_and_decode

UNAVAILABLE = mooncake_unavailable()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_ranks,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
]


def test_one_rank_of_eight_writes_into_a_gpu_pool_without_a_host_sync() -> None:
    """Rank 0 of C = 8 at level 8: its staged blocks written into a registered GPU pool equal the
    rows at rest; the layer loop keeps zero host syncs."""
    run = V32.replace(cp_size=8, phases=PhaseSet.level(8), check=False, requests=(Request(0, 8192),))
    prefill, decode = MooncakeEngine.start(), MooncakeEngine.start()
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    shard = DcpDecodeShard(0, DcpLayout(1, 1), layout, run.model.n_layers, 8192 // 64, "cuda")
    shard.admit(0, 8192)
    receiver = MooncakeReceiver(shard, decode, [0])
    transport = MooncakeTransport(prefill, receiver.target, rank=0)
    streamer = LayerStreamer(transport, decode_rank=8)
    result = run_rank(LoopbackGroup(0, 8, "cuda"), run, keep_store=True, on_layer_stored=streamer)
    streamer.wait_all()
    receiver.wait([0], [0], run.model.n_layers, deadline_s=60)
    transport.close()
    assert result.stats["host_syncs_in_layer_loop"] == 0
    locs = replay_page_table(run).locs(0, "cuda")
    for layer in range(run.model.n_layers):
        positions, mla, index, scale = result.store.stored_rows(layer, [locs])[0]
        slots = shard.locs(0, positions).cuda()
        k_fp8, k_scale = shard.pool.read_index(layer, slots)
        assert torch.equal(shard.pool.read_mla(layer, slots), mla)
        assert torch.equal(k_fp8.view(torch.uint8), index) and torch.equal(k_scale, scale)
    receiver.close()


def test_the_pd_driver_over_mooncake_on_the_gpu_delivers_the_rows_at_rest() -> None:
    run = V32.replace(phases=PhaseSet.level(8), requests=PREFIX)
    result = run_prefill_and_decode(run, transfer="rows", transport="mooncake")
    assert result.matches_oracle, result.problems  # on CUDA: against the prefill ranks' rows at rest
    assert result.transport == "mooncake" and result.protocol in ("tcp", "rdma")
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
