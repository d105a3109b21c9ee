"""Logical pages and the per-request page table (request -> logical locs).

A logical loc is ``page * page_size + slot``; attention metadata, the radix cache and PD transfer
speak logical locs. :class:`PageAllocator` hands out logical page ids, lowest first, so a run is
deterministic. :class:`RequestPageTable` (alias :data:`ReqToToken`) records each request's pages in
token order: a request's first tokens are its prefix, and a later chunk of chunked prefill calls
:meth:`RequestPageTable.extend` again, continuing in the last page while it has room.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from reference_impl.config import ConfigError


def page_locs(pages: Sequence[int], n_tokens: int, page_size: int) -> torch.Tensor:
    """Logical locs ``page * page_size + slot`` of the first ``n_tokens`` tokens held in ``pages`` (in
    token order) -> ``[n_tokens] int64``."""
    slots = torch.arange(page_size, dtype=torch.int64)
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + slots[None, :]).reshape(-1)[:n_tokens]


class PageAllocator:
    """A free list of logical page ids ``0 .. n_pages - 1`` of ``page_size`` tokens each."""

    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 0 or page_size < 1:
            raise ConfigError(f"PageAllocator needs n_pages >= 0 and page_size >= 1, got {n_pages} and {page_size}")
        self.n_pages = n_pages
        self.page_size = page_size
        # The free pages are _free_set; _free_heap holds them too, plus stale ids a lane allocation
        # took (dropped when popped), so that neither path re-sorts the free list per page.
        self._free_heap: list[int] = list(range(n_pages))  # sorted, hence already a heap
        self._free_set: set[int] = set(self._free_heap)
        self._lane_floor: dict[tuple[int, int], int] = {}  # (lane, n_lanes) -> no free page of the lane below it
        self.high_water = 0  # highest page id ever handed out + 1 (what a pool must cover)
        # Called when a request asks for more pages than are free: frees some (a prefix cache evicting its
        # least recently used entry) and returns True, or False when it has nothing left to free.
        self.reclaim: Callable[[], bool] | None = None

    @property
    def n_free(self) -> int:
        return len(self._free_set)

    @property
    def n_used(self) -> int:
        return self.n_pages - self.n_free

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, lowest ids first -> ascending page ids."""
        if n < 0:
            raise ConfigError(f"cannot allocate {n} pages")
        while n > self.n_free and self.reclaim is not None and self.reclaim():
            pass
        if n > self.n_free:
            raise ConfigError(
                f"out of KV pages: asked for {n} pages of {self.page_size} tokens, {self.n_free} of "
                f"{self.n_pages} are free; free finished requests or give the pool more pages"
            )
        pages = []
        while len(pages) < n:
            page = heapq.heappop(self._free_heap)
            if page in self._free_set and (not pages or page != pages[-1]):  # skip stale and repeated ids
                pages.append(page)
        self._free_set.difference_update(pages)
        self.high_water = max([self.high_water, *(p + 1 for p in pages)])
        return pages

    def alloc_in_lane(self, n: int, lane: int, n_lanes: int) -> list[int]:
        """Take ``n`` free pages with ``page % n_lanes == lane``, lowest first (phase 5's owner lanes).

        A lane that cannot satisfy the request is a :class:`ConfigError`: the caller must not fall
        back to a page of another lane, which would give the page the wrong owner.
        """
        # Walk the lane upward from its floor (every lane page below it is taken): amortized O(n).
        floor = self._lane_floor.get((lane, n_lanes), lane)
        pages, page = [], floor + (lane - floor) % n_lanes
        while len(pages) < n and page < self.n_pages:
            if page in self._free_set:
                pages.append(page)
            page += n_lanes
        if len(pages) < n and self.reclaim is not None and self.reclaim():
            return self.alloc_in_lane(n, lane, n_lanes)  # a cached request's pages went back: look again
        if len(pages) < n:
            lane_free = sum(1 for p in self._free_set if p % n_lanes == lane)
            raise ConfigError(
                f"out of KV pages in lane {lane} of {n_lanes}: asked for {n}, {lane_free} free in the lane "
                f"({self.n_free} free overall, fragmented across lanes); free requests whose pages sit in lane "
                f"{lane}, give the pool more pages, or run the batch without phase 5 (lowest-free ids, the "
                "phase-2 store path)"
            )
        self._lane_floor[(lane, n_lanes)] = pages[-1] + n_lanes if pages else floor
        self._free_set.difference_update(pages)  # their heap entries go stale
        self.high_water = max([self.high_water, *(p + 1 for p in pages)])
        return pages

    def lane_free_counts(self, n_lanes: int) -> list[int]:
        """Free pages per lane ``page % n_lanes`` (fragmentation report)."""
        counts = [0] * n_lanes
        for p in self._free_set:
            counts[p % n_lanes] += 1
        return counts

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; a page out of range or already free is a :class:`ConfigError`."""
        pages = list(pages)
        for page in pages:
            if not 0 <= page < self.n_pages:
                raise ConfigError(f"page {page} is outside the allocator's range [0, {self.n_pages})")
            if page in self._free_set:
                raise ConfigError(f"page {page} is already free (double free)")
        if len(set(pages)) != len(pages):
            raise ConfigError(f"pages {pages} free the same page twice")
        for page in pages:
            heapq.heappush(self._free_heap, page)
            for (lane, n_lanes), floor in self._lane_floor.items():
                if page % n_lanes == lane and page < floor:
                    self._lane_floor[(lane, n_lanes)] = page
        self._free_set.update(pages)


class RequestPageTable:
    """Per request: its logical pages in token order and its token count.

    A page can belong to several requests (:meth:`share`, a radix-style prefix reuse): it goes back
    to the allocator when the last request holding it is freed.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._pages: dict[Hashable, list[int]] = {}
        self._n_tokens: dict[Hashable, int] = {}
        self._holders: dict[int, int] = {}  # page -> requests holding it
        self._shared: dict[Hashable, int] = {}  # request -> leading tokens it took by reference

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._pages

    def extend(
        self, req_id: Hashable, n_tokens: int, lanes: Sequence[int] | None = None, n_lanes: int = 1
    ) -> torch.Tensor:
        """Append ``n_tokens`` tokens to ``req_id`` (new request if unknown) -> their locs ``[n_tokens] int64``.

        New pages are allocated only once the last page is full; ``lanes`` (one per new page) takes
        each from the lane ``page % n_lanes`` given, else the lowest free ids. On exhaustion nothing changes.
        """
        if n_tokens < 0:
            raise ConfigError(f"request {req_id!r}: cannot extend by {n_tokens} tokens")
        pages = self._pages.get(req_id, [])
        old = self._n_tokens.get(req_id, 0)
        needed = -(-(old + n_tokens) // self.page_size) - len(pages)
        if lanes is not None and needed > 0:
            if len(lanes) != needed:
                raise ConfigError(f"request {req_id!r}: {len(lanes)} lanes for {needed} new pages")
            new_pages = []
            try:
                for lane in lanes:
                    new_pages += self.allocator.alloc_in_lane(1, lane, n_lanes)
            except ConfigError:
                if new_pages:
                    self.allocator.free(new_pages)
                raise
        else:
            new_pages = self.allocator.alloc(needed) if needed > 0 else []
        self._pages[req_id] = pages + new_pages
        self._n_tokens[req_id] = old + n_tokens
        for page in new_pages:
            self._holders[page] = 1
        return self.locs(req_id)[old:]

    def share(self, req_id: Hashable, source: Hashable, n_tokens: int) -> int:
        """Start new request ``req_id`` with the first ``n_tokens`` tokens of ``source``: its whole
        pages by reference (no copy), then fresh pages for the rest -> the tokens shared by reference.

        The caller writes the tokens past the shared pages (a partial page is never shared: the
        source may still append to it).
        """
        if req_id in self._pages:
            raise ConfigError(f"request {req_id!r} already exists: it cannot start by sharing {source!r}")
        if n_tokens > self.n_tokens(source):
            raise ConfigError(f"request {req_id!r}: {source!r} has {self.n_tokens(source)} tokens, {n_tokens} asked")
        whole = n_tokens // self.page_size
        shared = self._lookup(source)[:whole]
        for page in shared:
            self._holders[page] += 1
        self._pages[req_id] = list(shared)
        self._n_tokens[req_id] = self._shared[req_id] = whole * self.page_size
        self.extend(req_id, n_tokens - whole * self.page_size)
        return whole * self.page_size

    def started_by_sharing(self, req_id: Hashable) -> bool:
        """Whether ``req_id`` started with another request's prefix (:meth:`share`; whole pages or none)."""
        return req_id in self._shared

    def shared_tokens(self, req_id: Hashable) -> int:
        """Leading tokens of ``req_id`` that sit in pages it took by reference (:meth:`share`); 0 if none."""
        return self._shared.get(req_id, 0)

    def locs(self, req_id: Hashable, device: torch.device | str | None = None) -> torch.Tensor:
        """Logical locs ``page * page_size + slot`` of all tokens of ``req_id`` -> ``[n_tokens] int64``."""
        locs = page_locs(self._lookup(req_id), self._n_tokens[req_id], self.page_size)
        return locs if device is None else locs.to(device)

    def pages(self, req_id: Hashable) -> list[int]:
        """Logical page ids of ``req_id`` in token order (a copy)."""
        return list(self._lookup(req_id))

    def n_tokens(self, req_id: Hashable) -> int:
        self._lookup(req_id)
        return self._n_tokens[req_id]

    def free(self, req_id: Hashable) -> None:
        """Drop ``req_id``; its pages no other request holds go back to the allocator."""
        pages = self._lookup(req_id)
        released = []
        for page in pages:
            self._holders[page] -= 1
            if not self._holders[page]:
                del self._holders[page]
                released.append(page)
        self.allocator.free(released)
        del self._pages[req_id], self._n_tokens[req_id]
        self._shared.pop(req_id, None)

    @property
    def requests(self) -> list[Hashable]:
        """The requests the table holds, in the order they arrived."""
        return list(self._pages)

    def _lookup(self, req_id: Hashable) -> list[int]:
        try:
            return self._pages[req_id]
        except KeyError:
            raise ConfigError(f"unknown request {req_id!r}") from None


ReqToToken = RequestPageTable


class PrefixCache:
    """Finished requests kept in a budgeted pool for later prefix hits, evicted least recently used first.

    A finished request is :meth:`hold`-en instead of freed: its pages stay in the table, so a later request
    may still take its whole prefix pages by reference (:meth:`RequestPageTable.share`). When the allocator
    runs out, it :meth:`evict`-s the least recently used cached request: the table drops it and its pages that
    no other request holds go back (a page shared with a live request stays until that one lets it go). A
    request whose source was evicted is a miss: it gets fresh pages and writes its whole prefix again.
    """

    def __init__(self, table: RequestPageTable) -> None:
        self.table = table
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self.evicted_requests = 0
        self.evicted_pages = 0  # pages the evictions gave back to the allocator
        table.allocator.reclaim = self.evict

    def hold(self, req_id: Hashable) -> None:
        """Keep finished ``req_id`` cached (most recently used)."""
        self.table.n_tokens(req_id)  # a known request
        self._lru[req_id] = None
        self._lru.move_to_end(req_id)

    def touch(self, req_id: Hashable) -> bool:
        """A request is about to hit ``req_id``: make it most recently used -> whether its pages are still there."""
        if req_id in self._lru:
            self._lru.move_to_end(req_id)
        return req_id in self.table

    @property
    def cached(self) -> list[Hashable]:
        """The cached requests, least recently used first."""
        return list(self._lru)

    def evict(self) -> bool:
        """Drop the least recently used cached request -> False when none is cached."""
        if not self._lru:
            return False
        req_id, _ = self._lru.popitem(last=False)
        free_before = self.table.allocator.n_free
        self.table.free(req_id)
        self.evicted_requests += 1
        self.evicted_pages += self.table.allocator.n_free - free_before
        return True
