"""Prefill -> decode KV transfer: owned pages from every prefill rank into one full-layout pool.

The decode side is not CP: a :class:`DecodeCache` owns a :class:`PagedKVPool` of the batch's
``n_pages`` logical pages (physical == logical) and writes each received page at its logical
position. It counts every (layer, page) it receives and is complete when the prefill ranks' manifests
partition the pages and every page of every layer arrived exactly once.

Two transports move the same page rows (one row per page and layer: MLA page bytes, then index
page bytes, as :func:`pack_pages` builds them):

* **in-process** (:func:`transfer_in_process`): stores (or ``(manifest, pool)`` pairs) of one process,
  copied with ``read_pages`` / ``write_pages``; what the unit tests use.
* **point-to-point** (:func:`send_owned_pages` / :func:`receive_pages`, run end to end by
  :func:`reference_impl.prefill_decode.run_prefill_and_decode`): a world of ``C + 1`` processes
  over gloo; ranks ``0 .. C-1``
  prefill as one CP group (a subgroup), rank ``C`` decodes. Each prefill rank sends a header
  (``int64 [4]``: pages, layers, MLA page bytes, index page bytes), its logical page ids
  (``int64 [n]``), then one ``uint8 [n, page row bytes]`` tensor per layer; the decode rank
  receives from the prefill ranks in rank order. Nothing is sent for an empty list (a rank that
  owns no page sends only the header).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool

from .manifest import TransferManifest, build_manifest, check_manifests_cover

HEADER_FIELDS = 4  # pages, layers, MLA page bytes, index page bytes
RequestRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (mla uint8 [N, B], index uint8 [N, D], scale f32 [N])


def pack_pages(pool: PagedKVPool, physical_pages: torch.Tensor, layer: int) -> torch.Tensor:
    """Pages ``physical_pages [n] int64`` of ``layer`` -> ``uint8 [n, mla_page_bytes + index_page_bytes]``."""
    if not physical_pages.numel():  # a rank may own no page (and a pool of 0 pages has no page view)
        layout = pool.layout
        return torch.empty(0, layout.mla_page_bytes + layout.index_page_bytes, dtype=torch.uint8, device=pool.device)
    mla, index = pool.read_pages(layer, physical_pages)
    return torch.cat([mla, index], dim=1)


class DecodeCache:
    """The decode side's full-layout pool of ``n_pages`` logical pages, filled page by page."""

    def __init__(
        self, n_pages: int, layout: KVLayout, n_layers: int, device: torch.device | str = "cpu", debug: bool = False
    ) -> None:
        self.layout = layout
        self.pool = PagedKVPool(n_layers, n_pages, layout.page_size, layout, device, debug)
        self.manifests: list[TransferManifest] = []
        self.bytes_received = 0
        self._received = torch.zeros(n_layers, n_pages, dtype=torch.int32)  # host-side counts

    def _check_manifest(self, manifest: TransferManifest) -> None:
        layout, pool = self.layout, self.pool
        if (manifest.page_size, manifest.n_layers, manifest.mla_page_bytes, manifest.index_page_bytes) != (
            layout.page_size,
            pool.n_layers,
            layout.mla_page_bytes,
            layout.index_page_bytes,
        ):
            raise ConfigError(
                f"rank {manifest.rank} sends pages of {manifest.page_size} tokens, {manifest.n_layers} layers, "
                f"{manifest.mla_page_bytes}+{manifest.index_page_bytes} bytes; the decode pool has {layout.page_size} "
                f"tokens, {pool.n_layers} layers, {layout.mla_page_bytes}+{layout.index_page_bytes} bytes"
            )
        if (
            manifest.logical_pages
            and not 0 <= min(manifest.logical_pages) <= max(manifest.logical_pages) < pool.n_pages
        ):
            raise ConfigError(f"rank {manifest.rank} sends pages outside the decode pool's {pool.n_pages} pages")

    def add_manifest(self, manifest: TransferManifest) -> None:
        """Announce a prefill rank's manifest (before its pages arrive)."""
        self._check_manifest(manifest)
        self.manifests.append(manifest)

    def write(self, manifest: TransferManifest, layer: int, rows: torch.Tensor) -> None:
        """Install ``rows uint8 [manifest.n_pages, page row bytes]`` (:func:`pack_pages`) at ``manifest``'s
        logical pages."""
        if manifest not in self.manifests:
            self.add_manifest(manifest)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (manifest.n_pages, manifest.page_row_bytes):
            raise ConfigError(
                f"rank {manifest.rank} layer {layer}: expected page rows uint8 "
                f"[{manifest.n_pages}, {manifest.page_row_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        if not manifest.n_pages:
            return
        pages = list(manifest.logical_pages)
        if bool((self._received[layer, pages] > 0).any()):
            raise ConfigError(f"rank {manifest.rank} layer {layer}: a page arrived twice (manifests overlap)")
        self._received[layer, pages] += 1
        rows = rows.to(self.pool.device)
        split = manifest.mla_page_bytes
        self.pool.write_pages(layer, manifest.logical_tensor(self.pool.device), rows[:, :split], rows[:, split:])
        self.bytes_received += rows.numel()

    def check_complete(self) -> None:
        """Raise :class:`ConfigError` unless every page of every layer arrived exactly once."""
        check_manifests_cover(self.manifests, self.pool.n_pages)
        missing = (self._received != 1).nonzero()
        if missing.numel():
            layer, page = missing[0].tolist()
            raise ConfigError(
                f"decode cache incomplete: {missing.shape[0]} (layer, page) pairs missing, "
                f"first: layer {layer} page {page}"
            )

    def request_rows(self, layer: int, locs: torch.Tensor) -> RequestRows:
        """Rows at logical ``locs``: ``(mla uint8 [N, mla_bytes], index fp8 bytes uint8 [N, D], scale float32 [N])``."""
        locs = locs.to(self.pool.device)
        k_fp8, k_scale = self.pool.read_index(layer, locs)
        return self.pool.read_mla(layer, locs), k_fp8.view(torch.uint8), k_scale


# --------------------------------------------------------------------------------------------
# Transport 1: in-process
# --------------------------------------------------------------------------------------------


def transfer_in_process(
    sources: Sequence[ShardedKV | tuple[TransferManifest, PagedKVPool]],
    n_pages: int,
    layout: KVLayout,
    n_layers: int,
    device: torch.device | str = "cpu",
) -> PagedKVPool:
    """Rebuild the full-layout pool from every prefill rank's store (or ``(manifest, pool)`` pair).

    Raises :class:`ConfigError` for a non-sharded store or when the sources do not cover every page once.
    """
    cache = DecodeCache(n_pages, layout, n_layers, device)
    for source in sources:
        manifest, pool = (
            source
            if isinstance(source, tuple)
            else (build_manifest(source, source.group.rank, source.group.size), source.pool)
        )
        cache.add_manifest(manifest)
        physical = manifest.physical_tensor(pool.device)
        for layer in range(manifest.n_layers):
            cache.write(manifest, layer, pack_pages(pool, physical, layer))
    cache.check_complete()
    return cache.pool


# --------------------------------------------------------------------------------------------
# Transport 2: torch.distributed point-to-point
# --------------------------------------------------------------------------------------------


def send_owned_pages(manifest: TransferManifest, pool: PagedKVPool, decode_rank: int) -> int:
    """Send ``manifest``'s pages of ``pool`` to global rank ``decode_rank``; returns the payload bytes sent."""
    header = torch.tensor(
        [manifest.n_pages, manifest.n_layers, manifest.mla_page_bytes, manifest.index_page_bytes], dtype=torch.long
    )
    dist.send(header, decode_rank)
    if not manifest.n_pages:
        return 0
    dist.send(manifest.logical_tensor(), decode_rank)
    physical = manifest.physical_tensor(pool.device)
    for layer in range(manifest.n_layers):
        dist.send(pack_pages(pool, physical, layer).cpu(), decode_rank)  # gloo moves host tensors
    return manifest.nbytes


def receive_pages(cache: DecodeCache, prefill_ranks: Sequence[int]) -> list[TransferManifest]:
    """Receive every prefill rank's pages (CP rank ``i`` is global rank ``prefill_ranks[i]``) in rank order."""
    cp_size, page_size = len(prefill_ranks), cache.layout.page_size
    manifests = []
    for cp_rank, src in enumerate(prefill_ranks):
        header = torch.empty(HEADER_FIELDS, dtype=torch.long)
        dist.recv(header, src)
        n, n_layers, mla_page_bytes, index_page_bytes = header.tolist()
        pages = torch.empty(n, dtype=torch.long)
        if n:
            dist.recv(pages, src)
        manifest = TransferManifest.from_logical(
            cp_rank, cp_size, page_size, pages.tolist(), n_layers, mla_page_bytes, index_page_bytes
        )
        cache.add_manifest(manifest)  # checks the layout before any page bytes arrive
        for layer in range(n_layers if n else 0):
            rows = torch.empty(n, manifest.page_row_bytes, dtype=torch.uint8)
            dist.recv(rows, src)
            cache.write(manifest, layer, rows)
        manifests.append(manifest)
    cache.check_complete()
    return manifests
