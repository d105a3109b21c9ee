"""Phase 2's page ownership: which rank stores a logical page, and where.

Deterministic and page-interleaved: logical page ``p`` is owned by rank ``p % C`` and stored there
at compact physical page ``p // C``. A request's pages are consecutive logical ids, so each rank
holds ``floor`` or ``ceil(pages / C)`` of them. Pure integer arithmetic: every rank (and the decode
side of a PD transfer) derives the same mapping without communicating.

Rejected: request-contiguous ownership (rank ``r`` stores a contiguous range of each request):
unstable under chunked prefill, where a request's page count grows chunk by chunk and the ranges
would have to move.
"""

from __future__ import annotations

import torch


def page_owner(pages: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Owner rank of each logical page: ``pages % C``."""
    return pages % cp_size


def physical_page(pages: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Compact physical page of each logical page on its owner: ``pages // C``."""
    return pages // cp_size


def logical_page(physical: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """Inverse of :func:`physical_page` on ``rank``: ``physical * C + rank``."""
    return physical * cp_size + rank


def owned_page_count(n_logical_pages: int, rank: int, cp_size: int) -> int:
    """Pages among logical ids ``0 .. n-1`` that ``rank`` owns: ``ceil((n - rank) / C)``."""
    return max(0, -(-(n_logical_pages - rank) // cp_size))


def physical_locs(locs: torch.Tensor, page_size: int, cp_size: int) -> torch.Tensor:
    """Logical locs (all owned by one rank) -> that rank's physical locs."""
    return physical_page(locs // page_size, cp_size) * page_size + locs % page_size
