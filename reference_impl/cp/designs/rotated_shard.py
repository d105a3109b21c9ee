"""Rotated page shard: pages owned by arithmetic, a rotated allocator, one regular owner-major gather.

SGLang's logical-page KV sharding (the kv-shard series): a logical page ``p`` lives on rank
``p mod C`` at physical page ``p // C`` (the bijection ``owner(loc) = (loc mod (C P)) // P``), and
the allocator is **rotated**: position-page ``k`` of a request's chain is drawn from lane
``(base + k) mod C`` (:func:`rotated_page_lanes`), so along a cached prefix the owners are exactly
cyclic and per-rank page counts differ by at most one.

* **store**: every rank quantizes and writes the tokens it owns of the gathered chunk;
* **gather**: per layer, each rank sends its owned history pages in position order, padded with a
  **trash page** (one extra physical page no plan row reads) to ``block = ceil(pages / C)`` (the
  largest owner's count): one *regular* all-gather per buffer (MLA, index K) whose output is
  owner-major, ``[rank 0's pages | rank 1's | ...]``, with no reorder pass; it runs one layer ahead
  into two alternating slots (:class:`~reference_impl.cp.designs.common.LayerAhead`);
* **materialize**: a history row of plan page ``k`` sits at ``owner * block + k_within`` of the
  slot, ``k_within = k // C`` when the owners are cyclic (computed here per owner, so a batch of
  several requests, whose chains each start their own cycle, translates too); current rows come
  from the gathered chunk. In the engine the attention reads the ``[prefix | chunk | trash]``
  scratch through a translated page table; here the translation feeds the dense view this
  package's attention reads.

SGLang's first version runs one request per batch with a page-aligned prefix; this store takes
several requests, prefixes ending mid-page (the partial page is gathered whole) and shared prefixes.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.current_reuse import history_rows
from reference_impl.cp.designs.common import (
    LayerAhead, empty_view, fill_current, owned_rows, store_rows, stored_rows_of, unique_in_order,
)
from reference_impl.cp.fused_ops import materialize_rows
from reference_impl.cp.kv_store import FullView, StoredRows
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.allocator import RequestPageTable
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


def rotated_page_lanes(table: RequestPageTable, request: Hashable, new_tokens: int, cp_size: int) -> list[int]:
    """Lanes (owners, ``page mod C``) of the pages ``request``'s next ``new_tokens`` open: position-page
    ``k`` in lane ``(base + k) mod C``, where ``base`` is the owner of the chain's first page (a shared
    prefix continues its source's cycle) or, for a fresh request, its id ``mod C`` (requests start on
    different ranks)."""
    page_size = table.page_size
    pages = table.pages(request) if request in table else []
    held = table.n_tokens(request) if request in table else 0
    base = pages[0] % cp_size if pages else int(request) % cp_size  # type: ignore[call-overload]
    last = -(-(held + new_tokens) // page_size)
    return [(base + k) % cp_size for k in range(len(pages), last)]


def owners_cyclic(pages: list[int], cp_size: int) -> bool:
    """Whether a chain's page owners run ``o, o + 1, ... (mod C)`` (what the rotated allocator promises)."""
    return all((b - a) % cp_size == 1 % cp_size for a, b in zip(pages, pages[1:]))


