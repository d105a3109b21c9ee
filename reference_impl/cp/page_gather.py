"""Phase 2's materialization: rebuild the dense full view from pages sharded across ranks.

The attention and top-k code keep their dense contract (a ``[S, 576]`` KV view and ``[S, 128]``
index K in sequence order). With KV sharded at rest no rank holds all pages, so per layer every
rank contributes the **physical** pages of its pool that hold tokens the view needs, one padded
all-gather moves them (MLA page bytes and index page bytes side by side in one row per page), and
every rank unpacks the rows of the view from the gathered pages. With the page interleave a
physical page is one logical page; with a finer interleave (:mod:`reference_impl.cp.ownership`)
it packs the rank's runs of several logical pages, and the gather moves whole physical pages all
the same (the pool's page layout, index scales included, stays the unit).

The batch (which pages, who sends what, where each view row comes from) depends only on the batch
batch and ``C``, so it is built once per forward, is identical on every rank, and is reused by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool


@dataclass(frozen=True)
class PageGather:
    """Which pages one rank sends and how the gathered pages map onto full-view rows."""

    pages: torch.Tensor  # [n_need] (owner rank, physical page) keys the view needs, rank-major (the gather's order)
    counts: tuple[int, ...]  # pages each rank sends
    send_physical: torch.Tensor  # [counts[rank]] this rank's physical pages to send
    view_rows: torch.Tensor  # [R] full-view rows filled from storage
    row_source: torch.Tensor  # [R] row in the gathered pages' token rows: page_index * P + slot

    @property
    def n_pages(self) -> int:
        return int(self.pages.shape[0])

    @classmethod
    def build(cls, batch: BatchLocs, view_rows: torch.Tensor, rank: int, ownership: Ownership) -> PageGather:
        """Plan the gather of the physical pages holding ``view_rows`` (full-view rows) of ``batch``."""
        page_size, cp_size = batch.page_size, ownership.cp_size
        locs = batch.view_locs.index_select(0, view_rows)
        owner, physical = ownership.owner(locs), ownership.physical(locs)
        # One key per (owner rank, physical page); sorted keys are rank-major, pages ascending within
        # a rank: the all-gather's order.
        span = int(physical.max()) // page_size + 1 if locs.numel() else 1
        key = owner * span + physical // page_size
        needed, position = torch.unique(key, return_inverse=True)  # sorted
        counts = tuple(int(c) for c in torch.bincount(needed // span, minlength=cp_size))
        mine = needed[needed // span == rank] % span
        row_source = position * page_size + physical % page_size
        return cls(needed, counts, mine, view_rows, row_source)


def gather_pages(
    group: CPGroup, pool: PagedKVPool, layer: int, gather: PageGather
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One padded all-gather of the needed pages -> ``(mla [n_need * P, mla_bytes], index [n_need, page bytes])``.

    On a layer that keeps no indexer K (IndexShare's shared layers) only the MLA pages move, and
    the index part is ``None``.
    """
    if not pool.has_index(layer):
        mla = pool.read_mla_pages(layer, gather.send_physical)
        gathered = group.all_gather_padded(mla, gather.counts, tag="materialize")
        return gathered.reshape(-1, pool.layout.mla_bytes), None
    mla, index = pool.read_pages(layer, gather.send_physical)
    packed = torch.cat([mla, index], dim=1)  # one row per page: MLA page bytes then index page bytes
    gathered = group.all_gather_padded(packed, gather.counts, tag="materialize")  # rank-major = gather.pages
    split = mla.shape[1]
    return gathered[:, :split].reshape(-1, pool.layout.mla_bytes), gathered[:, split:]


def unpack_index_rows(
    index_pages: torch.Tensor, token_rows: torch.Tensor, layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index K of token rows ``page_index * P + slot`` from raw index pages -> ``(k_fp8 [n, D], k_scale [n])``."""
    page_size, dim = layout.page_size, layout.index_head_dim
    values = index_pages[:, : page_size * dim].reshape(-1, dim).index_select(0, token_rows)
    scales = index_pages[:, page_size * dim :].reshape(-1, 4).index_select(0, token_rows)
    return values.view(torch.float8_e4m3fn), scales.view(torch.float32).reshape(-1)


def gather_page_part(group: CPGroup, pool: PagedKVPool, layer: int, gather: PageGather, part: str) -> torch.Tensor:
    """One padded all-gather of one buffer of the needed pages (phase 8 splits MLA from index K).

    ``part="mla"`` -> token rows ``[n_need * P, mla_bytes]``; ``part="index"`` -> ``[n_need, page bytes]``.
    """
    if part == "mla":
        mla = pool.read_mla_pages(layer, gather.send_physical)
        gathered = group.all_gather_padded(mla, gather.counts, tag="prefetch_mla")
        return gathered.reshape(-1, pool.layout.mla_bytes)
    if part == "index":
        index = pool.index_of(layer).index_select(0, gather.send_physical)
        return group.all_gather_padded(index, gather.counts, tag="materialize_index")
    raise ValueError(f"unknown page part {part!r}")
