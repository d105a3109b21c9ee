"""Phase 2 storage: KV sharded at rest (each rank stores only the pages it owns).

Logical locs stay what the allocator handed out; physical storage is per rank, by the run's
:class:`~reference_impl.cp.ownership.Ownership`: with the page interleave (in-seq) logical page
``p`` lives on rank ``p % C`` at compact physical page ``p // C``; with interleave 1 (round-robin)
slot ``l`` lives on rank ``l % C``, so every rank stores exactly the tokens it computes.

* **store**: after all-gather #1 every rank holds the whole current chunk, quantizes the tokens
  it owns, and writes them at their physical locs; or (phase 5 in-seq, round-robin at interleave
  1) each rank writes the rows it computed, directly;
* **full view**: rebuilt per layer by :mod:`reference_impl.cp.page_gather` (all pages), or, with
  phase 3 (:mod:`reference_impl.cp.current_reuse`), current rows from the gathered chunk and only
  the history pages materialized.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.compute_owner import direct_write_ok
from reference_impl.cp.current_reuse import BatchKind, classify_batch, fill_current, history_rows
from reference_impl.cp.fused_ops import fill_current_rows, fused_store, materialize_mla_rows, materialize_rows
from reference_impl.cp.kv_store import FullView, PoolBytesAtRest, StoredRows, check_index_input
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.page_gather import PageGather, gather_page_part, gather_pages, unpack_index_rows
from reference_impl.cp.split_index import local_index_tensor
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


class ShardedKV(PoolBytesAtRest):
    """Each rank stores the MLA latent and indexer K of the tokens it owns (``ownership.owner(loc) == rank``)."""

    name = "sharded"
    sharded = True

    def __init__(
        self,
        batch: BatchLocs,
        layout: KVLayout,
        n_layers: int,
        group: CPGroup,
        debug: bool,
        reuse_current: bool,
        direct_write: bool = False,
        fused: bool = False,
        ownership: Ownership | None = None,
    ) -> None:
        self.ownership = ownership or Ownership(group.size, batch.page_size, batch.page_size)
        if (self.ownership.cp_size, self.ownership.page_size) != (group.size, batch.page_size):
            raise ConfigError(f"{self.ownership} does not describe {group.size} ranks with pages of {batch.page_size}")
        self.layout, self.group = layout, group
        self.batch = batch
        self.reuse_current, self.allow_direct_write = reuse_current, direct_write
        self.fused, self.debug = fused, debug  # phase 7: fused store / materialize kernels
        self.pool = PagedKVPool(
            n_layers, self.ownership.pages_held(batch.n_pages, group.rank), batch.page_size, layout, group.device, debug
        )
        self.materialized_bytes = 0
        self.transient_bytes = 0
        self.bind(batch)

    def bind(self, batch: BatchLocs) -> None:
        """Derive this batch's store and full-view plans (once per batch; every layer reuses them).

        Called again for each chunk of a chunked prefill: same page-id space, same pool.
        """
        if batch.n_pages != self.batch.n_pages:
            raise ConfigError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        rank, ownership = self.group.rank, self.ownership

        # Store path: which current tokens (sequence order) this rank owns, and where they go.
        own = ownership.owner(batch.extend_locs) == rank
        self._store_rows = own.nonzero().flatten()
        self._store_locs = ownership.physical(batch.extend_locs[own])
        # The rank owns every token it computed (phase 5, or round-robin at interleave 1), so it
        # writes its local rows directly.
        self.direct_write = self.allow_direct_write and direct_write_ok(batch.meta, batch.extend_locs, ownership)
        if self.direct_write:
            local = local_index_tensor(batch.meta, rank, batch.extend_locs.device)
            self._local_locs = ownership.physical(batch.extend_locs.index_select(0, local))

        # Full-view path, decided once per batch (identical on every rank).
        self.batch_kind: BatchKind = (
            classify_batch(batch, batch.meta.total_tokens) if self.reuse_current else "fallback"
        )
        storage_rows = (
            history_rows(batch)
            if self.batch_kind != "fallback"
            else torch.arange(batch.view_len, device=batch.view_locs.device)
        )
        self._gather = PageGather.build(batch, storage_rows, rank, ownership) if storage_rows.numel() else None
        # Range-checked once per batch (a host read), so the layer loop's fused ops read nothing.
        check_in_range("store locs", self._store_locs, self.pool.n_slots)
        if self.direct_write:
            check_in_range("direct-write locs", self._local_locs, self.pool.n_slots)
        if self._gather is not None:
            check_in_range("view rows", self._gather.view_rows, batch.view_len)
            check_in_range("gathered token rows", self._gather.row_source, self._gather.n_pages * batch.page_size)
        if self.batch_kind != "fallback":
            check_in_range("current view rows", batch.extend_view_rows, batch.view_len)

    @property
    def store_path(self) -> str:
        """``"direct"`` when this batch's rank writes its own rows, else ``"gathered"``."""
        return "direct" if self.direct_write else "gathered"

    def _owned(self, locs: torch.Tensor) -> torch.Tensor:
        return self.ownership.owner(locs) == self.group.rank

    def write_prefix(
        self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, start: int = 0
    ) -> None:
        """Install the owned part of a request's already-cached prefix tokens ``[start, start + len(rows))``."""
        locs = self.batch.prefix_locs(request)[start : start + rows.shape[0]]
        own = self._owned(locs)
        phys = self.ownership.physical(locs[own])
        self.pool.write_mla(layer, phys, rows[own])
        if self.pool.has_index(layer):  # IndexShare: a shared layer keeps no index K
            self.pool.write_index(layer, phys, k_fp8[own], k_scale[own])

    def store_current(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        kv_local: torch.Tensor | None = None,
        index_k_local: torch.Tensor | None = None,
    ) -> None:
        """Quantize and write the current tokens this rank owns: its own computed rows (phase 5
        direct write, ``kv_local`` in local order) or its share of the gathered chunk (phase 2).
        The index K tensors are ``None`` on an IndexShare shared layer: the MLA rows alone."""
        with_index = check_index_input(self.pool, layer, index_k_seq)
        if self.direct_write and kv_local is not None and (index_k_local is not None or not with_index):
            if self.fused:
                fused_store(
                    self.pool, layer, kv_local, index_k_local, None, self._local_locs, self.debug, locs_checked=True
                )
                return
            self.pool.write_mla(layer, self._local_locs, self.layout.pack_mla(kv_local))
            if index_k_local is not None:
                k_fp8, k_scale = self.layout.quantize_index_k(index_k_local)
                self.pool.write_index(layer, self._local_locs, k_fp8, k_scale)
            return
        if self.fused:
            fused_store(
                self.pool, layer, kv_seq, index_k_seq, self._store_rows, self._store_locs, self.debug, locs_checked=True
            )
            return
        kv = kv_seq.index_select(0, self._store_rows)
        self.pool.write_mla(layer, self._store_locs, self.layout.pack_mla(kv))
        if index_k_seq is not None:
            k_fp8, k_scale = self.layout.quantize_index_k(index_k_seq.index_select(0, self._store_rows))
            self.pool.write_index(layer, self._store_locs, k_fp8, k_scale)

    def new_view_kv(self) -> torch.Tensor:
        """An uninitialized full-view KV buffer for this batch: bf16 ``[view_len, kv_width]``."""
        return torch.empty(self.batch.view_len, self.layout.kv_width, dtype=torch.bfloat16, device=self.pool.mla.device)

    def materialize_history_mla(self, layer: int, kv: torch.Tensor) -> None:
        """Phase 8's prefetch payload: write ``layer``'s history MLA rows into their full-view rows of
        ``kv`` (bf16 ``[view_len, kv_width]``). One all-gather, then one unpack (fused with phase 7)."""
        assert self._gather is not None
        mla_rows = gather_page_part(self.group, self.pool, layer, self._gather, "mla")
        self.materialized_bytes += mla_rows.numel()
        rows, source = self._gather.view_rows, self._gather.row_source
        if self.fused:
            materialize_mla_rows(mla_rows, source, rows, kv, self.layout, debug=self.debug, locs_checked=True)
        else:
            kv[rows] = self.layout.dequantize_mla(mla_rows.index_select(0, source)).to(torch.bfloat16)

    @property
    def page_gather(self) -> PageGather | None:
        return self._gather

    def full_view(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        prefetched_kv: torch.Tensor | None = None,
    ) -> FullView:
        """Materialize what storage must provide, then (phase 3) fill current rows from the chunk.

        ``prefetched_kv`` (phase 8) is a full-view KV buffer whose history rows
        :meth:`materialize_history_mla` already wrote for this layer; it becomes the view's ``kv``
        and only the index pages are gathered here, synchronously. On an IndexShare shared layer
        (no indexer K) nothing of the index moves and the view's index fields are ``None``.
        """
        n, layout, device = self.batch.view_len, self.layout, kv_seq.device
        with_index = check_index_input(self.pool, layer, index_k_seq)
        kv = prefetched_kv if prefetched_kv is not None else self.new_view_kv()
        index_fp8 = (
            torch.empty(n, layout.index_head_dim, dtype=torch.float8_e4m3fn, device=device) if with_index else None
        )
        index_scale = torch.empty(n, dtype=torch.float32, device=device) if with_index else None
        self.transient_bytes = 0
        if self._gather is not None and prefetched_kv is not None:
            # the second alternating view buffer, and the gathered MLA pages of the next layer
            next_mla = self._gather.n_pages * self.batch.page_size * layout.mla_bytes
            self.transient_bytes = kv.numel() * kv.element_size() + next_mla
            if index_fp8 is not None and index_scale is not None:
                rows, source = self._gather.view_rows, self._gather.row_source
                index_pages = gather_page_part(self.group, self.pool, layer, self._gather, "index")
                k_fp8, k_scale = unpack_index_rows(index_pages, source, layout)
                index_fp8.view(torch.uint8)[rows] = k_fp8.view(torch.uint8)
                index_scale[rows] = k_scale
                self.transient_bytes += index_pages.numel()
                self.materialized_bytes += index_pages.numel()
        elif self._gather is not None:
            mla_rows, index_pages = gather_pages(self.group, self.pool, layer, self._gather)
            rows, source = self._gather.view_rows, self._gather.row_source
            if index_pages is None or index_fp8 is None or index_scale is None:  # IndexShare: MLA only
                if self.fused:
                    materialize_mla_rows(mla_rows, source, rows, kv, layout, debug=self.debug, locs_checked=True)
                else:
                    kv[rows] = layout.dequantize_mla(mla_rows.index_select(0, source)).to(torch.bfloat16)
                self.transient_bytes = mla_rows.numel()
            else:
                if self.fused:
                    materialize_rows(
                        mla_rows,
                        index_pages,
                        source,
                        rows,
                        kv,
                        index_fp8,
                        index_scale,
                        layout,
                        debug=self.debug,
                        locs_checked=True,
                    )
                else:
                    kv[rows] = layout.dequantize_mla(mla_rows.index_select(0, source)).to(torch.bfloat16)
                    k_fp8, k_scale = unpack_index_rows(index_pages, source, layout)
                    index_fp8.view(torch.uint8)[rows] = k_fp8.view(torch.uint8)
                    index_scale[rows] = k_scale
                self.transient_bytes = mla_rows.numel() + index_pages.numel()
            self.materialized_bytes += self.transient_bytes
        if self.batch_kind != "fallback":
            if self.fused:
                fill_current_rows(
                    kv_seq,
                    index_k_seq,
                    self.batch.extend_view_rows,
                    kv,
                    index_fp8,
                    index_scale,
                    layout,
                    debug=self.debug,
                    locs_checked=True,
                )
            else:
                fill_current(self.batch, layout, kv_seq, index_k_seq, kv, index_fp8, index_scale)
        return FullView(kv, index_fp8, index_scale)

    def owned_pages(self) -> torch.Tensor:
        """Logical pages of this batch stored on this rank, ascending (their physical page is ``p // C``).

        Whole pages exist only under the page interleave; a finer one spreads every page over the ranks.
        """
        if not self.ownership.by_page:
            raise ConfigError(
                f"kv_interleave={self.ownership.interleave} spreads every page over the ranks: no rank owns whole "
                "pages (send the shards as they are: reference_impl.pd.dcp)"
            )
        pages = torch.arange(self.batch.n_pages, device=self.batch.view_locs.device)
        return pages[self.ownership.owner(pages * self.batch.page_size) == self.group.rank]

    def owned_rows(self, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of a request's logical ``locs`` (position order): the positions this rank stores and
        their physical locs (one host read: plan it outside the layer loop)."""
        own = self._owned(locs)
        return own.nonzero().flatten(), self.ownership.physical(locs[own])

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """Per request (``request_locs``, default this batch's), the tokens this rank holds:
        ``(positions, mla rows, index bytes, index scale)``."""
        out: StoredRows = {}
        for req, locs in enumerate(request_locs if request_locs is not None else self.batch.request_locs):
            positions, phys = self.owned_rows(locs)
            if not self.pool.has_index(layer):  # IndexShare: no index K on a shared layer
                out[req] = (positions, self.pool.read_mla(layer, phys), None, None)
                continue
            k_fp8, k_scale = self.pool.read_index(layer, phys)
            out[req] = (positions, self.pool.read_mla(layer, phys), k_fp8.view(torch.uint8), k_scale)
        return out
