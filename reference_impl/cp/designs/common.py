"""What the competing KV designs share: the dense view they build, the owned rows they report, and
a one-layer-ahead gather pipeline.

Every design ends where the phases end: the attention and top-k code of this package read a dense,
sequence-ordered **full view** (bf16 MLA rows, FP8 index K and scales), so each design's
materialization writes that view. The pipeline (:class:`LayerAhead`) runs a design's per-layer
gather for layer ``l + 1`` while layer ``l`` computes: on a CUDA side stream with two alternating
slots (the stream and event rules of :mod:`reference_impl.cp.prefetch`), inline on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.fused_ops import fill_current_rows, fused_store, materialize_rows
from reference_impl.cp.kv_store import FullView, PoolBytesAtRest, StoredRows
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.prefetch import CudaSideStream, InlineStream, Stream
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


def empty_view(batch: BatchLocs, layout: KVLayout, device: torch.device) -> FullView:
    """An uninitialized full view of ``batch``: ``kv [S, kv_width]`` bf16, ``index_k_fp8 [S, D]``,
    ``index_k_scale [S]``."""
    n = batch.view_len
    return FullView(
        torch.empty(n, layout.kv_width, dtype=torch.bfloat16, device=device),
        torch.empty(n, layout.index_head_dim, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
    )


def fill_current(
    view: FullView,
    batch: BatchLocs,
    kv_seq: torch.Tensor,
    index_k_seq: torch.Tensor,
    layout: KVLayout,
    fused: bool,
    debug: bool,
) -> None:
    """The view's current rows from the gathered chunk ``kv_seq [T, 576]`` / ``index_k_seq [T, D]``,
    rounded as the cache stores them (phase 7's fused kernel when ``fused``)."""
    fill_current_rows(
        kv_seq,
        index_k_seq,
        batch.extend_view_rows,
        view.kv,
        view.index_k_fp8,
        view.index_k_scale,
        layout,
        debug=debug,
        force_torch=not fused,
        locs_checked=True,
    )


def store_rows(
    pool: PagedKVPool,
    layer: int,
    kv: torch.Tensor,
    index_k: torch.Tensor,
    rows: torch.Tensor | None,
    locs: torch.Tensor,
    fused: bool,
    debug: bool,
) -> None:
    """Quantize ``kv[rows]`` / ``index_k[rows]`` (all rows when ``rows`` is None) into ``pool`` at slots ``locs``."""
    if fused:
        fused_store(pool, layer, kv, index_k, rows, locs, debug, locs_checked=True)
        return
    if rows is not None:
        kv, index_k = kv.index_select(0, rows), index_k.index_select(0, rows)
    pool.write_mla(layer, locs, pool.layout.pack_mla(kv))
    k_fp8, k_scale = pool.layout.quantize_index_k(index_k)
    pool.write_index(layer, locs, k_fp8, k_scale)


def owned_rows(ownership: Ownership, rank: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a request's logical ``locs`` (position order): the positions ``rank`` stores and their physical locs."""
    own = ownership.owner(locs) == rank
    return own.nonzero().flatten(), ownership.physical(locs[own])


def stored_rows_of(pool: PagedKVPool, layer: int, located: list[tuple[torch.Tensor, torch.Tensor]]) -> StoredRows:
    """Per request ``(positions, physical locs)`` -> ``(positions, mla rows, index bytes, index scale)``
    of ``layer``."""
    out = {}
    for req, (positions, phys) in enumerate(located):
        k_fp8, k_scale = pool.read_index(layer, phys)
        out[req] = (positions, pool.read_mla(layer, phys), k_fp8.view(torch.uint8), k_scale)
    return out


def nothing_stored(layout: KVLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A request's stored rows on a rank that holds none of them (the shapes of :func:`stored_rows_of`)."""
    return (
        torch.empty(0, dtype=torch.long, device=device),
        torch.empty(0, layout.mla_bytes, dtype=torch.uint8, device=device),
        torch.empty(0, layout.index_head_dim, dtype=torch.uint8, device=device),
        torch.empty(0, dtype=torch.float32, device=device),
    )


def unique_in_order(values: list[int]) -> list[int]:
    """``values`` without repeats, first appearance kept."""
    return list(dict.fromkeys(values))


class LayerAhead:
    """A batch's per-layer gather, one layer ahead, into two alternating slots.

    ``work(layer, slot)`` issues layer ``layer``'s gather and leaves its result in ``slot``
    (``layer % 2``). :meth:`take` waits for layer ``l``'s gather (launching it first when nothing
    launched it ahead: the first layer of a batch), :meth:`release` marks the slot read once its
    consumer is issued, and :meth:`launch` starts the next layer's. Every rank calls them at the
    same places, so the collectives inside ``work`` are issued in the same order everywhere.
    """

    def __init__(
        self, device: torch.device, n_layers: int, work: Callable[[int, int], None], stream: Stream | None = None
    ) -> None:
        self.n_layers, self.work = n_layers, work
        self.stream = (
            stream if stream is not None else CudaSideStream(device) if device.type == "cuda" else InlineStream()
        )
        self._handles: dict[int, Any] = {}

    def launch(self, layer: int) -> None:
        """Start ``layer``'s gather (no-op past the last layer or when already started)."""
        if layer >= self.n_layers or layer in self._handles:
            return
        slot = layer % 2
        self._handles[layer] = self.stream.submit(lambda: self.work(layer, slot), slot)

    def take(self, layer: int) -> int:
        """Wait for ``layer``'s gather -> its slot."""
        self.launch(layer)
        self.stream.wait(self._handles.pop(layer))
        return layer % 2

    def release(self, layer: int) -> None:
        self.stream.release(layer % 2)

    def wait_ms(self) -> list[float]:
        """The consumer's stall at each :meth:`take` (CUDA; synchronizes the device)."""
        return self.stream.wait_ms()


class OwnedShare(PoolBytesAtRest):
    """The store half of a design whose ranks keep the tokens an :class:`Ownership` gives them
    (rotated page shard, DCP gather): each rank quantizes and writes its owned rows of the gathered
    chunk and of an installed prefix, and reports them. Subclasses set ``ownership``, ``pool``,
    ``group``, ``batch``, ``fused``, ``debug`` and call :meth:`plan_store` in ``bind``."""

    ownership: Ownership
    pool: PagedKVPool
    group: CPGroup
    batch: BatchLocs
    fused: bool
    debug: bool
    store_path = "gathered"  # owned rows of the gathered chunk

    def plan_store(self, batch: BatchLocs) -> None:
        """The current tokens this rank owns (sequence-order rows of the chunk) and their physical locs."""
        own = self.ownership.owner(batch.extend_locs) == self.group.rank
        self._store_rows = own.nonzero().flatten()
        self._store_locs = self.ownership.physical(batch.extend_locs[own])
        check_in_range("store locs", self._store_locs, self.pool.n_slots)

    def write_prefix(
        self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, start: int = 0
    ) -> None:
        """Install the owned part of a request's cached prefix tokens ``[start, start + len(rows))``."""
        locs = self.batch.prefix_locs(request)[start : start + rows.shape[0]]
        own = self.ownership.owner(locs) == self.group.rank
        phys = self.ownership.physical(locs[own])
        self.pool.write_mla(layer, phys, rows[own])
        self.pool.write_index(layer, phys, k_fp8[own], k_scale[own])

    def store_current(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor,
        kv_local: torch.Tensor | None = None,
        index_k_local: torch.Tensor | None = None,
    ) -> None:
        """Quantize and write the tokens this rank owns of the gathered chunk."""
        store_rows(self.pool, layer, kv_seq, index_k_seq, self._store_rows, self._store_locs, self.fused, self.debug)

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """Per request, the tokens this rank owns: ``(positions, mla rows, index bytes, index scale)``."""
        located = request_locs if request_locs is not None else list(self.batch.request_locs)
        return stored_rows_of(self.pool, layer, [owned_rows(self.ownership, self.group.rank, locs) for locs in located])


class HistoryAhead:
    """The view half of a design that gathers the batch's history pages one layer ahead (layer split,
    rotated page shard): ``gather(layer, slot)`` leaves ``(mla pages, index pages)`` in
    ``_slots[slot]``; the view's history rows come from there (``row_source``: token row in the
    slot's pages of each history view row), its current rows from the chunk."""

    name: str
    layout: KVLayout
    group: CPGroup
    batch: BatchLocs
    fused: bool
    debug: bool
    materialized_bytes: int
    transient_bytes: int

    def plan_history(
        self, rows: torch.Tensor, row_source: torch.Tensor, n_layers: int, gather: Callable[[int, int], None]
    ) -> None:
        """Per batch: history view ``rows``, their ``row_source`` in a slot, and the gather that fills a slot."""
        self._view_rows, self._row_source = rows, row_source
        self._slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._ahead = LayerAhead(self.group.device, n_layers, gather) if rows.numel() else None
        if rows.numel():
            check_in_range("view rows", rows, self.batch.view_len)
        check_in_range("current view rows", self.batch.extend_view_rows, self.batch.view_len)

    def full_view(
        self, layer: int, kv_seq: torch.Tensor, index_k_seq: torch.Tensor, prefetched_kv: torch.Tensor | None = None
    ) -> FullView:
        """History rows from the layer's (prefetched) slot, current rows from the chunk; then start the
        next layer's gather."""
        if prefetched_kv is not None:
            raise ConfigError(f"{self.name} gathers its own history a layer ahead: phase 8 does not run beside it")
        view = empty_view(self.batch, self.layout, kv_seq.device)
        self.transient_bytes = 0
        if self._ahead is not None:
            slot = self._ahead.take(layer)
            mla, index = self._slots[slot]  # type: ignore[misc]
            materialize_rows(
                mla,
                index,
                self._row_source,
                self._view_rows,
                view.kv,
                view.index_k_fp8,
                view.index_k_scale,
                self.layout,
                debug=self.debug,
                force_torch=not self.fused,
                locs_checked=True,
            )
            self._ahead.release(layer)
            self._ahead.launch(layer + 1)
            self.materialized_bytes += mla.numel() + index.numel()
            self.transient_bytes = 2 * (mla.numel() + index.numel())  # both slots
        fill_current(view, self.batch, kv_seq, index_k_seq, self.layout, self.fused, self.debug)
        return view
