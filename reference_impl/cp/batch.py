"""The batch plan: logical locs and full-view coordinates, identical on every rank.

Built from the request list, the page size and the split metadata alone, so every rank derives the
same plan without communicating. Logical locs come from the allocator (``page = loc // page_size``);
each request starts on a fresh page and its prefix tokens are its first locs. The **full view**
concatenates the requests' whole sequences (prefix + extend) in request order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.cp.split import SplitMetadata
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable


@dataclass(frozen=True)
class BatchPlan:
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
    def build(cls, meta: SplitMetadata, device: torch.device | str = "cpu", compute_owner: bool = False) -> "BatchPlan":
        """Allocate the batch's logical locs: lowest free pages, or (phase 5) compute-owner lanes."""
        page_size = meta.page_size
        totals = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)]
        if compute_owner:
            from reference_impl.cp.compute_owner import allocate_compute_owner

            cpu_locs, n_pages = allocate_compute_owner(meta)
            request_locs = [locs.to(device) for locs in cpu_locs]
        else:
            n_pages = sum(-(-n // page_size) for n in totals)
            table = RequestPageTable(PageAllocator(n_pages, page_size))
            request_locs = []
            for req, n in enumerate(totals):
                table.extend(req, n)
                request_locs.append(table.locs(req).to(device))
        offsets = [0]
        for n in totals[:-1]:
            offsets.append(offsets[-1] + n)

        token_request = torch.tensor(meta.token_request, dtype=torch.long)
        positions = torch.tensor(meta.token_position, dtype=torch.long)
        starts = torch.tensor(offsets, dtype=torch.long)[token_request]
        view_rows = starts + positions
        extend_locs = torch.cat(
            [locs[p:] for locs, p in zip(request_locs, meta.prefix_lens)]
        )
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
