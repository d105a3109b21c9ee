"""The KV store interface: what the engine and the PD transfer ask of a rank's KV storage.

Two implementations: :class:`~reference_impl.cp.kv_replicated.ReplicatedKV` (the baseline: every
rank stores every token) and :class:`~reference_impl.cp.kv_sharded.ShardedKV` (phase 2 and the
phases on top: each rank stores the pages it owns). The engine builds one per run
(:func:`reference_impl.engine.make_kv_store`) and from then on uses only this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool

StoredRows = dict[int, tuple[torch.Tensor | None, ...]]
"""Per request: ``(positions in the request, mla rows uint8, index fp8 bytes uint8, index scale f32)``;
the two index entries are ``None`` on a layer that keeps no indexer K (IndexShare's shared layers)."""


@dataclass
class FullView:
    """Dense, sequence-ordered KV of the whole batch, as the attention and top-k code expect.

    The index K fields are ``None`` on an IndexShare shared layer (it reuses a full layer's top-k).
    """

    kv: torch.Tensor  # [S, kv_lora + rope] bf16 (dequantized cache)
    index_k_fp8: torch.Tensor | None  # [S, D] float8_e4m3fn
    index_k_scale: torch.Tensor | None  # [S] float32

    @property
    def nbytes(self) -> int:
        parts = (self.kv, self.index_k_fp8, self.index_k_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


class PoolBytesAtRest:
    """``kv_bytes`` and ``index_bytes`` of a store that keeps everything it holds in ``self.pool``."""

    pool: PagedKVPool

    @property
    def kv_bytes(self) -> int:
        """MLA bytes at rest, all layers."""
        return self.pool.mla_bytes_total

    @property
    def index_bytes(self) -> int:
        """Indexer K bytes at rest, all layers."""
        return self.pool.index_bytes_total

    def breakdown(self) -> dict[str, int]:
        """Nothing beyond ``kv_bytes`` and ``index_bytes`` (the run report's family-specific counts)."""
        return {}


class KVStore(Protocol):
    """A rank's KV storage for one run: its pool, the batch it serves, and the per-layer operations."""

    name: str  # "replicated" or "sharded"
    sharded: bool  # True when every logical page lives on exactly one rank (its owner)
    layout: KVLayout
    pool: PagedKVPool
    batch: BatchLocs  # the batch (chunk) it serves now
    materialized_bytes: int  # bytes read from storage to build full views, all layers so far
    transient_bytes: int  # gather buffers of the last full view, beyond the view itself

    @property
    def kv_bytes(self) -> int:
        """MLA bytes at rest, all layers."""

    @property
    def index_bytes(self) -> int:
        """Indexer K bytes at rest, all layers."""

    @property
    def store_path(self) -> str:
        """How this batch's current tokens reach the pool: ``"replicated"``, ``"gathered"`` or ``"direct"``."""

    def bind(self, batch: BatchLocs) -> None:
        """Serve the next batch (chunk) of the run: same page-id space, same pool."""

    def write_prefix(
        self, layer: int, request: int, rows: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, start: int = 0
    ) -> None:
        """Install the part of a request's already-cached prefix tokens ``[start, start + len(rows))`` this
        rank keeps (a prefix is installed in chunks, :mod:`reference_impl.model.prefix_prefill`)."""

    def store_current(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        kv_local: torch.Tensor | None = None,
        index_k_local: torch.Tensor | None = None,
    ) -> None:
        """Quantize and write the current tokens this rank keeps (from the gathered chunk or its own
        rows); the index K ones are ``None`` on a layer without indexer K (IndexShare)."""

    def full_view(
        self,
        layer: int,
        kv_seq: torch.Tensor,
        index_k_seq: torch.Tensor | None,
        prefetched_kv: torch.Tensor | None = None,
    ) -> FullView:
        """The dense full view of ``layer`` (``prefetched_kv``: a view buffer whose history is already written)."""

    def owned_pages(self) -> torch.Tensor:
        """Logical pages of this batch stored on this rank, ascending."""

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> StoredRows:
        """What this rank holds for ``layer``, per request (default: this batch's requests)."""


def check_index_input(pool: PagedKVPool, layer: int, index_k: torch.Tensor | None) -> bool:
    """Whether ``layer`` keeps indexer K in ``pool``; a :class:`ConfigError` when the caller's index K
    disagrees (given for a shared layer, missing for a full one): the engine and the layout must
    follow the same IndexShare pattern."""
    keeps = pool.has_index(layer)
    if keeps != (index_k is not None):
        raise ConfigError(
            f"layer {layer} {'keeps' if keeps else 'keeps no'} indexer K but the store got "
            f"{'none' if index_k is None else 'some'} (IndexShare pattern of the model and of the KV layout differ)"
        )
    return keeps
