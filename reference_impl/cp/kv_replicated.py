"""Phase 0 storage: the replicated KV cache (physical loc == logical loc on every rank).

After the per-layer all-gather and rerange every rank holds the whole current chunk in sequence
order; it quantizes it and writes **every** token into its own pool, so each rank keeps a full
replica of the batch's KV and indexer K. The full view is read back from that pool.

It implements :class:`~reference_impl.cp.kv_store.KVStore`, the interface the sharded store of
later phases implements too, so the engine does not change between phases.
"""

from __future__ import annotations

import torch

from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.fused_ops import fused_store
from reference_impl.cp.kv_store import FullView, PoolBytesAtRest, StoredRows, check_index_input
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


class ReplicatedKV(PoolBytesAtRest):
    """Every rank stores every token of the batch (the baseline)."""

    name = "replicated"
    sharded = False
    store_path = "replicated"

    def __init__(
        self, batch: BatchLocs, layout: KVLayout, n_layers: int, device: torch.device, debug: bool, fused: bool = False
    ) -> None:
        self.batch = batch
        self.fused, self.debug = fused, debug  # phase 7: the fused store kernels
        self.layout = layout
        self.pool = PagedKVPool(n_layers, batch.n_pages, batch.page_size, layout, device, debug)
        self.materialized_bytes = 0  # bytes read from storage to build full views, all layers
        self.transient_bytes = 0  # no gather buffers beyond the full view
        self.bind(batch)

    def bind(self, batch: BatchLocs) -> None:
        """Serve the next chunk of a chunked prefill (same page-id space, same pool)."""
        if batch.n_pages != self.batch.n_pages:
            raise ValueError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        # Range-checked once per batch (a host read), so the layer loop's fused ops read nothing.
        check_in_range("store locs", batch.extend_locs, self.pool.n_slots)

    def write_prefix(
        self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, start: int = 0
    ) -> None:
        """Install a request's already-cached prefix tokens ``[start, start + len(rows))`` (packed rows and
        quantized index K)."""
        locs = self.batch.prefix_locs(request)[start : start + rows.shape[0]]
        self.pool.write_mla(layer, locs, rows)
        if self.pool.has_index(layer):  # IndexShare: a shared layer keeps no index K
            self.pool.write_index(layer, locs, k_fp8, k_scale)

    def store_current(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        kv_local: torch.Tensor | None = None,
        index_k_local: torch.Tensor | None = None,
    ) -> None:
        """Quantize the all-gathered current chunk ``[T, 576]``/``[T, D]`` and write all of it
        (``index_k_seq`` is ``None`` on an IndexShare shared layer).

        (``kv_local``/``index_k_local`` are for phase 5's direct writes; a replica needs the whole chunk.)
        """
        with_index = check_index_input(self.pool, layer, index_k_seq)
        if self.fused:
            fused_store(
                self.pool, layer, kv_seq, index_k_seq, None, self.batch.extend_locs, self.debug, locs_checked=True
            )
            return
        self.pool.write_mla(layer, self.batch.extend_locs, self.layout.pack_mla(kv_seq))
        if with_index:
            assert index_k_seq is not None
            k_fp8, k_scale = self.layout.quantize_index_k(index_k_seq)
            self.pool.write_index(layer, self.batch.extend_locs, k_fp8, k_scale)

    def full_view(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        prefetched_kv: torch.Tensor | None = None,
    ) -> FullView:
        """Read every full-view row back from the local replica and dequantize the MLA part (and,
        on a layer that keeps it, read the index K).

        (A replica has nothing to prefetch: ``prefetched_kv`` must be ``None``.)"""
        if prefetched_kv is not None:
            raise ValueError("a replicated store has no history to prefetch")
        rows = self.pool.read_mla(layer, self.batch.view_locs)
        self.materialized_bytes += rows.numel()
        kv = self.layout.dequantize_mla(rows).to(torch.bfloat16)
        if not self.pool.has_index(layer):
            return FullView(kv, None, None)
        k_fp8, k_scale = self.pool.read_index(layer, self.batch.view_locs)
        self.materialized_bytes += k_fp8.numel() + k_scale.numel() * 4
        return FullView(kv, k_fp8, k_scale)

    def owned_pages(self) -> torch.Tensor:
        """Every logical page of the batch: a replica holds them all."""
        return torch.arange(self.batch.n_pages, device=self.batch.view_locs.device)

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """What this rank holds for ``layer``, per request: ``(positions, mla rows, index fp8, index scale)``.

        ``request_locs`` (default: this batch's) lists each request's logical locs.
        ``positions`` are token positions within the request; the replica holds all of them. The index
        values come as raw bytes (uint8) so they pickle across processes.
        """
        out: StoredRows = {}
        for req, locs in enumerate(request_locs if request_locs is not None else self.batch.request_locs):
            positions = torch.arange(locs.shape[0], device=locs.device)
            if not self.pool.has_index(layer):  # IndexShare: no index K on a shared layer
                out[req] = (positions, self.pool.read_mla(layer, locs), None, None)
                continue
            k_fp8, k_scale = self.pool.read_index(layer, locs)
            out[req] = (positions, self.pool.read_mla(layer, locs), k_fp8.view(torch.uint8), k_scale)
        return out
