"""Who stores a token when the KV is sharded at rest, and where: ownership by an interleave.

The cache is sharded in runs of ``I`` consecutive logical slots (the **interleave**): run ``g`` of
slots ``[g * I, (g + 1) * I)`` lives on rank ``g % C``, and each rank packs its runs densely, so
logical loc ``l`` sits at physical loc ``(l // (I * C)) * I + l % I`` of its owner. Pure integer
arithmetic: every rank (and the decode side of a PD transfer) derives the same mapping without
communicating. ``I`` divides the page size:

* ``I = page size`` (in-seq, phase 2): logical page ``p`` lives on rank ``p % C`` at compact
  physical page ``p // C`` (:func:`page_owner`, :func:`physical_page`).
* ``I = 1`` (round-robin, :mod:`reference_impl.cp.split`): slot ``l`` lives on rank ``l % C``.
  Requests start on a fresh page, so when ``C`` divides the page size token ``t`` of every request
  lives on rank ``t % C``, the rank the round-robin split computes it on (direct writes, nothing
  to check per token), and the shards have the layout a decode-context-parallel decode of size
  ``C`` and interleave 1 reads.

Rejected: request-contiguous ownership (rank ``r`` stores a contiguous range of each request):
unstable under chunked prefill, where a request's page count grows chunk by chunk and the ranges
would have to move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.config import validate_interleave


@dataclass(frozen=True)
class Ownership:
    """The sharding of one run's cache: ``cp_size`` ranks, runs of ``interleave`` slots, pages of ``page_size``."""

    cp_size: int
    interleave: int
    page_size: int

    def __post_init__(self) -> None:
        validate_interleave(self.interleave, self.page_size)

    @property
    def by_page(self) -> bool:
        """Whole pages per rank (``I`` = page size): phase 2's page interleave."""
        return self.interleave == self.page_size

    @property
    def follows_positions(self) -> bool:
        """Whether token ``t`` of every request lives on rank ``(t // I) % C``: true when a page holds
        whole rounds of ``I * C`` slots (requests start on a page boundary)."""
        return self.page_size % (self.interleave * self.cp_size) == 0

    def owner(self, locs: torch.Tensor) -> torch.Tensor:
        """Owner rank of each logical loc: ``(l // I) % C``."""
        return (locs // self.interleave) % self.cp_size

    def physical(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical loc of each logical loc on its owner: ``(l // (I * C)) * I + l % I``."""
        i = self.interleave
        return (locs // (i * self.cp_size)) * i + locs % i

    def logical(self, physical: torch.Tensor, rank: int) -> torch.Tensor:
        """Inverse of :meth:`physical` on ``rank``."""
        i = self.interleave
        return (physical // i) * (i * self.cp_size) + rank * i + physical % i

    def pages_held(self, n_logical_pages: int, rank: int) -> int:
        """Physical pages ``rank`` needs for logical pages ``0 .. n-1``: its runs among them, packed."""
        runs = n_logical_pages * self.page_size // self.interleave
        slots = max(0, -(-(runs - rank) // self.cp_size)) * self.interleave
        return -(-slots // self.page_size)


def page_owner(pages: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Owner rank of each logical page under the page interleave: ``pages % C``."""
    return pages % cp_size


def physical_page(pages: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Compact physical page of each logical page on its owner (page interleave): ``pages // C``."""
    return pages // cp_size


def logical_page(physical: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """Inverse of :func:`physical_page` on ``rank``: ``physical * C + rank``."""
    return physical * cp_size + rank


def owned_page_count(n_logical_pages: int, rank: int, cp_size: int) -> int:
    """Pages among logical ids ``0 .. n-1`` that ``rank`` owns (page interleave): ``ceil((n - rank) / C)``."""
    return max(0, -(-(n_logical_pages - rank) // cp_size))


def physical_locs(locs: torch.Tensor, page_size: int, cp_size: int) -> torch.Tensor:
    """Logical locs (all owned by one rank, page interleave) -> that rank's physical locs."""
    return physical_page(locs // page_size, cp_size) * page_size + locs % page_size
