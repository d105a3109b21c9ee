"""A rank's GLM-5.3 caches: :class:`Glm53Store`.

What each layer type keeps, and where:

* **KDA layers**: per request, the float32 state ``[heads, head_dim, head_dim]`` and the convolution's
  last ``conv - 1`` input rows. Replicated: every rank composes the same state maps in the same order
  (:mod:`.step`), so every rank ends a chunk with the same bytes; sharding it would save one state
  per request and layer and cost a broadcast per chunk. It is what a decode needs of the layer.
* **indexed layers**: every token's latent row (the FP8 row of :mod:`..cache_layout`, 528 bytes on
  GLM-5.3-Flash, or bf16), in a pool indexed by its logical loc: on every rank
  (levels 0-1) or only on the loc's owner (phase 2, :class:`~reference_impl.cp.ownership.Ownership`);
  every complete group's pooled index key, in a table of one row per **cell** that can hold a group's last
  token (:class:`GroupKeyOwnership`: ``gcd(page size, kpool)`` slots, a sixteenth of the latent table's rows
  on GLM-5.3-Flash's pages of 64), on the cell's owner: the last token's owner under the page interleave,
  consecutive groups on consecutive ranks under an interleave finer than a group (round-robin: the last
  token's owner would be rank ``C - 1`` for every group when ``C`` divides 16); a group straddling a
  rank's block, a chunk or a cached prefix is pooled once, by that owner, when its last token arrives; the
  raw indexer rows of each request's incomplete group (at most ``kpool - 1``), replicated, waiting for the
  tokens that complete it.

A sharded table holds only the slots its rank owns, packed (:meth:`Glm53Store.slot`): its bytes at rest are
``1 / C`` of a replicated table's. Requests are keyed by their run-global index (a hit shares its source's
first pages, so a loc names no request alone).

**A long-lived pool.** The store lives across a run's batches. A request ``rN:P+E`` of a later batch takes
``N``'s whole pages by reference (their rows stay where they are) and copies the rest of what it needs at ``P``
(:meth:`Glm53Store.take_hit`): the partial page's rows and keys, and the **checkpoint** ``N`` kept at ``P``
as its prefill passed it (KDA states and tails, pending indexer rows; :mod:`.step`). A request the page table
no longer lists (freed, or evicted under ``pool_pages``) goes with all it kept (:meth:`Glm53Store.keep_only`).
The rules, and why: docs/glm-5.3.md, "Prefix hits and eviction".

**Views.** A layer reads each request's latent rows and group keys from position 0: replicated, straight
from the tables; sharded, **materialized** by one all-gather per table and layer of the rows each rank
owns (:class:`RowGather`, planned once per chunk from the locs alone and reused by every layer): all of
them with phase 2, only the history (the rows stored before this chunk) with phase 3, whose step takes
the current chunk's rows from its own all-gather (:mod:`.step`). Latent rows travel as stored (an FP8
row as its 528 bytes, not the 1024 of its bf16 values) and are decoded once, where attention reads them.
``materialized_bytes`` counts what the materializations brought.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from reference_impl.config import RunConfig, compute_dtype
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.model.oracle import KDACache

if TYPE_CHECKING:  # annotations only: the page table's replay sits above the CP layer
    from reference_impl.pool_timeline import PoolTimeline


@dataclass(frozen=True)
class GroupKeyOwnership:
    """Where a group key is stored, from the loc of the group's last token alone (every rank, and a PD sender,
    derive the same): the key table has one row per **cell** of ``cell = gcd(page size, kpool)`` slots.

    Requests start on a page, so a loc's in-page offset is its position's: a group's last token (position
    ``16k + 15``) is the last slot of its cell, and a cell holds at most one. The cells are owned in runs of
    ``interleave`` cells, packed like :class:`Ownership`'s slots: the page interleave keeps the last token's
    owner (phase 5's direct writes need it); a finer one (round-robin) takes runs of one group's span, so
    group ``k`` of a request on consecutive pages goes to rank ``(k + s) % C``, ``s`` fixed by its first page
    (a request on scattered pages, after eviction, may land less evenly; any owner is correct)."""

    cp_size: int
    cell: int  # slots per cell
    interleave: int  # cells per ownership run

    @classmethod
    def of(cls, own: Ownership, kpool: int) -> GroupKeyOwnership:
        cell = math.gcd(own.page_size, kpool)
        span = own.interleave if own.by_page else max(own.interleave, kpool)  # in slots
        return cls(own.cp_size, cell, max(1, span // cell))

    def owner(self, end_locs: torch.Tensor) -> torch.Tensor:
        """Owner rank of the key of each group ending at ``end_locs``."""
        return (end_locs // (self.cell * self.interleave)) % self.cp_size

    def row(self, end_locs: torch.Tensor, sharded: bool) -> torch.Tensor:
        """The table row of each key on its owner (every cell in order when the table is replicated)."""
        cells, i = end_locs // self.cell, self.interleave
        return (cells // (i * self.cp_size)) * i + cells % i if sharded else cells

    def rows_held(self, n_slots: int, rank: int, sharded: bool) -> int:
        """Table rows ``rank`` allocates for logical slots ``0 .. n-1``: its runs of cells, packed."""
        cells = -(-n_slots // self.cell)
        if not sharded:
            return cells
        runs = -(-cells // self.interleave)
        return max(0, -(-(runs - rank) // self.cp_size)) * self.interleave


@dataclass(frozen=True)
class RowGather:
    """One chunk's materialization of table rows at given locs, per chunk request (see the module docstring).

    Pure metadata of the chunk, the same on every rank: every layer of the chunk reuses it, and its device
    tensors are built before the layer loop (no host read in the loop)."""

    counts: tuple[int, ...]  # per chunk request: rows wanted, in order (the result's split)
    locs: torch.Tensor  # int64 [N]: every wanted table row (a loc, or a key's row), request after request (replicated)
    send: torch.Tensor  # int64 [lengths[rank]]: the table slots of the wanted locs this rank owns, in want order
    lengths: tuple[int, ...]  # per rank: rows it sends
    inverse: torch.Tensor  # int64 [N]: the gathered (rank-major) row of each wanted loc

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Hit:
    """What a hit copies of its source (:meth:`Glm53Store.take_hit`), before it is written at its own locs."""

    n_tokens: int  # the hit point ``P``
    shared: int  # leading tokens in whole pages taken by reference (nothing of them is copied)
    ends: torch.Tensor  # int64: positions of the last tokens of the groups ending in ``[shared, P)``
    latent: dict[int, torch.Tensor]  # indexed layer -> the latent rows of ``[shared, P)``, as stored
    keys: dict[int, torch.Tensor]  # layer with its own indexer -> those groups' keys
    parts: dict[int, KDACache | tuple[torch.Tensor, torch.Tensor]]  # the checkpoint at ``P``, per layer


def hit_points(run: RunConfig) -> dict[int, set[int]]:
    """Request -> the positions where a later request hits its prefix (``rN:P+E``: ``P`` of ``N``): the run
    names them up front, so the source keeps a checkpoint there as its computation passes."""
    points: dict[int, set[int]] = {}
    for r in run.requests:
        if r.shares is not None:
            points.setdefault(r.shares, set()).add(r.prefix)
    return points


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
        # Only the slots this rank owns: sharded, its runs of the ownership packed densely (``Ownership.physical``,
        # page ``p`` on rank ``p % C`` at page ``p // C`` in-seq; slot ``l`` on rank ``l % C`` at ``l // C`` under
        # round-robin), so the tables at rest are ``1 / C`` of the replicated ones, not only the rows counted.
        pages = self.ownership.pages_held(batch.n_pages, group.rank) if self.sharded else batch.n_pages
        slots, dev = pages * batch.page_size, group.device
        self.dsa_layers = [i for i in range(cfg.n_layers) if not cfg.is_kda(i)]
        self.latent = {i: self.rows.empty(slots, dev) for i in self.dsa_layers}  # stored rows (uint8 for FP8)
        self.latent_held = {i: torch.zeros(slots, dtype=torch.bool, device=dev) for i in self.dsa_layers}
        self.indexed = [i for i in self.dsa_layers if not cfg.shares_selection(i)]
        # One row per cell that can end a group (GroupKeyOwnership), not per slot: a key per kpool tokens.
        self.key_owner = GroupKeyOwnership.of(self.ownership, cfg.index_kpool)
        key_rows = self.key_owner.rows_held(batch.n_pages * batch.page_size, group.rank, self.sharded)
        self.group_keys = {i: torch.zeros(key_rows, cfg.index_head_dim, device=dev) for i in self.indexed}
        self.group_held = {i: torch.zeros(key_rows, dtype=torch.bool, device=dev) for i in self.indexed}
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, request)
        self.kda: dict[tuple[int, int], KDACache] = {}  # (layer, request)
        # (request, hit point) -> per layer: the KDA state and tail, or an indexed layer's pending rows, there
        self.checkpoints: dict[tuple[int, int], dict[int, KDACache | tuple[torch.Tensor, torch.Tensor]]] = {}
        self.locs: dict[int, torch.Tensor] = {}  # request (run-global) -> the locs of its computed tokens (host)
        self.timeline: PoolTimeline | None = None  # the page table's hits and residents (the family sets it)
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
            "checkpoint_bytes": sum(  # kept at later requests' hit points
                sum(t.numel() * t.element_size() for t in ((p.state, p.conv) if isinstance(p, KDACache) else p))
                for parts in self.checkpoints.values()
                for p in parts.values()
            ),
            "table_bytes": self.table_bytes,
        }

    @property
    def table_bytes(self) -> int:
        """What the latent-row and group-key tables allocate, held or not, with their held flags: every logical
        slot and key cell replicated, the rank's own sharded."""
        tables = [*self.latent.values(), *self.latent_held.values(), *self.group_keys.values()]
        return sum(t.numel() * t.element_size() for t in [*tables, *self.group_held.values()])

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> dict[int, tuple[Any, ...]]:
        """KDA layers: ``(state, conv tail)``; indexed layers: ``(positions, latent rows as stored, group ids,
        group keys)``."""
        out: dict[int, tuple[Any, ...]] = {}
        for i, locs in enumerate(request_locs if request_locs is not None else self.batch.request_locs):
            if self.cfg.is_kda(layer):
                cache = self.kda.get((layer, self.request_at(locs)))
                out[i] = (None, None) if cache is None else (cache.state.clone(), cache.conv.clone())
                continue
            positions = torch.nonzero(self.held_at(self.latent_held[layer], locs)).flatten()
            rows = self.latent[layer][self.slot(locs[positions])].clone()
            if layer in self.group_held:
                P = self.cfg.index_kpool  # every complete group's last position, then those whose keys are here
                ends = torch.arange(len(locs) // P, device=locs.device) * P + P - 1
                ends = ends[self.mine_keys(locs[ends])]
                ends = ends[self.group_held[layer][self.key_slot(locs[ends])]]
                keys = self.group_keys[layer][self.key_slot(locs[ends])].clone()
                out[i] = (positions, rows, ends // self.cfg.index_kpool, keys)
            else:
                out[i] = (positions, rows, None, None)
        return out

    def request_at(self, locs: torch.Tensor) -> int:
        """The request whose computed tokens sit at ``locs`` (the latest such: an earlier one was freed)."""
        locs = locs.cpu()
        for req, held in reversed(self.locs.items()):
            if held.numel() == locs.numel() and torch.equal(held, locs):
                return req
        return -1

    def held_at(self, held: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
        """``held``'s flags at ``locs``: False where another rank owns the loc."""
        mine = self.mine(locs)
        out = torch.zeros(len(locs), dtype=torch.bool, device=held.device)
        out[mine] = held[self.slot(locs[mine])]
        return out

    # ---- the layers' operations -----------------------------------------------------------------
    def mine(self, locs: torch.Tensor) -> torch.Tensor:
        """Which of ``locs`` this rank stores (all of them unless sharded)."""
        if not self.sharded:
            return torch.ones_like(locs, dtype=torch.bool)
        return self.ownership.owner(locs) == self.group.rank

    def mine_keys(self, end_locs: torch.Tensor) -> torch.Tensor:
        """Which keys of the groups ending at ``end_locs`` this rank stores (:class:`GroupKeyOwnership`)."""
        if not self.sharded:
            return torch.ones_like(end_locs, dtype=torch.bool)
        return self.key_owner.owner(end_locs) == self.group.rank

    def key_slot(self, end_locs: torch.Tensor) -> torch.Tensor:
        """The key-table rows of the groups ending at ``end_locs`` (keys this rank stores; no host read)."""
        return self.key_owner.row(end_locs, self.sharded)

    def slot(self, locs: torch.Tensor) -> torch.Tensor:
        """The table rows of ``locs`` (all owned by this rank): the ownership's packed physical locs when
        sharded, the locs themselves when replicated. Integer arithmetic on the device: no host read."""
        return self.ownership.physical(locs) if self.sharded else locs

    def kda_cache_of(self, layer: int, request_key: int) -> KDACache:
        """The KDA state and convolution tail of request ``request_key`` (run-global)."""
        key = (layer, request_key)
        if key not in self.kda:
            self.kda[key] = KDACache.empty(self.cfg, self.compute_dtype, self.group.device)
        return self.kda[key]

    def pending_of(self, layer: int, request_key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw indexer rows (keys, gates) of the incomplete group of the request keyed ``request_key``."""
        key = (layer, request_key)
        if key not in self.pending:
            empty = torch.zeros(0, self.cfg.index_head_dim, dtype=self.compute_dtype, device=self.group.device)
            self.pending[key] = (empty, empty)
        return self.pending[key]

    def set_pending_of(self, layer: int, request_key: int, keys: torch.Tensor, gates: torch.Tensor) -> None:
        self.pending[(layer, request_key)] = (keys, gates)

    def write_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Latent values ``[n, kv_lora_rank]`` or rows already stored in the run's format (a cached prefix's,
        from the oracle) at ``locs``: the ones this rank stores (all unless sharded)."""
        keep = self.mine(locs)
        self.put_latent(layer, locs[keep], rows[keep])

    def put_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store every row at its loc, encoded (the caller picked the rows this rank owns: no mask, no host read)."""
        slots = self.slot(locs)
        self.latent[layer].index_copy_(0, slots, self.stored_form(rows))
        self.latent_held[layer].index_fill_(0, slots, True)

    def stored_form(self, rows: torch.Tensor) -> torch.Tensor:
        """Latent rows as the table stores them (:meth:`LatentRows.encode`: 528-byte FP8 rows, or bf16): phase 3
        assembles the current chunk's rows so, from its all-gather, and gets the bytes a materialization would
        bring; attention decodes both alike."""
        return self.rows.encode(rows)

    def write_group_keys(self, layer: int, end_locs: torch.Tensor, keys: torch.Tensor) -> None:
        """Pooled keys of groups whose last tokens sit at ``end_locs`` (the caller passes only its own)."""
        slots = self.key_slot(end_locs)
        self.group_keys[layer][slots] = self.stored_keys(keys)
        self.group_held[layer][slots] = True

    def read_latent(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """The stored latent rows at ``locs`` (the caller picked locs this rank holds: no mask, no host read;
        a PD send's read inside the layer loop)."""
        return self.latent[layer].index_select(0, self.slot(locs))

    def read_group_keys(self, layer: int, end_locs: torch.Tensor) -> torch.Tensor:
        """The pooled keys of the groups ending at ``end_locs`` (held by this rank; as :meth:`read_latent`)."""
        return self.group_keys[layer].index_select(0, self.key_slot(end_locs))

    @staticmethod
    def stored_keys(keys: torch.Tensor) -> torch.Tensor:
        """Pooled group keys as the table keeps them (float32)."""
        return keys.float()

    # ---- a long-lived pool (the rules: docs/glm-5.3.md, "Prefix hits and eviction") ------------------
    def begin_chunk(self, requests: tuple[int, ...], request_locs: tuple[torch.Tensor, ...]) -> None:
        """The chunk's requests (run-global) and their locs through the chunk: computed once it has run."""
        for req, locs in zip(requests, request_locs):
            self.locs[req] = locs.cpu()

    def checkpoint(self, req: int, point: int) -> dict[int, KDACache | tuple[torch.Tensor, torch.Tensor]]:
        """What request ``req`` keeps at hit point ``point``, per layer (filled as its computation passes it)."""
        return self.checkpoints.setdefault((req, point), {})

    def keep_only(self, resident: frozenset[int], live: list[torch.Tensor] | None = None) -> None:
        """Drop every request the page table no longer lists (freed, or evicted by a pool budget) with all it
        kept, and forget every row at a loc no listed request has computed (``live``: more such locs, a hit's
        pages by reference whose source just went): a page handed out again holds nothing until written."""
        for old in [r for r in self.locs if r not in resident]:
            self.drop(old)
        parts = [*self.locs.values(), *(live or [])]
        held = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        slots = self.slot(held[self.mine(held)]).to(self.group.device)
        # A key stays while the last slot of its cell (where a group's last token sits) is live.
        ends = held[held % self.key_owner.cell == self.key_owner.cell - 1]
        key_slots = self.key_slot(ends[self.mine_keys(ends)]).to(self.group.device)
        for flags, at in [
            *((f, slots) for f in self.latent_held.values()),
            *((f, key_slots) for f in self.group_held.values()),
        ]:
            kept = torch.zeros_like(flags)
            kept[at] = flags[at]
            flags.copy_(kept)

    def drop(self, old: int) -> None:
        """Let request ``old`` go: its KDA states, pending rows and checkpoints (its rows go with their locs)."""
        self.locs.pop(old, None)
        for table in (self.kda, self.pending):
            for key in [key for key in table if key[1] == old]:
                del table[key]
        for key in [key for key in self.checkpoints if key[0] == old]:
            del self.checkpoints[key]

    def take_hit(self, req: int, source: int, n_tokens: int, shared: int) -> Hit:
        """What request ``req``'s hit of ``source``'s first ``n_tokens`` tokens copies (every rank calls it alike:
        a sharded copy is a collective): the latent rows and group keys in ``source``'s pages past the ``shared``
        tokens taken by reference, and the checkpoint at ``n_tokens``. Copies, never views: the source may be
        evicted right after and its pages handed out again."""
        if source not in self.locs or (source, n_tokens) not in self.checkpoints:
            raise AssertionError(f"request {req} hits request {source}, whose state this store dropped")
        src, kp = self.locs[source], self.cfg.index_kpool
        ends = torch.arange(shared // kp, n_tokens // kp) * kp + kp - 1  # groups ending past the shared pages
        rows_plan, keys_plan = self.row_gather([src[shared:n_tokens]]), self.row_gather([src[ends]], keys=True)
        latent = {i: self.materialize(self.latent[i], rows_plan, "glm53_hit")[0] for i in self.dsa_layers}
        keys = {i: self.materialize(self.group_keys[i], keys_plan, "glm53_hit")[0] for i in self.indexed}
        parts: dict[int, KDACache | tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, part in self.checkpoints[(source, n_tokens)].items():
            if isinstance(part, KDACache):
                parts[layer] = KDACache(part.state.clone(), part.conv.clone())
            else:
                parts[layer] = (part[0].clone(), part[1].clone())
        return Hit(n_tokens, shared, ends, latent, keys, parts)

    def put_hit(self, req: int, locs: torch.Tensor, hit: Hit) -> None:
        """Request ``req`` (its locs ``locs``, on the device) starts with ``hit``: the copied rows at its own locs,
        each on its owner, and the checkpoint as its KDA states and pending rows (on every rank)."""
        at, ends = locs[hit.shared : hit.n_tokens], locs[hit.ends.to(locs.device)]
        for layer, rows in hit.latent.items():
            self.write_latent(layer, at, rows.to(at.device))
        for layer, keys in hit.keys.items():
            mine = self.mine_keys(ends)
            self.write_group_keys(layer, ends[mine], keys.to(ends.device)[mine])
        for layer, part in hit.parts.items():
            if isinstance(part, KDACache):
                self.kda[(layer, req)] = part
            else:
                self.pending[(layer, req)] = part
        self.locs[req] = locs[: hit.n_tokens].cpu()

    # ---- materialized views ---------------------------------------------------------------------
    def row_gather(self, request_locs: list[torch.Tensor], keys: bool = False) -> RowGather:
        """Plan the materialization of the rows at ``request_locs`` (host int64, one tensor per chunk
        request; ``keys``: group-end locs, for the key tables): the owners from the locs alone, so every rank
        plans the same collective."""
        device = self.group.device
        counts = tuple(len(locs) for locs in request_locs)
        want = torch.cat(request_locs) if request_locs else torch.zeros(0, dtype=torch.long)
        if not self.sharded:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return RowGather(counts, (self.key_slot(want) if keys else want).to(device), empty, (), empty)
        owner = self.key_owner.owner(want) if keys else self.ownership.owner(want)
        lengths = tuple(int((owner == r).sum()) for r in range(self.group.size))
        order = torch.cat([torch.nonzero(owner == r).flatten() for r in range(self.group.size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        send = (self.key_slot if keys else self.slot)(want[owner == self.group.rank])
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
