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
  into two alternating slots (:class:`~reference_impl.cp.designs.common.HistoryAhead`);
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
from reference_impl.cp.designs.common import HistoryAhead, OwnedShare, unique_in_order
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


class RotatedShardKV(OwnedShare, HistoryAhead):
    """Owned pages at ``p // C`` (plus one trash page) and a two-slot owner-major gather scratch."""

    name = "rotated-shard"
    sharded = True

    def __init__(
        self, batch: BatchLocs, layout: KVLayout, n_layers: int, group: CPGroup, debug: bool, fused: bool = False
    ) -> None:
        self.layout, self.group, self.debug, self.fused = layout, group, debug, fused
        self.n_layers = n_layers
        self.ownership = Ownership(group.size, batch.page_size, batch.page_size)
        held = self.ownership.pages_held(batch.n_pages, group.rank)
        self.trash_page = held  # padding of the regular gather: sent, never read
        self.pool = PagedKVPool(n_layers, held + 1, batch.page_size, layout, group.device, debug)
        self.batch = batch
        self.materialized_bytes = 0
        self.transient_bytes = 0
        self.bind(batch)

    def bind(self, batch: BatchLocs) -> None:
        """Plan the batch once: the owned rows of the chunk, the history pages in position order, each
        rank's padded send list and the slot row of every history row (host arithmetic, before the loop)."""
        if batch.n_pages != self.batch.n_pages:
            raise ConfigError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        rank, cp_size, page_size, device = self.group.rank, self.group.size, batch.page_size, batch.view_locs.device
        self.plan_store(batch)
        rows = history_rows(batch)
        locs = batch.view_locs.index_select(0, rows)
        plan = unique_in_order((locs // page_size).tolist())  # history pages, request by request, position order
        # Every request's chain cyclic: what the rotated allocator promises (a test checks it).
        self.cyclic = all(
            owners_cyclic(unique_in_order((r // page_size).tolist()), cp_size) for r in batch.request_locs
        )
        within, counts = [], [0] * cp_size
        for page in plan:  # k_within: the page's place among its owner's plan pages (k // C when cyclic)
            within.append(counts[page % cp_size])
            counts[page % cp_size] += 1
        self.block = max(counts, default=0)  # pages every rank sends (ceil(pages / C) when cyclic)
        mine = [page // cp_size for page in plan if page % cp_size == rank]
        self._send = torch.tensor(mine + [self.trash_page] * (self.block - len(mine)), dtype=torch.long, device=device)
        slot_of_page = {page: (page % cp_size) * self.block + k for page, k in zip(plan, within)}
        page_index = torch.tensor(
            [slot_of_page[p] for p in (locs // page_size).tolist()], dtype=torch.long, device=device
        )
        row_source = page_index * page_size + locs % page_size
        if rows.numel():
            check_in_range("slot rows", row_source, cp_size * self.block * page_size)
        self.plan_history(rows, row_source, self.n_layers, self._gather)

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

    def owned_pages(self) -> torch.Tensor:
        """Logical pages of this batch stored on this rank, ascending (physical page ``p // C``)."""
        pages = torch.arange(self.batch.n_pages, device=self.batch.view_locs.device)
        return pages[pages % self.group.size == self.group.rank]
