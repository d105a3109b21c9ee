"""Layer split: each CP rank owns every token of a contiguous block of layers.

SGLang's DSA cache layer split (``LayerSplitDSATokenToKVPool``, merged): rank ``r`` stores the MLA
latent and indexer K of **all** tokens for its layers ``[start_r, end_r)`` (the layers split as
evenly as possible, the first ``L mod C`` ranks one more, :func:`layer_shard_range`) and nothing for
the others; a layer that a rank does not own is broadcast from its owner into a scratch slot.

* **store**: after all-gather #1 every rank holds the whole current chunk; the layer's owner
  quantizes and writes all of it (physical loc == logical loc in the owner's pool), the others
  write nothing for that layer;
* **gather**: per layer, the owner broadcasts the pages holding the batch's history (prefix)
  rows, MLA then index K (two broadcasts), one layer ahead of the layer that reads them
  (:class:`~reference_impl.cp.designs.common.HistoryAhead`); a current-only batch broadcasts nothing;
* **materialize**: history rows of the full view from the broadcast pages, current rows from the
  gathered chunk.

Where this differs from the engine: SGLang broadcasts the layer's whole buffer (pool-sized) into a
pool-sized remote slot, current rows included, and index K synchronously after the layer's write;
an open follow-up narrows the broadcast to the rows a batch reads. Here the broadcast is the
batch's history pages, which is the least a layer split must move.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.current_reuse import history_rows
from reference_impl.cp.designs.common import HistoryAhead, nothing_stored, store_rows, stored_rows_of
from reference_impl.cp.kv_store import StoredRows
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


def layer_shard_range(rank: int, cp_size: int, n_layers: int) -> tuple[int, int]:
    """Layers ``[start, end)`` that ``rank`` owns: contiguous, as even as possible, the first
    ``n_layers % cp_size`` ranks one more (61 layers over 8 ranks: 8, 8, 8, 8, 8, 7, 7, 7)."""
    base, extra = divmod(n_layers, cp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def layer_owner(layer: int, cp_size: int, n_layers: int) -> int:
    """The rank that owns ``layer`` under :func:`layer_shard_range`."""
    for rank in range(cp_size):
        start, end = layer_shard_range(rank, cp_size, n_layers)
        if start <= layer < end:
            return rank
    raise ConfigError(f"layer {layer} is outside the model's {n_layers} layers")


class LayerSplitKV(HistoryAhead):
    """A rank's owned layers (all tokens) and a two-slot broadcast scratch for the others."""

    name = "layer-split"
    sharded = True
    store_path = "layer-owner"  # the layer's owner writes the whole gathered chunk

    def __init__(
        self, batch: BatchLocs, layout: KVLayout, n_layers: int, group: CPGroup, debug: bool, fused: bool = False
    ) -> None:
        self.layout, self.group, self.debug, self.fused = layout, group, debug, fused
        self.n_layers = n_layers
        self.start, self.end = layer_shard_range(group.rank, group.size, n_layers)
        owned = self.end - self.start
        # A rank that owns no layer (C > L) keeps an empty pool.
        self.pool = PagedKVPool(
            max(1, owned), batch.n_pages if owned else 0, batch.page_size, layout, group.device, debug
        )
        self.batch = batch
        self.materialized_bytes = 0
        self.transient_bytes = 0
        self.bind(batch)

    def local_layer(self, layer: int) -> int | None:
        """This rank's pool index of ``layer``, or ``None`` when another rank owns it."""
        return layer - self.start if self.start <= layer < self.end else None

    @property
    def kv_bytes(self) -> int:
        return self.pool.mla_bytes_total if self.end > self.start else 0

    @property
    def index_bytes(self) -> int:
        return self.pool.index_bytes_total if self.end > self.start else 0

    def breakdown(self) -> dict[str, int]:
        return {}

    def bind(self, batch: BatchLocs) -> None:
        """Plan the batch's broadcast (its history pages) and the view rows they fill; once per batch."""
        if batch.n_pages != self.batch.n_pages:
            raise ConfigError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        rows = history_rows(batch)
        page_size = batch.page_size
        locs = batch.view_locs.index_select(0, rows)
        pages, position = torch.unique(locs // page_size, return_inverse=True)
        self._pages = pages  # [n] logical pages holding history, ascending: the broadcast's order
        check_in_range("store locs", batch.extend_locs, batch.n_pages * page_size)
        self.plan_history(rows, position * page_size + locs % page_size, self.n_layers, self._broadcast)

    def _broadcast(self, layer: int, slot: int) -> None:
        """Layer ``layer``'s history pages from its owner into ``slot``: MLA, then index K (two broadcasts)."""
        owner = layer_owner(layer, self.group.size, self.n_layers)
        local = self.local_layer(layer)
        n, layout = self._pages.shape[0], self.layout
        if local is not None:
            mla, index = self.pool.read_pages(local, self._pages)
        else:
            device = self.group.device
            mla = torch.empty(n, layout.mla_page_bytes, dtype=torch.uint8, device=device)
            index = torch.empty(n, layout.index_page_bytes, dtype=torch.uint8, device=device)
        self.group.broadcast_rows(mla, owner, tag="materialize")
        self.group.broadcast_rows(index, owner, tag="materialize_index")
        self._slots[slot] = (mla, index)

    def write_prefix(
        self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, start: int = 0
    ) -> None:
        """The owner of ``layer`` installs the request's cached prefix tokens ``[start, start + len(rows))``."""
        local = self.local_layer(layer)
        if local is None:
            return
        locs = self.batch.prefix_locs(request)[start : start + rows.shape[0]]
        self.pool.write_mla(local, locs, rows)
        self.pool.write_index(local, locs, k_fp8, k_scale)

    def store_current(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor,
        kv_local: torch.Tensor | None = None,
        index_k_local: torch.Tensor | None = None,
    ) -> None:
        """The owner of ``layer`` writes the whole gathered chunk; the other ranks write nothing."""
        local = self.local_layer(layer)
        if local is not None:
            store_rows(self.pool, local, kv_seq, index_k_seq, None, self.batch.extend_locs, self.fused, self.debug)

    def owned_pages(self) -> torch.Tensor:
        raise ConfigError(
            "layer split owns layers, not pages: its PD transfer (per owned layer) is not in this package"
        )

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """Every token of every request on the layer's owner; nothing elsewhere."""
        located = list(request_locs if request_locs is not None else self.batch.request_locs)
        local = self.local_layer(layer)
        if local is None:
            return {req: nothing_stored(self.layout, self.group.device) for req in range(len(located))}
        return stored_rows_of(
            self.pool, local, [(torch.arange(locs.shape[0], device=locs.device), locs) for locs in located]
        )
