"""Phase 4: the page-aligned in-seq split.

The token-balanced zigzag cuts each request's extend into ``2C`` blocks of nearly equal token
counts, so block boundaries fall anywhere inside a page and a page's current tokens can be
computed by two ranks. Phase 4 cuts at **page boundaries of absolute positions** (``prefix + j``),
not of the chunk start: the extend is first cut into page units (a prefix that ends mid-page
leaves a partial first unit that fills that page, then whole pages, then a partial last page),
and the ``2C`` blocks take whole units, ``units // 2C`` each with the remainder to the first
blocks. Every current page then has exactly one compute owner, which phase 5's direct writes need.

A request with fewer than ``2C`` page units keeps the token-balanced blocks (a block of zero
pages would leave a rank idle); the batch's ``page_aligned`` flag is true only when every request
got aligned blocks. Block token counts are unequal, so consumers must use the per-segment lengths
(never split local queries by halves).
"""

from __future__ import annotations

from collections.abc import Sequence

from reference_impl.cp.split import in_seq_block_sizes


def page_units(prefix: int, extend: int, page_size: int) -> list[int]:
    """Token counts of the extend's pieces between absolute page boundaries."""
    units, pos, end = [], prefix, prefix + extend
    while pos < end:
        boundary = min(end, (pos // page_size + 1) * page_size)
        units.append(boundary - pos)
        pos = boundary
    return units


def page_aligned_block_sizes(prefix: int, extend: int, cp_size: int, page_size: int) -> tuple[int, ...] | None:
    """``2C`` block sizes that end on page boundaries, or ``None`` when there are fewer than ``2C`` units."""
    units = page_units(prefix, extend, page_size)
    n_blocks = 2 * cp_size
    if len(units) < n_blocks:
        return None
    per_block = in_seq_block_sizes(len(units), cp_size)  # units per block, remainder first
    sizes, start = [], 0
    for n in per_block:
        sizes.append(sum(units[start : start + n]))
        start += n
    return tuple(sizes)


def page_aligned_blocks(
    cp_size: int, extend_lens: Sequence[int], prefix_lens: Sequence[int], page_size: int
) -> tuple[list[tuple[int, ...]], bool]:
    """Per request the ``2C`` block sizes (page-aligned where the request has at least ``2C`` page
    units, token-balanced otherwise) and whether every request got aligned blocks.

    :func:`reference_impl.cp.split.build_split` with ``page_aligned=True`` builds the metadata from them.
    """
    blocks, aligned = [], True
    for prefix, extend in zip(prefix_lens, extend_lens):
        sizes = page_aligned_block_sizes(prefix, extend, cp_size, page_size)
        if sizes is None:
            aligned = False
            sizes = in_seq_block_sizes(extend, cp_size)
        blocks.append(sizes)
    return blocks, aligned
