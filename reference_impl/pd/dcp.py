"""Prefill -> a decode-context-parallel (DCP) decode: token shards, sent per request.

A DCP decode of size ``C_d`` with interleave ``I_d`` (vLLM's ``--cp-kv-cache-interleave-size``)
keeps token ``t`` of every request on decode rank ``(t // I_d) % C_d``, packed in position order:
local row ``(t // (I_d * C_d)) * I_d + t % I_d`` of that request. Each decode rank allocates the
pages for its share itself (its own :class:`~reference_impl.kvcache.allocator.PageAllocator`, ids
unrelated to the prefill's) and maps each request's local rows onto them.

Each prefill rank sends, per layer and request, the rows it stores (positions, MLA bytes, index
bytes, scale, from :meth:`~reference_impl.cp.kv_sharded.ShardedKV.stored_rows`), each to the decode
rank that keeps it: bytes sent equal the request's bytes at rest, no hole and no page padding.

* **Matching layouts** (prefill sharded at interleave ``I`` following positions, decode of the
  same ``C`` and ``I``; round-robin at interleave 1 is the case): prefill rank ``r`` holds exactly
  decode rank ``r``'s share, in its local order, so every row goes to the same-numbered rank at the
  next local row: no re-layout (:attr:`DcpTransferStats.relaid_rows` is 0).
* **Otherwise** (in-seq's page interleave, another ``C_d`` or ``I_d``): rows are routed by position
  to the decode rank that keeps them and land at their local row there: a re-layout, counted.

:func:`transfer_to_dcp` moves the blocks in-process (the shards are objects of one process, as in
:func:`reference_impl.pd.transfer.transfer_in_process`); each one is a
:class:`~reference_impl.pd.transport.RowBlock`, what a :class:`~reference_impl.pd.transport.BlockTransport`
sends between processes (:func:`reference_impl.prefill_decode.run_prefill_and_decode` with
``transfer="rows"`` drives a one-rank decode that way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.kv_store import StoredRows
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool

from .transfer import RequestRows
from .transport import RowBlock


@dataclass(frozen=True)
class DcpLayout:
    """Where a DCP decode keeps token ``t`` of a request: rank ``(t // I) % C``, local row
    ``(t // (I C)) I + t % I``."""

    cp_size: int
    interleave: int

    def __post_init__(self) -> None:
        if self.cp_size < 1 or self.interleave < 1:
            raise ConfigError(
                f"a DCP decode needs cp_size >= 1 and interleave >= 1, got {self.cp_size}, {self.interleave}"
            )

    def rank_of(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions // self.interleave) % self.cp_size

    def local_row(self, positions: torch.Tensor) -> torch.Tensor:
        i = self.interleave
        return (positions // (i * self.cp_size)) * i + positions % i

    def share(self, n_tokens: int, rank: int) -> int:
        """How many of a request's ``n_tokens`` positions decode rank ``rank`` keeps."""
        return int((self.rank_of(torch.arange(n_tokens)) == rank).sum())


class DcpDecodeShard:
    """One decode rank's KV: its own pool and allocator, one page table entry per request."""

    def __init__(
        self,
        rank: int,
        layout: DcpLayout,
        kv_layout: KVLayout,
        n_layers: int,
        n_pages: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rank, self.layout, self.kv_layout = rank, layout, kv_layout
        self.pool = PagedKVPool(n_layers, n_pages, kv_layout.page_size, kv_layout, device, debug=True)
        self.table = RequestPageTable(PageAllocator(n_pages, kv_layout.page_size))
        self.requests: list[int] = []
        self.bytes_received = 0
        self._written = torch.zeros(n_layers, n_pages * kv_layout.page_size, dtype=torch.int32)

    def admit(self, request: int, n_tokens: int) -> None:
        """Allocate this rank's pages for its share of a request of ``n_tokens`` tokens."""
        self.table.extend(request, self.layout.share(n_tokens, self.rank))
        self.requests.append(request)

    def locs(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        """This rank's slots (``int64 [n]``, host) of a request's ``positions`` (every one must be this rank's)."""
        positions = positions.cpu()
        if bool((self.layout.rank_of(positions) != self.rank).any()):
            raise ConfigError(f"decode rank {self.rank} request {request}: a row block holds another rank's positions")
        return self.table.locs(request).index_select(0, self.layout.local_row(positions))

    def _count(self, layer: int, request: int, locs: torch.Tensor) -> None:
        if bool((self._written[layer, locs] > 0).any()):
            raise ConfigError(f"decode rank {self.rank} layer {layer} request {request}: a row arrived twice")
        self._written[layer, locs] += 1

    def receive(self, block: RowBlock) -> None:
        """Install a row block at its positions' local rows (every position must be this rank's)."""
        layer, request = block.layer, block.request
        if block.has_index != self.pool.has_index(layer):
            raise ConfigError(
                f"decode rank {self.rank} layer {layer} request {request}: the block "
                f"{'carries' if block.has_index else 'lacks'} index K, the decode's layout (its IndexShare pattern) "
                "says otherwise"
            )
        locs = self.locs(request, block.positions)
        self._count(layer, request, locs)
        device = self.pool.device
        locs = locs.to(device)
        self.pool.write_mla(layer, locs, block.mla.to(device))
        if block.has_index:
            self.pool.write_index(layer, locs, block.index.to(device).view(torch.float8_e4m3fn), block.scale.to(device))
        self.bytes_received += block.payload_bytes

    def landed(self, request: int, positions: torch.Tensor, layers: Sequence[int], nbytes: int) -> None:
        """Account for rows that a one-sided transport wrote into this pool itself (every layer of
        ``layers`` at ``positions``): the same exactly-once bookkeeping as :meth:`receive`."""
        locs = self.locs(request, positions)
        for layer in layers:
            self._count(layer, request, locs)
        self.bytes_received += nbytes

    def rows(self, layer: int, request: int) -> RequestRows:
        """The request's rows on this rank, in local order: ``(mla uint8, index fp8 bytes uint8, scale f32)``;
        on an IndexShare shared layer the index parts are empty (``[n, 0]``, ``[0]``): it keeps none."""
        locs = self.table.locs(request).to(self.pool.device)
        if not self.pool.has_index(layer):
            mla = self.pool.read_mla(layer, locs)
            return mla, mla.new_empty(mla.shape[0], 0), mla.new_empty(0).float()
        k_fp8, k_scale = self.pool.read_index(layer, locs)
        return self.pool.read_mla(layer, locs), k_fp8.view(torch.uint8), k_scale

    def check_complete(self, n_layers: int) -> None:
        """Raise :class:`ConfigError` unless every row of every admitted request arrived exactly once."""
        for request in self.requests:
            locs = self.table.locs(request)
            counts = self._written[:n_layers, locs]
            if bool((counts != 1).any()):
                layer, row = (counts != 1).nonzero()[0].tolist()
                raise ConfigError(
                    f"decode rank {self.rank} request {request}: layer {layer} local row {row} is missing"
                )


@dataclass
class DcpTransferStats:
    """What one prefill rank sent."""

    rank: int
    bytes_sent: int = 0
    rows_sent: int = 0
    relaid_rows: int = 0  # rows that went to another decode rank, or not to the next local row of the same-numbered one
    to_ranks: set[int] = field(default_factory=set)


def transfer_to_dcp(
    stored: Sequence[Sequence[StoredRows]],
    request_lens: Sequence[int],
    decode: DcpLayout,
    kv_layout: KVLayout,
    pages_per_rank: int,
    device: torch.device | str = "cpu",
) -> tuple[list[DcpDecodeShard], list[DcpTransferStats]]:
    """Move every prefill rank's stored rows (``stored[rank][layer]``, as ``stored_rows`` returns them)
    into a fresh DCP decode of ``decode.cp_size`` ranks; returns the shards and per prefill rank what it sent."""
    n_layers = len(stored[0]) if stored else 0
    shards = [DcpDecodeShard(d, decode, kv_layout, n_layers, pages_per_rank, device) for d in range(decode.cp_size)]
    for shard in shards:
        for request, n_tokens in enumerate(request_lens):
            shard.admit(request, n_tokens)
    stats = [DcpTransferStats(rank) for rank in range(len(stored))]
    for rank, per_layer in enumerate(stored):
        for layer, per_request in enumerate(per_layer):
            for request, (positions, mla, index, scale) in per_request.items():
                positions = positions.cpu()
                target, local = decode.rank_of(positions), decode.local_row(positions)
                for d in torch.unique(target).tolist():
                    pick = (target == d).nonzero().flatten()
                    rows = mla.index_select(0, pick)
                    block = RowBlock(
                        request,
                        layer,
                        positions.index_select(0, pick),
                        rows,
                        # IndexShare: a shared layer's stored rows hold no index K (None)
                        rows.new_empty(rows.shape[0], 0) if index is None else index.index_select(0, pick),
                        rows.new_empty(0).float() if scale is None else scale.index_select(0, pick),
                    )
                    shards[d].receive(block)
                    stats[rank].bytes_sent += block.payload_bytes
                    stats[rank].rows_sent += int(pick.numel())
                    stats[rank].to_ranks.add(d)
                in_place = (target == rank) & (local == torch.arange(positions.numel()))
                stats[rank].relaid_rows += int((~in_place).sum())
    for shard in shards:
        shard.check_complete(n_layers)
    return shards, stats
