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

from reference_impl.cp.ownership import Ownership
from reference_impl.cp.split import SplitMetadata


def current_page_lanes(meta: SplitMetadata, request: int) -> dict[int, int]:
    """For each page (index within the request) holding current tokens: the rank computing its first token."""
    lanes: dict[int, int] = {}
    offset = meta.request_token_offsets[request]
    for rank, tokens in enumerate(meta.rank_tokens):
        for g in tokens:
            if meta.token_request[g] == request:
                page = meta.token_position[g] // meta.page_size
                first = meta.prefix_lens[request] + (g - offset) == max(
                    page * meta.page_size, meta.prefix_lens[request]
                )
                if first:
                    lanes[page] = rank
    return lanes


def new_page_lanes(meta: SplitMetadata, request: int, cached_tokens: int) -> list[int]:
    """Lanes (compute ranks) of the pages that request ``request``'s extend opens beyond ``cached_tokens``.

    The page holding ``cached_tokens`` itself, when partial, already exists: it keeps its owner.
    """
    page_size = meta.page_size
    lanes = current_page_lanes(meta, request)
    first_new = -(-cached_tokens // page_size)
    last = -(-(cached_tokens + meta.extend_lens[request]) // page_size)
    return [lanes[k] for k in range(first_new, last)]


def direct_write_ok(meta: SplitMetadata, extend_locs: torch.Tensor, ownership: Ownership) -> bool:
    """Batch-level: every rank owns every token it computes (one host read per batch).

    In-seq, only a page-aligned split can pass (phase 5's lanes); round-robin passes whenever the
    interleave follows positions (interleave 1 with ``C`` dividing the page size).
    """
    if meta.mode == "in-seq" and not meta.page_aligned:
        return False
    owner = ownership.owner(extend_locs.cpu())
    return all(bool((owner[list(tokens)] == rank).all()) for rank, tokens in enumerate(meta.rank_tokens))