class RotatedShardKV:
    """Owned pages at ``p // C`` (plus one trash page) and a two-slot owner-major gather scratch."""

    name = "rotated-shard"
    sharded = True
    store_path = "gathered"  # owned rows of the gathered chunk

    def __init__(self, batch: BatchLocs, layout: KVLayout, n_layers: int, group: CPGroup, debug: bool,
                 fused: bool = False) -> None:
        self.layout, self.group, self.debug, self.fused = layout, group, debug, fused
        self.n_layers = n_layers
        self.ownership = Ownership(group.size, batch.page_size, batch.page_size)
        held = self.ownership.pages_held(batch.n_pages, group.rank)
        self.trash_page = held  # padding of the regular gather: sent, never read
        self.pool = PagedKVPool(n_layers, held + 1, batch.page_size, layout, group.device, debug)
        self.batch = batch
        self.materialized_bytes = 0
        self.transient_bytes = 0
        self._slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self.bind(batch)

    @property
    def kv_bytes(self) -> int:
        return self.pool.mla_bytes_total

    @property
    def index_bytes(self) -> int:
        return self.pool.index_bytes_total

    def bind(self, batch: BatchLocs) -> None:
        """Plan the batch once: the owned rows of the chunk, the history pages in position order, each
        rank's padded send list and the slot row of every history row (host arithmetic, before the loop)."""
        if batch.n_pages != self.batch.n_pages:
            raise ConfigError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        rank, cp_size, page_size, device = self.group.rank, self.group.size, batch.page_size, batch.view_locs.device
        own = self.ownership.owner(batch.extend_locs) == rank
        self._store_rows = own.nonzero().flatten()
        self._store_locs = self.ownership.physical(batch.extend_locs[own])

        rows = history_rows(batch)
        locs = batch.view_locs.index_select(0, rows)
        plan = unique_in_order((locs // page_size).tolist())  # history pages, request by request, position order
        # Every request's chain cyclic: what the rotated allocator promises (a test checks it).
        self.cyclic = all(owners_cyclic(unique_in_order((r // page_size).tolist()), cp_size) for r in batch.request_locs)
        within, counts = [], [0] * cp_size
        for page in plan:  # k_within: the page's place among its owner's plan pages (k // C when cyclic)
            within.append(counts[page % cp_size])
            counts[page % cp_size] += 1
        self.block = max(counts, default=0)  # pages every rank sends (ceil(pages / C) when cyclic)
        mine = [page // cp_size for page in plan if page % cp_size == rank]
        self._send = torch.tensor(mine + [self.trash_page] * (self.block - len(mine)), dtype=torch.long, device=device)
        slot_of_page = {page: (page % cp_size) * self.block + k for page, k in zip(plan, within)}
        page_index = torch.tensor([slot_of_page[p] for p in (locs // page_size).tolist()], dtype=torch.long, device=device)
        self._view_rows = rows
        self._row_source = page_index * page_size + locs % page_size
        check_in_range("store locs", self._store_locs, self.pool.n_slots)
        check_in_range("current view rows", batch.extend_view_rows, batch.view_len)
        if rows.numel():
            check_in_range("view rows", rows, batch.view_len)
            check_in_range("slot rows", self._row_source, cp_size * self.block * page_size)
        self._ahead = LayerAhead(self.group.device, self.n_layers, self._gather) if rows.numel() else None

    def _gather(self, layer: int, slot: int) -> None:
        """Layer ``layer``'s history pages, owner-major, into ``slot``: one regular all-gather per buffer."""
        lengths = [self.block] * self.group.size
        pages = self.pool.n_pages
        mla = self.pool.mla[layer].view(pages, self.layout.mla_page_bytes).index_select(0, self._send)
        index = self.pool.index[layer].index_select(0, self._send)
        self._slots[slot] = (
            self.group.all_gather_padded(mla, lengths, tag="materialize"),
            self.group.all_gather_padded(index, lengths, tag="materialize_index"),
        )

    def write_prefix(self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor,
                     start: int = 0) -> None:
        """Install the owned part of a request's cached prefix, positions ``start`` on."""
        locs = self.batch.prefix_locs(request)[start:]
        own = self.ownership.owner(locs) == self.group.rank
        phys = self.ownership.physical(locs[own])
        self.pool.write_mla(layer, phys, rows[own])
        self.pool.write_index(layer, phys, k_fp8[own], k_scale[own])

    def store_current(self, layer: int, kv_seq: torch.Tensor, index_k_seq: torch.Tensor,
                      kv_local: torch.Tensor | None = None, index_k_local: torch.Tensor | None = None) -> None:
        """Quantize and write the tokens this rank owns of the gathered chunk."""
        store_rows(self.pool, layer, kv_seq, index_k_seq, self._store_rows, self._store_locs, self.fused, self.debug)

    def full_view(self, layer: int, kv_seq: torch.Tensor, index_k_seq: torch.Tensor,
                  prefetched_kv: torch.Tensor | None = None) -> FullView:
        """History rows through the owner-major translation, current rows from the chunk; then the next layer's gather."""
        if prefetched_kv is not None:
            raise ConfigError("rotated shard prefetches its own gather: phase 8 does not run beside it")
        view = empty_view(self.batch, self.layout, kv_seq.device)
        self.transient_bytes = 0
        if self._ahead is not None:
            slot = self._ahead.take(layer)
            mla, index = self._slots[slot]  # type: ignore[misc]
            materialize_rows(mla, index, self._row_source, self._view_rows, view.kv, view.index_k_fp8, view.index_k_scale,
                             self.layout, debug=self.debug, force_torch=not self.fused, locs_checked=True)
            self._ahead.release(layer)
            self._ahead.launch(layer + 1)
            self.materialized_bytes += mla.numel() + index.numel()
            self.transient_bytes = 2 * (mla.numel() + index.numel())  # both slots
        fill_current(view, self.batch, kv_seq, index_k_seq, self.layout, self.fused, self.debug)
        return view

    def owned_pages(self) -> torch.Tensor:
        """Logical pages of this batch stored on this rank, ascending (physical page ``p // C``)."""
        pages = torch.arange(self.batch.n_pages, device=self.batch.view_locs.device)
        return pages[pages % self.group.size == self.group.rank]

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """Per request, the tokens this rank owns: ``(positions, mla rows, index bytes, index scale)``."""
        located = request_locs if request_locs is not None else list(self.batch.request_locs)
        return stored_rows_of(self.pool, layer, [owned_rows(self.ownership, self.group.rank, locs) for locs in located])
