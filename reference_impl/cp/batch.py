"""the batch locs: logical locs and full-view coordinates, identical on every rank.

Built from the request list, the page size and the split metadata alone, so every rank derives the
same batch without communicating. Logical locs come from the allocator (``page = loc // page_size``);
each request starts on a fresh page and its prefix tokens are its first locs. The **full view**
concatenates the requests' whole sequences (prefix + extend) in request order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.split import SplitMetadata
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable

PageLanes = Callable[[RequestPageTable, Hashable, int, int], list[int]]
"""An allocation policy by lanes: ``(table, request, new tokens, C) -> the lane (``page % C``) of each page
the request's next ``new tokens`` open`` (a KV design's allocator contract, e.g. rotated page ownership)."""


def new_page_table(final_lens: list[int], page_size: int, cp_size: int, compute_owner: bool) -> RequestPageTable:
    """A page table with room for requests of ``final_lens`` tokens (prefix + every chunk).

    Compute-owner lanes (phase 5) need slack: a lane can run out while others have room. Two
    pages per rank per request (plus one) cover the zigzag's per-rank imbalance; a lane that still
    runs out is a clear ``ConfigError``, never a page with the wrong owner.
    """
    exact = sum(-(-n // page_size) for n in final_lens)
    slack = 2 * cp_size * (len(final_lens) + 1) if compute_owner else 0
    return RequestPageTable(PageAllocator(exact + slack, page_size))


@dataclass(frozen=True)
class BatchLocs:
    """Locs and full-view rows of one prefill batch. Tensors live on ``device``; int64 unless noted."""

    meta: SplitMetadata
    page_size: int
    n_pages: int  # logical page-id space of the batch (ids 0 .. n_pages-1; phase 5 may leave holes)
    request_locs: tuple[torch.Tensor, ...]  # per request: logical locs of its prefix + extend tokens
    view_offsets: tuple[int, ...]  # first full-view row of each request
    view_len: int  # S: rows of the full view
    view_locs: torch.Tensor  # [S] logical loc of each full-view row
    extend_locs: torch.Tensor  # [T] logical locs of the extend tokens, sequence order
    extend_view_rows: torch.Tensor  # [T] full-view row of each extend token
    key_start: torch.Tensor  # [T] first full-view row a token may attend to (its request's start)
    key_end: torch.Tensor  # [T] exclusive causal end (request start + prefix + j + 1)

    @classmethod
    def build(
        cls,
        meta: SplitMetadata,
        device: torch.device | str = "cpu",
        compute_owner: bool = False,
        table: RequestPageTable | None = None,
        request_ids: tuple[int, ...] | None = None,
        id_space: int | None = None,
        shares: Mapping[int, int] | None = None,
        page_lanes: PageLanes | None = None,
    ) -> BatchLocs:
        """Allocate this batch's logical locs and derive the full-view coordinates.

        ``table`` is the page table that persists across the chunks of a chunked prefill (request
        ``request_ids[i]`` is this batch's request ``i``); a request seen for the first time gets
        its prefix allocated first. Without a table, one sized exactly for this batch is used.
        ``id_space`` fixes ``n_pages`` (the logical page-id space the pools are built for) across
        the chunks of a run; by default it is this batch's highest page id + 1.
        New pages come from the lowest free ids, or (phase 5) from each page's compute-owner lane.
        ``shares`` maps a new request to the earlier one whose prefix it starts with: it takes that
        request's whole prefix pages by reference (:meth:`RequestPageTable.share`) while that request is still
        in the table; one a budgeted pool evicted is a miss (fresh pages, the whole prefix written again).
        ``page_lanes`` (a KV design's allocator, instead of the lowest free ids or phase 5's lanes)
        picks the lane of every page a request opens, its prefix and shared partial page included.
        """
        page_size = meta.page_size
        totals = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)]
        if table is None:
            table = new_page_table(totals, page_size, meta.cp_size, compute_owner)
        ids = request_ids if request_ids is not None else tuple(range(len(totals)))
        for i, (req, prefix, extend) in enumerate(zip(ids, meta.prefix_lens, meta.extend_lens)):
            if req not in table:
                if page_lanes is not None:
                    # Whole shared pages by reference, every page opened after them in its lane.
                    whole = 0
                    if shares and req in shares and shares[req] in table:
                        whole = prefix // page_size * page_size
                        table.share(req, shares[req], whole)
                    rest = prefix - whole
                    table.extend(req, rest, lanes=page_lanes(table, req, rest, meta.cp_size), n_lanes=meta.cp_size)
                elif shares and req in shares and shares[req] in table:  # not evicted (a budgeted pool)
                    table.share(req, shares[req], prefix)
                else:
                    table.extend(req, prefix)
            elif table.n_tokens(req) != prefix:
                raise ConfigError(
                    f"request {req}: the page table holds {table.n_tokens(req)} tokens, the batch says {prefix}"
                )
            if page_lanes is not None:
                table.extend(req, extend, lanes=page_lanes(table, req, extend, meta.cp_size), n_lanes=meta.cp_size)
            elif compute_owner:
                from reference_impl.cp.compute_owner import new_page_lanes

                table.extend(req, extend, lanes=new_page_lanes(meta, i, table.n_tokens(req)), n_lanes=meta.cp_size)
            else:
                table.extend(req, extend)
        request_locs = [table.locs(req).to(device) for req in ids]
        n_pages = id_space if id_space is not None else max(int(locs.max()) // page_size for locs in request_locs) + 1
        offsets = [0]
        for n in totals[:-1]:
            offsets.append(offsets[-1] + n)

        token_request = torch.tensor(meta.token_request, dtype=torch.long)
        positions = torch.tensor(meta.token_position, dtype=torch.long)
        starts = torch.tensor(offsets, dtype=torch.long)[token_request]
        view_rows = starts + positions
        extend_locs = torch.cat([locs[p:] for locs, p in zip(request_locs, meta.prefix_lens)])
        return cls(
            meta=meta,
            page_size=page_size,
            n_pages=n_pages,
            request_locs=tuple(request_locs),
            view_offsets=tuple(offsets),
            view_len=sum(totals),
            view_locs=torch.cat(request_locs),
            extend_locs=extend_locs.to(device),
            extend_view_rows=view_rows.to(device),
            key_start=starts.to(device),
            key_end=(view_rows + 1).to(device),
        )

    def prefix_locs(self, request: int) -> torch.Tensor:
        """Logical locs of request ``request``'s prefix tokens."""
        return self.request_locs[request][: self.meta.prefix_lens[request]]

    @property
    def used_pages(self) -> int:
        """Logical pages actually holding tokens (``n_pages`` minus holes)."""
        return int(torch.unique(self.view_locs // self.page_size).numel())

    @property
    def has_prefix(self) -> bool:
        return any(p > 0 for p in self.meta.prefix_lens)
