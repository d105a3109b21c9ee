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

**Views.** A layer reads each request's latent rows and group keys from position 0: replicated, straight
from the tables; sharded, **materialized** by one all-gather per table and layer of the rows each rank
owns (:class:`RowGather`, planned once per chunk from the locs alone and reused by every layer): all of
them with phase 2, only the history (the rows stored before this chunk) with phase 3, whose step takes
the current chunk's rows from its own all-gather (:mod:`.step`). Latent rows travel as stored (an FP8
row as its 528 bytes, not the 1024 of its bf16 values) and are decoded once, where attention reads them.
``materialized_bytes`` counts what the materializations brought.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.config import RunConfig, compute_dtype
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.model.oracle import KDACache


@dataclass(frozen=True)
class RowGather:
    """One chunk's materialization of table rows at given locs, per chunk request (see the module docstring).

    Pure metadata of the chunk, the same on every rank: every layer of the chunk reuses it, and its device
    tensors are built before the layer loop (no host read in the loop)."""

    counts: tuple[int, ...]  # per chunk request: rows wanted, in order (the result's split)
    locs: torch.Tensor  # int64 [N]: every wanted loc, request after request (the replicated read)
    send: torch.Tensor  # int64 [lengths[rank]]: the wanted locs this rank owns, in want order
    lengths: tuple[int, ...]  # per rank: rows it sends
    inverse: torch.Tensor  # int64 [N]: the gathered (rank-major) row of each wanted loc

    @property
    def total(self) -> int:
        return sum(self.counts)


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
        self.compute_dtype = compute_dtype(run, group.device)  # the run's: its KDA states and pending rows
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
        self.direct = False  # phase 5: the last chunk wrote its own rows (each rank computes what it owns)

    # ---- the protocol ---------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return sum(int(h.sum()) for h in self.latent_held.values()) * self.rows.row_bytes

    @property
    def index_bytes(self) -> int:
        return sum(int(h.sum()) for h in self.group_held.values()) * self.cfg.index_head_dim * 4

    @property
    def store_path(self) -> str:
        if not self.sharded:
            return "replicated"
        return "direct" if self.direct else "gathered"

    def bind(self, batch: BatchLocs) -> None:
        self.batch = batch

    def breakdown(self) -> dict[str, int]:
        def received(tag: str) -> int:  # what the tagged all-gathers brought this rank, all layers and chunks
            return sum(s.bytes_received for s in self.group.stats if s.tag == tag)

        return {
            "kda_map_bytes_received": received("glm53_kda_state"),
            "kda_halo_bytes_received": received("glm53_kda_halo"),
            "view_bytes_received": received("glm53_kv_view") + received("glm53_index_view"),
            "prefetch_bytes_received": received("glm53_prefetch"),  # phase 8: the views' history, ahead
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
        return self.kda_cache_of(layer, int(locs[0]))

    def kda_cache_of(self, layer: int, request_key: int) -> KDACache:
        """The KDA state and convolution tail of the request keyed ``request_key`` (its first loc)."""
        key = (layer, request_key)
        if key not in self.kda:
            self.kda[key] = KDACache.empty(self.cfg, self.compute_dtype, self.group.device)
        return self.kda[key]

    def pending_rows(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pending_of(layer, int(locs[0]))

    def pending_of(self, layer: int, request_key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw indexer rows (keys, gates) of the incomplete group of the request keyed ``request_key``."""
        key = (layer, request_key)
        if key not in self.pending:
            empty = torch.zeros(0, self.cfg.index_head_dim, dtype=self.compute_dtype, device=self.group.device)
            self.pending[key] = (empty, empty)
        return self.pending[key]

    def set_pending(self, layer: int, locs: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor) -> None:
        self.pending[(layer, int(locs[0]))] = (keys, gates)

    def set_pending_of(self, layer: int, request_key: int, keys: torch.Tensor, gates: torch.Tensor) -> None:
        self.pending[(layer, request_key)] = (keys, gates)

    def write_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Latent values ``[n, kv_lora_rank]`` or rows already stored in the run's format (a cached prefix's,
        from the oracle) at ``locs``: the ones this rank stores (all unless sharded)."""
        keep = self.mine(locs)
        self.put_latent(layer, locs[keep], rows[keep])

    def put_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store every row at its loc, encoded (the caller picked the rows this rank owns: no mask, no host read)."""
        self.latent[layer].index_copy_(0, locs, self.stored_form(rows))
        self.latent_held[layer].index_fill_(0, locs, True)

    def stored_form(self, rows: torch.Tensor) -> torch.Tensor:
        """Latent rows as the table stores them (:meth:`LatentRows.encode`: 528-byte FP8 rows, or bf16): phase 3
        assembles the current chunk's rows so, from its all-gather, and gets the bytes a materialization would
        bring; attention decodes both alike."""
        return self.rows.encode(rows)

    def write_group_keys(self, layer: int, end_locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Pooled keys of groups whose last tokens sit at ``end_locs`` (the caller passes only its own)."""
        self.group_keys[layer][end_locs] = self.stored_keys(keys)
        self.group_held[layer][end_locs] = True

    def read_latent(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """The stored latent rows at ``locs`` (the caller picked locs this rank holds: no mask, no host read;
        a PD send's read inside the layer loop)."""
        return self.latent[layer].index_select(0, locs)

    def read_group_keys(self, layer: int, end_locs: torch.Tensor) -> torch.Tensor:
        """The pooled keys of the groups ending at ``end_locs`` (held by this rank; as :meth:`read_latent`)."""
        return self.group_keys[layer].index_select(0, end_locs)

    @staticmethod
    def stored_keys(keys: torch.Tensor) -> torch.Tensor:
        """Pooled group keys as the table keeps them (float32)."""
        return keys.float()

    # ---- materialized views ---------------------------------------------------------------------
    def row_gather(self, request_locs: list[torch.Tensor]) -> RowGather:
        """Plan the materialization of the rows at ``request_locs`` (host int64, one tensor per chunk
        request): the owners from the locs alone, so every rank plans the same collective."""
        device = self.group.device
        counts = tuple(len(locs) for locs in request_locs)
        want = torch.cat(request_locs) if request_locs else torch.zeros(0, dtype=torch.long)
        if not self.sharded:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return RowGather(counts, want.to(device), empty, (), empty)
        owner = self.ownership.owner(want)
        lengths = tuple(int((owner == r).sum()) for r in range(self.group.size))
        order = torch.cat([torch.nonzero(owner == r).flatten() for r in range(self.group.size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        send = want[owner == self.group.rank]
        return RowGather(counts, want.to(device), send.to(device), lengths, inverse.to(device))

    def materialize(self, table: torch.Tensor, plan: RowGather, tag: str) -> list[torch.Tensor]:
        """``table``'s rows at the plan's locs, per chunk request (every rank calls it, or none: the plan
        decides from metadata). Sharded: one all-gather of the owned rows; replicated: a local read."""
        if not self.sharded:
            return list(table.index_select(0, plan.locs).split(plan.counts))
        if plan.total == 0:  # no rows anywhere: no collective on any rank
            return [table[:0] for _ in plan.counts]
        gathered = self.group.all_gather_padded(table.index_select(0, plan.send), plan.lengths, tag)
        self.materialized_bytes += gathered.numel() * gathered.element_size()
        return list(gathered.index_select(0, plan.inverse).split(plan.counts))

    def latent_rows(self, layer: int, plan: RowGather, tag: str) -> list[torch.Tensor]:
        """Layer ``layer``'s latent rows at the plan's locs, per chunk request, as stored (528-byte FP8 rows
        travel as they are; the reader decodes them, :attr:`rows`)."""
        return self.materialize(self.latent[layer], plan, tag)

    def group_key_rows(self, layer: int, plan: RowGather, tag: str) -> list[torch.Tensor]:
        """Layer ``layer``'s group keys at the plan's group-end locs (float32), per chunk request."""
        return self.materialize(self.group_keys[layer], plan, tag)
