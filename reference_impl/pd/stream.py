"""A prefill rank's layer-wise send: each layer's rows leave as soon as the layer is stored.

:class:`LayerStreamer` is an engine :class:`~reference_impl.engine.LayerStoredHook`. Before a
chunk's layer loop it plans, per request that the chunk finishes, the rows this rank holds
(request positions, physical rows) and the blocks' headers; inside the loop, right after layer
``l`` is stored, it posts one non-blocking send per finished request, so the send overlaps the
rest of layer ``l`` and layer ``l + 1``; after its last layer, the request's ``transport.complete``
(the notice a one-sided transport sends the decode); after the prefill,
:meth:`LayerStreamer.wait_all` makes one completion wait per request.

On CUDA the reads and the device-to-host copy run on a side stream
(:class:`~reference_impl.pd.staging.SideStreamStaging`) and the transport sends the staged bytes
when they are there, so the layer loop neither waits nor syncs; :attr:`LayerStreamer.overlap`
then says how much of that staging ran before the layer loop ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.kv_store import KVStore
from reference_impl.pd.staging import Overlap, SideStreamStaging, overlap
from reference_impl.pd.transport import BlockTransport, Pending, RowBlock, headers


class LayerSends:
    """What every layer-wise send does besides choosing its rows (:class:`LayerStreamer`'s DSA rows, a
    family's cache parts, :class:`~reference_impl.pd.payload.PartStreamer`): post each block, read and
    staged on a side stream on CUDA; post a request's completion after its last block; wait once per request."""

    def __init__(self, transport: BlockTransport, decode_rank: int) -> None:
        self.transport, self.decode_rank = transport, decode_rank
        self.pending: dict[int, list[Pending]] = {}
        self.staging: SideStreamStaging | None = None  # CUDA only
        self.loop_end: torch.cuda.Event | None = None
        self.overlap: Overlap | None = None  # CUDA only, after wait_all
        self.bytes_sent = self.rows_sent = self.blocks_sent = 0

    def stage_on(self, device: torch.device) -> None:
        """Read and copy on a side stream from now on, where the store lives on a GPU."""
        if device.type == "cuda" and self.staging is None:
            self.staging = SideStreamStaging(device)

    def post(self, request: int, header: torch.Tensor, read: Callable[[], RowBlock]) -> RowBlock:
        """Send the block ``read`` returns (on CUDA: read and copied on the side stream, its allocations
        too, and sent once staged); the block, for its shapes."""
        if self.staging is not None:
            staged = self.staging.stage(read)
            block = staged.block
            sent = self.transport.isend(block, self.decode_rank, header, ready=staged.done)
        else:
            block = read()
            sent = self.transport.isend(block, self.decode_rank, header)
        self.pending.setdefault(request, []).append(sent)
        self.bytes_sent += block.payload_bytes  # from shapes: no device read
        self.rows_sent += block.n_rows
        self.blocks_sent += 1
        return block

    def finish(self, request: int) -> None:
        """The request's last block is posted: post its completion (the notice a one-sided transport sends)."""
        self.pending[request].append(self.transport.complete(request, self.decode_rank))

    def loop_done(self) -> None:
        if self.staging is not None:
            self.loop_end = torch.cuda.Event(enable_timing=True)
            self.loop_end.record()  # main stream: the layer loop's last kernel

    def wait_all(self) -> list[float]:
        """One completion wait per request (request order); the milliseconds each wait took."""
        waits = []
        for req in sorted(self.pending):
            start = time.perf_counter()
            for sends in self.pending[req]:
                sends.wait()
            waits.append((time.perf_counter() - start) * 1e3)
        if self.staging is not None and self.loop_end is not None:
            self.overlap = overlap(self.staging, self.loop_end)
        return waits


class LayerStreamer(LayerSends):
    """Streams a rank's stored rows, layer by layer, to ``decode_rank`` over ``transport``."""

    def __init__(self, transport: BlockTransport, decode_rank: int, header_device: torch.device | str = "cpu") -> None:
        super().__init__(transport, decode_rank)
        self.header_device = torch.device(header_device)
        self.store: ShardedKV | None = None
        self.plans: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # positions, physical, headers

    def begin_chunk(self, store: KVStore, finished: dict[int, torch.Tensor]) -> None:
        if not isinstance(store, ShardedKV):
            raise ConfigError("a layer-wise PD send needs KV sharded at rest (phase 2)")
        self.store = store
        self.stage_on(store.pool.device)
        layout, n_layers = store.layout, store.pool.n_layers
        self.plans = {}
        for req, locs in finished.items():
            positions, physical = store.owned_rows(locs)
            self.plans[req] = (
                positions,
                physical,
                headers(
                    req,
                    n_layers,
                    positions.numel(),
                    layout.mla_bytes,
                    layout.index_head_dim,
                    self.header_device,
                    index_layers=store.pool.index_layers,  # IndexShare: no index K on a shared layer
                ),
            )

    def layer_stored(self, layer: int) -> None:
        assert self.store is not None
        pool = self.store.pool
        for req, (positions, physical, header) in self.plans.items():

            def read(
                req: int = req, positions: torch.Tensor = positions, physical: torch.Tensor = physical
            ) -> RowBlock:
                mla = pool.read_mla(layer, physical)
                if not pool.has_index(layer):  # IndexShare: a shared layer keeps no index K, so ships none
                    return RowBlock(
                        req, layer, positions, mla, mla.new_empty(mla.shape[0], 0), mla.new_empty(0).float()
                    )
                k_fp8, k_scale = pool.read_index(layer, physical)
                return RowBlock(req, layer, positions, mla, k_fp8.view(torch.uint8), k_scale)

            self.post(req, header[layer], read)
            if layer == pool.n_layers - 1:  # the request's last block is posted
                self.finish(req)
