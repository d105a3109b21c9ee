"""A rank's GLM-5.3 caches: :class:`Glm53Store`.

What each layer type keeps, and where:

* **KDA layers**: per request, the float32 state ``[heads, head_dim, head_dim]`` and the convolution's
  last ``conv - 1`` input rows. Replicated: every rank composes the same state maps in the same order
  (:mod:`.step`), so every rank ends a chunk with the same bytes; sharding it would save one state
  per request and layer and cost a broadcast per chunk. It is what a decode needs of the layer.
* **indexed layers**: every token's latent row (the FP8 row of :mod:`..cache_layout`, 528 bytes on
  GLM-5.3-Flash, or bf16), in a pool indexed by its logical loc: on every rank
  (levels 0-1) or only on the loc's owner (phase 2, :class:`~reference_impl.cp.ownership.Ownership`);
  every complete group's pooled index key, stored at the loc of the group's **last token**, so on that
  token's owner: a group straddling a rank's block, a chunk or a cached prefix is pooled once, by that
  owner, when its last token arrives; the raw indexer rows of each request's incomplete group (at most
  ``kpool - 1``), replicated, waiting for the tokens that complete it.

Requests are keyed by their first loc (stable across chunks: the page table keeps a request's pages).
"""

from __future__ import annotations

from typing import Any

import torch

from reference_impl.config import RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.model.oracle import KDACache


