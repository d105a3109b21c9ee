"""What one prefill rank sends to decode: its owned pages and their logical positions.

With KV sharded at rest (phase 2) every logical page of the batch lives on exactly one prefill
rank, its owner ``p % C``, at compact physical page ``p // C`` (:mod:`reference_impl.cp.ownership`).
A rank's **manifest** lists those pages: the logical page ids the decode side writes to and
the physical pages the rank reads from, for the MLA buffer and the indexer K buffer of every
layer. The manifests of the ``C`` ranks partition the batch's logical pages (each page in exactly one
manifest), which :func:`check_manifests_cover` verifies before a decode cache is declared complete.

On the wire a page travels as one row of ``mla_page_bytes + index_page_bytes`` bytes: the MLA
page bytes, then the index page bytes (the row layout of :func:`reference_impl.cp.page_gather.gather_pages`).

Only a sharded store has owned pages: a replicated (phase 0) store is refused, since every rank
holds every page and "the pages a rank sends" would need a different rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.kv_store import KVStore
from reference_impl.cp.ownership import logical_page, page_owner, physical_page


@dataclass(frozen=True)
class TransferManifest:
    """Pages prefill rank ``rank`` of a CP group of ``cp_size`` sends, every layer.

    ``logical_pages[i]`` (ascending) is stored at ``physical_pages[i]`` of the rank's pool; both
    tuples have the same length. Per page and layer the rank sends ``mla_page_bytes`` MLA bytes
    and ``index_page_bytes`` indexer K bytes.
    """

    rank: int
    cp_size: int
    page_size: int
    logical_pages: tuple[int, ...]
    physical_pages: tuple[int, ...]
    n_layers: int
    mla_page_bytes: int
    index_page_bytes: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.cp_size:
            raise ConfigError(f"manifest rank {self.rank} is outside the CP group of {self.cp_size}")
        if len(self.logical_pages) != len(self.physical_pages):
            raise ConfigError(
                f"manifest of rank {self.rank}: {len(self.logical_pages)} logical pages but "
                f"{len(self.physical_pages)} physical pages"
            )
        for logical, physical in zip(self.logical_pages, self.physical_pages):
            if logical % self.cp_size != self.rank or logical // self.cp_size != physical:
                raise ConfigError(
                    f"manifest of rank {self.rank}: logical page {logical} is not owned by this rank "
                    f"at physical page {physical} (owner = page % {self.cp_size}, physical = page // {self.cp_size})"
                )

    @property
    def n_pages(self) -> int:
        """Pages this rank sends (per layer)."""
        return len(self.logical_pages)

    @property
    def page_row_bytes(self) -> int:
        """Bytes of one page on the wire, one layer: MLA page bytes then index page bytes."""
        return self.mla_page_bytes + self.index_page_bytes

    @property
    def nbytes(self) -> int:
        """Payload bytes of the whole transfer: every owned page of every layer (headers excluded)."""
        return self.n_layers * self.n_pages * self.page_row_bytes

    def logical_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``logical_pages`` as an int64 tensor (where the decode side writes)."""
        return torch.tensor(self.logical_pages, dtype=torch.long, device=device)

    def physical_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``physical_pages`` as an int64 tensor (where this rank's pool reads)."""
        return torch.tensor(self.physical_pages, dtype=torch.long, device=device)

    @classmethod
    def from_logical(
        cls,
        rank: int,
        cp_size: int,
        page_size: int,
        logical_pages: Sequence[int],
        n_layers: int,
        mla_page_bytes: int,
        index_page_bytes: int,
    ) -> TransferManifest:
        """The manifest of ``rank`` for the given logical pages (the decode side's view of a header)."""
        pages = tuple(int(p) for p in logical_pages)
        return cls(
            rank,
            cp_size,
            page_size,
            pages,
            tuple(p // cp_size for p in pages),
            n_layers,
            mla_page_bytes,
            index_page_bytes,
        )


def build_manifest(store: KVStore, rank: int, cp_size: int) -> TransferManifest:
    """The manifest of rank ``rank``'s sharded store: its owned logical pages and their physical pages.

    Raises :class:`ConfigError` for a store that does not shard its pages (the replicated baseline:
    every rank holds every page, so "the pages a rank sends" is not defined).
    """
    if not store.sharded:
        raise ConfigError(
            f"PD transfer of owned pages needs phase 2 (KV sharded at rest); got a {store.name!r} KV store"
        )
    cp, layout = cp_size, store.layout
    logical = store.owned_pages().cpu()
    physical = physical_page(logical, cp)
    # The ownership rule and its inverse must agree with where the store put the pages.
    assert bool((page_owner(logical, cp) == rank).all()) and torch.equal(logical_page(physical, rank, cp), logical)
    if logical.numel() and int(physical.max()) >= store.pool.n_pages:
        raise ConfigError(
            f"rank {rank}: owned page {int(logical.max())} maps past its pool of {store.pool.n_pages} pages"
        )
    return TransferManifest(
        rank=rank,
        cp_size=cp,
        page_size=store.batch.page_size,
        logical_pages=tuple(logical.tolist()),
        physical_pages=tuple(physical.tolist()),
        n_layers=store.pool.n_layers,
        mla_page_bytes=layout.mla_page_bytes,
        index_page_bytes=layout.index_page_bytes,
    )


def check_manifests_cover(manifests: Sequence[TransferManifest], n_pages: int) -> None:
    """Raise :class:`ConfigError` unless ``manifests`` come from one CP group, agree on the layout and
    cover logical pages ``0 .. n_pages-1`` exactly once."""
    if not manifests:
        raise ConfigError("no manifests: a decode cache needs the pages of every prefill rank")
    first = manifests[0]
    shape = (first.cp_size, first.page_size, first.n_layers, first.mla_page_bytes, first.index_page_bytes)
    ranks = [p.rank for p in manifests]
    if sorted(ranks) != list(range(first.cp_size)):
        absent = sorted(set(range(first.cp_size)) - set(ranks))
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ConfigError(
            f"manifests of a CP group of {first.cp_size}: missing rank(s) {absent}, repeated rank(s) {repeated}"
        )
    seen = [0] * n_pages
    for manifest in manifests:
        if (
            manifest.cp_size,
            manifest.page_size,
            manifest.n_layers,
            manifest.mla_page_bytes,
            manifest.index_page_bytes,
        ) != shape:
            raise ConfigError(f"manifest of rank {manifest.rank} disagrees with rank {first.rank}'s layout")
        for page in manifest.logical_pages:
            if not 0 <= page < n_pages:
                raise ConfigError(
                    f"rank {manifest.rank} sends logical page {page}, outside the batch's {n_pages} pages"
                )
            seen[page] += 1
    missing = [p for p, n in enumerate(seen) if n == 0]
    twice = [p for p, n in enumerate(seen) if n > 1]
    if missing or twice:
        raise ConfigError(f"manifests do not partition {n_pages} pages: missing {missing[:8]}, repeated {twice[:8]}")
