"""Phase 5: the compute-owner layout (direct writes into the owner's pool).

With the page-interleaved layout of phase 2 a rank computes KV for pages other ranks own, so every
rank quantizes and scatters its share of the **gathered** chunk. Phase 5 makes the rank that
computes a page also own it: with a page-aligned split (phase 4) every current page has exactly
one compute rank, and the allocator hands each such page a logical id in that rank's lane
(``page % C == rank``). Each rank then writes the MLA KV and indexer K **it computed** straight
into its own pool; the full-view read path is unchanged.

Enabled per batch only when the split is page-aligned and every local token's page is owned by
the rank that computed it; a prefix that ends mid-page leaves a partial page whose owner was fixed
earlier, and if another rank computes its new tokens the check fails and the batch takes the
phase-2 store path. Every rank computes the same verdict from shared metadata.
"""

from __future__ import annotations

import torch

from reference_impl.cp.ownership import page_owner
from reference_impl.cp.split import SplitMetadata
from reference_impl.kvcache.allocator import PageAllocator, RequestPageTable


def current_page_lanes(meta: SplitMetadata, request: int) -> dict[int, int]:
    """For each page (index within the request) holding current tokens: the rank computing its first token."""
    lanes: dict[int, int] = {}
    offset = meta.request_token_offsets[request]
    for rank, tokens in enumerate(meta.rank_tokens):
        for g in tokens:
            if meta.token_request[g] == request:
                page = meta.token_position[g] // meta.page_size
                first = meta.prefix_lens[request] + (g - offset) == max(page * meta.page_size, meta.prefix_lens[request])
                if first:
                    lanes[page] = rank
    return lanes


def allocate_compute_owner(meta: SplitMetadata) -> tuple[list[torch.Tensor], int]:
    """Logical locs per request with each new current page in its compute rank's lane.

    Prefix pages (cached earlier) take the lowest free ids. Returns ``(request_locs, n_pages)`` where
    ``n_pages`` is the logical id space the batch spans (``max id + 1``; unused ids are holes).
    """
    cp, page_size = meta.cp_size, meta.page_size
    totals = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)]
    capacity = cp * sum(-(-n // page_size) + 1 for n in totals)  # room for lane imbalance
    table = RequestPageTable(PageAllocator(capacity, page_size))
    for req, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens)):
        table.extend(req, prefix)
        lanes = current_page_lanes(meta, req)
        first_new = -(-prefix // page_size)  # pages before this index already exist
        new_pages = range(first_new, -(-(prefix + extend) // page_size))
        table.extend(req, extend, lanes=[lanes[k] for k in new_pages], n_lanes=cp)
    request_locs = [table.locs(req) for req in range(len(totals))]
    n_pages = max(int(locs.max()) // page_size for locs in request_locs) + 1
    return request_locs, n_pages


def direct_write_ok(meta: SplitMetadata, extend_locs: torch.Tensor) -> bool:
    """Batch-level: page-aligned split and every rank owns the page of every token it computes."""
    if not meta.page_aligned:
        return False
    owner = page_owner(extend_locs.cpu() // meta.page_size, meta.cp_size)
    return all(bool((owner[list(tokens)] == rank).all()) for rank, tokens in enumerate(meta.rank_tokens))