class Glm53Store:
    """See the module docstring."""

    name = "glm53"

    def __init__(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> None:
        cfg: Glm53Config = run.model
        self.cfg, self.group, self.batch = cfg, group, batch
        self.sharded = run.phases.sharded_kv and group.size > 1
        self.ownership = Ownership(run.cp_size, run.interleave, run.page_size)
        # The run's row format; the oracle encodes with the same (family.latent_rows), so rows compare byte for byte.
        self.rows = LatentRows.for_run(cfg.kv_lora_rank, run.kv_dtype, cfg.mla_scale_fmt)
        self.compute_dtype = torch.float32 if group.device.type == "cpu" else torch.bfloat16
        slots, dev = batch.n_pages * batch.page_size, group.device
        self.dsa_layers = [i for i in range(cfg.n_layers) if not cfg.is_kda(i)]
        self.latent = {i: self.rows.empty(slots, dev) for i in self.dsa_layers}  # stored rows (uint8 for FP8)
        self.latent_held = {i: torch.zeros(slots, dtype=torch.bool, device=dev) for i in self.dsa_layers}
        self.indexed = [i for i in self.dsa_layers if not cfg.shares_selection(i)]
        self.group_keys = {i: torch.zeros(slots, cfg.index_head_dim, device=dev) for i in self.indexed}
        self.group_held = {i: torch.zeros(slots, dtype=torch.bool, device=dev) for i in self.indexed}
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, request key)
        self.kda: dict[tuple[int, int], KDACache] = {}  # (layer, request key)
        self.materialized_bytes = self.transient_bytes = 0

    # ---- the protocol ---------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return sum(int(h.sum()) for h in self.latent_held.values()) * self.rows.row_bytes

    @property
    def index_bytes(self) -> int:
        return sum(int(h.sum()) for h in self.group_held.values()) * self.cfg.index_head_dim * 4

    @property
    def store_path(self) -> str:
        return "gathered" if self.sharded else "replicated"

    def bind(self, batch: BatchLocs) -> None:
        self.batch = batch

    def breakdown(self) -> dict[str, int]:
        def received(tag: str) -> int:  # what the tagged all-gathers brought this rank, all layers and chunks
            return sum(s.bytes_received for s in self.group.stats if s.tag == tag)

        return {
            "kda_map_bytes_received": received("glm53_kda_state"),
            "kda_halo_bytes_received": received("glm53_kda_halo"),
            # round-robin only: the KDA layers' input rows re-split into contiguous blocks, and their outputs back
            "kda_resplit_bytes_received": received("glm53_kda_resplit"),
            "kda_return_bytes_received": received("glm53_kda_return"),
            "kda_state_bytes": sum(
                c.state.numel() * 4 + c.conv.numel() * c.conv.element_size() for c in self.kda.values()
            ),
            "index_pending_bytes": sum(k.numel() * k.element_size() * 2 for k, _ in self.pending.values()),
        }

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> dict[int, tuple[Any, ...]]:
        """KDA layers: ``(state, conv tail)``; indexed layers: ``(positions, latent rows as stored, group ids,
        group keys)``."""
        out: dict[int, tuple[Any, ...]] = {}
        for i, locs in enumerate(request_locs if request_locs is not None else self.batch.request_locs):
            if self.cfg.is_kda(layer):
                cache = self.kda.get((layer, int(locs[0])))
                out[i] = (None, None) if cache is None else (cache.state.clone(), cache.conv.clone())
                continue
            positions = torch.nonzero(self.latent_held[layer][locs]).flatten()
            rows = self.latent[layer][locs[positions]].clone()
            if layer in self.group_held:
                ends = torch.nonzero(self.group_held[layer][locs]).flatten()
                out[i] = (positions, rows, ends // self.cfg.index_kpool, self.group_keys[layer][locs[ends]].clone())
            else:
                out[i] = (positions, rows, None, None)
        return out

    # ---- the layers' operations -----------------------------------------------------------------
    def mine(self, locs: torch.Tensor) -> torch.Tensor:
        """Which of ``locs`` this rank stores (all of them unless sharded)."""
        if not self.sharded:
            return torch.ones_like(locs, dtype=torch.bool)
        return self.ownership.owner(locs) == self.group.rank

    def kda_cache(self, layer: int, locs: torch.Tensor) -> KDACache:
        key = (layer, int(locs[0]))
        if key not in self.kda:
            self.kda[key] = KDACache.empty(self.cfg, self.compute_dtype, self.group.device)
        return self.kda[key]

    def pending_rows(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, int(locs[0]))
        if key not in self.pending:
            empty = torch.zeros(0, self.cfg.index_head_dim, dtype=self.compute_dtype, device=self.group.device)
            self.pending[key] = (empty, empty)
        return self.pending[key]

    def set_pending(self, layer: int, locs: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor) -> None:
        self.pending[(layer, int(locs[0]))] = (keys, gates)

    def write_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Latent values ``[n, kv_lora_rank]`` (encoded here, only the rows this rank keeps) or rows already
        stored in the run's format (a cached prefix's, from the oracle) at ``locs``."""
        keep = self.mine(locs)
        self.latent[layer][locs[keep]] = self.rows.encode(rows[keep])
        self.latent_held[layer][locs[keep]] = True

    def write_group_keys(self, layer: int, end_locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Pooled keys of groups whose last tokens sit at ``end_locs`` (the caller pooled only its own)."""
        self.group_keys[layer][end_locs] = keys.float()
        self.group_held[layer][end_locs] = True

    def _gather_owned(self, table: torch.Tensor, locs: torch.Tensor, tag: str) -> torch.Tensor:
        """``table``'s rows at ``locs``, those other ranks own all-gathered (every rank calls it)."""
        if not self.sharded:
            return table[locs]
        owner = self.ownership.owner(locs)
        lengths = [int((owner == r).sum()) for r in range(self.group.size)]  # metadata: the same on every rank
        gathered = self.group.all_gather_padded(table[locs[owner == self.group.rank]], lengths, tag)
        order = torch.cat([torch.nonzero(owner == r).flatten() for r in range(self.group.size)])
        out = torch.empty(len(locs), table.shape[1], dtype=table.dtype, device=table.device)
        out[order] = gathered
        self.materialized_bytes += gathered.numel() * gathered.element_size()
        return out

    def latent_view(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """``[len(locs), kv_lora_rank]``: the request's latent rows (positions ``0 .. len(locs) - 1``), gathered
        as stored (528-byte FP8 rows travel as they are) and decoded."""
        return self.rows.decode(self._gather_owned(self.latent[layer], locs, "glm53_kv_view"))

    def group_key_view(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """``[len(locs) // kpool, Di]``: the request's complete groups' keys, from their owners."""
        P = self.cfg.index_kpool
        ends = locs[P - 1 :: P][: len(locs) // P]
        return self._gather_owned(self.group_keys[layer], ends, "glm53_index_view")
