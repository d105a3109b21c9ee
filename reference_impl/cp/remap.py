"""Phase 6: logical -> physical out-cache locs without sorting.

The store path writes each current token at its **physical** row on its owner rank. A generic way
to find that row, the one the production port first used, treats the rank's storage as a table of
logical slots: sort the table, then ``searchsorted`` each logical loc into it
(:func:`sorted_remap`). That is a token-level radix sort plus a binary search, on device, in the
attention hot path, repeated per layer and per write (MLA and indexer K).

Ownership here is page arithmetic (:mod:`reference_impl.cp.ownership`: logical page ``p`` lives on
rank ``p % C`` at physical page ``p // C``), so the inverse map is elementwise
(:func:`page_inverse_remap`): no sort, no search, no host sync, one pass over the locs. It is
computed once per forward and reused by every layer and by both writes. For an allocator whose
pages are not arithmetic, :func:`page_inverse_table` builds the same inverse map at page level
with one scatter (no sort) and :func:`remap_with_table` applies it.

All three return the same thing for the same storage: ``int64 [T]`` physical rows on ``rank``,
``-1`` for locs whose page another rank owns.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError


def _check(locs: torch.Tensor, page_size: int, cp_size: int, rank: int) -> None:
    if locs.dtype != torch.int64 or locs.dim() != 1:
        raise ConfigError(f"remap: locs must be int64 [T], got {locs.dtype} {tuple(locs.shape)}")
    if page_size < 1 or cp_size < 1 or not 0 <= rank < cp_size:
        raise ConfigError(
            f"remap: need page_size >= 1, cp_size >= 1 and 0 <= rank < cp_size, got {page_size}, {cp_size}, {rank}"
        )


def page_inverse_remap(locs: torch.Tensor, page_size: int, cp_size: int, rank: int) -> torch.Tensor:
    """Logical locs ``int64 [T]`` -> physical rows on ``rank``: ``(page // C) * P + slot`` where
    ``page % C == rank``, else ``-1``. Elementwise page arithmetic."""
    _check(locs, page_size, cp_size, rank)
    page = locs // page_size
    physical = (page // cp_size) * page_size + (locs - page * page_size)
    return torch.where(page % cp_size == rank, physical, torch.full_like(physical, -1))


def page_inverse_table(owned_pages: torch.Tensor, n_pages: int) -> torch.Tensor:
    """Inverse page map of any layout: ``owned_pages int64 [n_owned]`` (physical page ``i`` holds
    logical page ``owned_pages[i]``) -> ``int64 [n_pages]``, physical page or ``-1``. One scatter."""
    if owned_pages.dtype != torch.int64 or owned_pages.dim() != 1:
        raise ConfigError(
            f"page table: owned_pages must be int64 [n], got {owned_pages.dtype} {tuple(owned_pages.shape)}"
        )
    table = torch.full((n_pages,), -1, dtype=torch.int64, device=owned_pages.device)
    table[owned_pages] = torch.arange(owned_pages.shape[0], device=owned_pages.device)
    return table


def remap_with_table(locs: torch.Tensor, table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Logical locs -> physical rows through an inverse page table (:func:`page_inverse_table`); -1 where unowned."""
    page = locs // page_size
    physical_page = table.index_select(0, page)
    return torch.where(physical_page >= 0, physical_page * page_size + (locs - page * page_size), -1)


def owned_slot_table(
    page_size: int, cp_size: int, rank: int, n_pages: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The logical slot held by each physical row of ``rank`` (physical order), for pages ``< n_pages``."""
    owned_pages = torch.arange(rank, max(n_pages, rank), cp_size, device=device)
    return (owned_pages[:, None] * page_size + torch.arange(page_size, device=device)).flatten()


def sorted_remap(
    locs: torch.Tensor,
    page_size: int,
    cp_size: int,
    rank: int,
    n_pages: int,
    slot_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sort-based baseline: ``torch.sort`` the rank's logical slot table, ``torch.searchsorted``
    each loc into it, and return the matching physical row (``-1`` where the loc is not in the table).

    ``slot_table`` (the logical slot of each physical row) defaults to :func:`owned_slot_table`;
    a generic allocator hands it over in arbitrary order, hence the sort.
    """
    _check(locs, page_size, cp_size, rank)
    table = owned_slot_table(page_size, cp_size, rank, n_pages, locs.device) if slot_table is None else slot_table
    if table.numel() == 0:
        return torch.full_like(locs, -1)
    sorted_slots, physical_row = torch.sort(table)
    position = torch.searchsorted(sorted_slots, locs).clamp_(max=table.shape[0] - 1)
    hit = sorted_slots.index_select(0, position) == locs
    return torch.where(hit, physical_row.index_select(0, position), -1)
