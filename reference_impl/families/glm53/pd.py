"""Prefill -> decode of a GLM-5.3 cache: what each prefill rank ships, and how the decode lays it out
and continues.

**What travels**, per layer and finished request, as row blocks
(:class:`~reference_impl.pd.transport.RowBlock`, told apart by their ``part``):

===============  =================  ===================================  ====================================
part             layers             rows (positions)                     sent by
===============  =================  ===================================  ====================================
``LATENT`` (1)   indexed            the stored latent rows (528-byte     every rank: the rows it stores (phase
                                    FP8 rows, or bf16), token positions  2: the owner of the row's loc)
``KEYS`` (2)     indexed, own       the pooled group keys (float32),     every rank: the groups whose keys it
                 indexer            group indices                        stores (``GroupKeyOwnership``)
``PENDING`` (3)  indexed, own       the raw indexer keys then gates of   the request's **replica sender**
                 indexer            the incomplete group (compute
                                    dtype), token positions
``STATE`` (4)    KDA                the float32 state, one row per       the replica sender
                                    head (``head_dim^2 * 4`` bytes)
``CONV`` (5)     KDA                the convolution's last ``conv - 1``  the replica sender
                                    input rows (compute dtype), row
                                    index (zeros before the sequence)
===============  =================  ===================================  ====================================

The **replica sender** of a request is the rank that owns the slot of its last token: every rank holds
the same replicated bytes (each composes the same KDA state maps in the same order and pools the same
gathered indexer rows, :mod:`.cp.step`), so exactly one sends them, and different requests spread that
work over the ranks. Every rank sends one block per part, layer and request, empty where it has nothing,
so a two-sided decode knows how many blocks to expect and never counts ranks' ownership.

**The decode** (:class:`Glm53Decoder`, a :class:`~reference_impl.pd.arena.BookedArena`) allocates, per
request and layer, one region per part in one ``uint8`` arena (the Mooncake transport registers it and
publishes the regions), places each block's rows at ``position - first position`` and books every
row exactly once. It assembles the oracle's caches (:class:`~.model.oracle.KDACache`,
:class:`~.model.oracle.DSACache`, views of the arena) and continues one token with the oracle's own
layer call (:func:`~.model.oracle.run_layers`).

Bytes per request of ``n`` tokens (``R`` the latent row's bytes, ``Di`` the indexer key's width, ``P``
the group, ``e`` the compute dtype's bytes): an indexed layer with its own indexer
``n R + (n // P) 4 Di + (n % P) 2 Di e``; one sharing its selection ``n R``; a KDA layer
``H Dk^2 4 + (conv - 1) 3 H Dk e``, whatever ``n`` (:func:`request_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig, compute_dtype
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.cp.store import Glm53Store, GroupKeyOwnership
from reference_impl.families.glm53.model.oracle import DSACache, Glm53Model, Glm53OracleResult, KDACache, run_layers
from reference_impl.pd.arena import BookedArena
from reference_impl.pd.payload import (
    PartPayload,
    PartStreamer,
    arena_shapes,
    as_bytes,
    bytes_to_ship,
    part_block,
    replica_sender,
)
from reference_impl.pd.transport import BlockTransport, RowBlock

LATENT, KEYS, PENDING, STATE, CONV = 1, 2, 3, 4, 5
PART_NAMES = {
    LATENT: "latent",
    KEYS: "group key",
    PENDING: "pending indexer",
    STATE: "KDA state",
    CONV: "convolution tail",
}
SHARDED_PARTS = (LATENT, KEYS)  # sent by the rank that stores each row; the others by the replica sender
F32 = 4


def parts_of(cfg: Glm53Config, layer: int) -> tuple[int, ...]:
    """The parts a layer ships (the module docstring's table)."""
    if cfg.is_kda(layer):
        return (STATE, CONV)
    return (LATENT,) if cfg.shares_selection(layer) else (LATENT, KEYS, PENDING)


def latent_rows(run: RunConfig) -> LatentRows:
    """The run's latent row format (the store's and the oracle's)."""
    return LatentRows.for_run(run.model.kv_lora_rank, run.kv_dtype, run.model.mla_scale_fmt)


def run_dtype(run: RunConfig) -> torch.dtype:
    """The compute dtype of the prefill ranks (their pending rows and convolution tails): the run's device's."""
    return compute_dtype(run, torch.device(run.device))


def row_bytes(run: RunConfig, part: int) -> int:
    """Bytes of one row of ``part``."""
    cfg, e = run.model, run_dtype(run).itemsize
    return {
        LATENT: latent_rows(run).row_bytes,
        KEYS: cfg.index_head_dim * F32,
        PENDING: 2 * cfg.index_head_dim * e,
        STATE: cfg.linear_head_dim * cfg.linear_head_dim * F32,
        CONV: cfg.conv_dim * e,
    }[part]


def first_and_count(cfg: Glm53Config, part: int, n_tokens: int) -> tuple[int, int]:
    """``(first position, rows)`` of a request's ``part`` after ``n_tokens`` tokens."""
    P = cfg.index_kpool
    return {
        LATENT: (0, n_tokens),
        KEYS: (0, n_tokens // P),
        PENDING: (n_tokens - n_tokens % P, n_tokens % P),
        STATE: (0, cfg.linear_num_heads),
        CONV: (0, cfg.linear_conv_kernel_dim - 1),
    }[part]


def request_bytes(run: RunConfig, n_tokens: int) -> int:
    """A request's cache bytes, every layer and part: what the decode receives of it (its regions' bytes)."""
    return sum(rows * width for _, _, rows, width in arena_shapes(Glm53Parts(run), [n_tokens]))


def owned_rows(own: Ownership, rank: int, cfg: Glm53Config, locs: torch.Tensor, part: int) -> torch.Tensor:
    """Which rows of a request's ``part`` ``rank`` stores (int64 positions): its latent rows' locs, or the
    groups whose keys it stores, by the store's rule (:class:`GroupKeyOwnership`; ``locs``: the request's logical
    locs, host)."""
    if part == LATENT:
        return torch.nonzero(own.owner(locs) == rank).flatten()
    ends = locs[cfg.index_kpool - 1 :: cfg.index_kpool][: len(locs) // cfg.index_kpool]
    return torch.nonzero(GroupKeyOwnership.of(own, cfg.index_kpool).owner(ends) == rank).flatten()


def ships_replicas(own: Ownership, locs: torch.Tensor, rank: int) -> bool:
    """Whether ``rank`` ships the replicated parts of the request at ``locs`` (its logical locs, host)."""
    return replica_sender(own, locs) == rank


class Glm53Parts:
    """GLM-5.3's parts for one run (a :class:`~reference_impl.pd.payload.PartLayout`): latent rows and group
    keys sharded (:data:`SHARDED_PARTS`), the pending indexer rows and KDA states and tails replicated."""

    part_names = PART_NAMES

    def __init__(self, run: RunConfig) -> None:
        cfg = run.model
        assert isinstance(cfg, Glm53Config)
        self.run, self.cfg, self.n_layers = run, cfg, cfg.n_layers

    def parts(self, layer: int) -> tuple[int, ...]:
        return parts_of(self.cfg, layer)

    def row_bytes(self, layer: int, part: int) -> int:
        return row_bytes(self.run, part)

    def first_and_count(self, layer: int, part: int, n_tokens: int) -> tuple[int, int]:
        return first_and_count(self.cfg, part, n_tokens)

    def rows_stored(self, own: Ownership, rank: int, locs: torch.Tensor, layer: int, part: int) -> int | None:
        return len(owned_rows(own, rank, self.cfg, locs, part)) if part in SHARDED_PARTS else None

    def ships_replicas(self, own: Ownership, locs: torch.Tensor, rank: int) -> bool:
        return ships_replicas(own, locs, rank)


# ---- the prefill side ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """One finished request's send, planned before the layer loop (host reads there, none in the loop)."""

    key: int  # the store's request key (run-global)
    replica: bool  # whether this rank ships the replicated parts
    n_tokens: int
    latent_positions: torch.Tensor  # int64 host: the token positions of the rows this rank stores
    latent_locs: torch.Tensor  # int64 device: their locs
    group_ids: torch.Tensor  # int64 host: the groups this rank stores
    group_locs: torch.Tensor  # int64 device: their last tokens' locs


class Glm53LayerStreamer(PartStreamer):
    """A prefill rank's layer-wise send of its GLM-5.3 cache: one block per part for each request the chunk
    finishes (the module docstring's table), after each layer is stored."""

    def __init__(self, run: RunConfig, transport: BlockTransport, decode_rank: int) -> None:
        super().__init__(transport, decode_rank, Glm53Parts(run))
        self.run = run
        self.store: Glm53Store | None = None
        self.plans: dict[int, _Plan] = {}

    def begin_chunk(self, store: Any, finished: dict[int, torch.Tensor]) -> None:
        if not isinstance(store, Glm53Store):
            raise ConfigError("a layer-wise GLM-5.3 PD send needs the GLM-5.3 store")
        self.store = store
        device, rank, cfg = store.group.device, store.group.rank, store.cfg
        self.start_chunk(device, finished)
        # Unsharded (C = 1) every row is the one rank's: the run's ownership says so too.
        own = Ownership(self.run.cp_size, self.run.interleave, self.run.page_size)
        self.plans = {}
        for req, locs in finished.items():
            host = locs.cpu()
            positions = owned_rows(own, rank, cfg, host, LATENT)
            groups = owned_rows(own, rank, cfg, host, KEYS)
            ends = host[cfg.index_kpool - 1 :: cfg.index_kpool]
            self.plans[req] = _Plan(
                req,
                self.plan_request(own, rank, req, host),
                len(host),
                positions,
                host[positions].to(device),
                groups,
                ends[groups].to(device),
            )

    def block(self, layer: int, request: int, part: int) -> RowBlock:
        store, plan = self.store, self.plans[request]
        assert store is not None
        width = self.layout.row_bytes(layer, part)
        rows = torch.empty(0, width, dtype=torch.uint8, device=store.group.device)
        positions = torch.zeros(0, dtype=torch.long)
        sources: list[torch.Tensor] = []  # main-stream tensors this block reads (on the side stream, with CUDA)
        if part == LATENT:
            sources = [plan.latent_locs]
            rows = as_bytes(store.read_latent(layer, plan.latent_locs))
            positions = plan.latent_positions
        elif part == KEYS:
            sources = [plan.group_locs]
            rows = as_bytes(store.read_group_keys(layer, plan.group_locs))
            positions = plan.group_ids
        elif plan.replica and part == PENDING:
            keys, gates = sources = list(store.pending_of(layer, plan.key))
            rows = as_bytes(torch.cat([keys, gates], dim=1))
            positions = torch.arange(plan.n_tokens - keys.shape[0], plan.n_tokens)
        elif plan.replica:
            cache = store.kda_cache_of(layer, plan.key)
            sources = [cache.state, cache.conv]
            rows = as_bytes(cache.state.reshape(cache.state.shape[0], -1) if part == STATE else cache.conv)
            positions = torch.arange(rows.shape[0])
        if self.staging is not None:  # read on the side stream: the main stream may free these meanwhile
            for t in sources:  # (the next chunk's plan, a rebound state, a freed request's rows)
                t.record_stream(self.staging.stream)
        return part_block(request, layer, part, positions, rows)


def bytes_at_rest(run: RunConfig, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
    """What ``rank`` is to ship of every request, counted from the ownership (its page table's locs)
    and the cache's arithmetic: the latent rows and group keys it stores, and the replicated parts
    (KDA states and tails, pending indexer rows) of the requests it is the replica sender of
    (``request_locs``: request -> its logical locs, :func:`reference_impl.engine.request_locs`)."""
    return bytes_to_ship(Glm53Parts(run), run, rank, request_locs)


# ---- the decode side -------------------------------------------------------------------------


class Glm53Decoder(BookedArena):
    """The decode's GLM-5.3 cache of every request (see the module docstring): one arena, a region per
    (request, layer, part), exactly-once bookkeeping of every row."""

    def __init__(self, run: RunConfig, device: torch.device | str = "cpu") -> None:
        cfg = run.model
        assert isinstance(cfg, Glm53Config)
        self.run, self.cfg, self.rows_format = run, cfg, latent_rows(run)
        self.dtype = run_dtype(run)
        self.totals = [r.total for r in run.requests]
        super().__init__(arena_shapes(Glm53Parts(run), self.totals), PART_NAMES, device)

    def caches(self) -> list[list[KDACache | DSACache]]:
        """``[layer][request]``: the oracle's cache types assembled from the arena (views of it)."""
        cfg, fmt = self.cfg, self.rows_format
        out: list[list[KDACache | DSACache]] = []
        for layer in range(cfg.n_layers):
            row: list[KDACache | DSACache] = []
            for req in range(len(self.totals)):
                if cfg.is_kda(layer):
                    H, D = cfg.linear_num_heads, cfg.linear_head_dim
                    state = self.typed(req, layer, STATE, torch.float32).view(H, D, D)
                    row.append(KDACache(state, self.typed(req, layer, CONV, self.dtype)))
                    continue
                cache = DSACache(fmt, self.typed(req, layer, LATENT, fmt.storage_dtype))
                if not cfg.shares_selection(layer):
                    pending = self.typed(req, layer, PENDING, self.dtype)
                    cache.pending_k, cache.pending_gate = pending.split(cfg.index_head_dim, dim=1)
                    cache.group_keys = self.typed(req, layer, KEYS, torch.float32)
                row.append(cache)
            out.append(row)
        return out

    @torch.no_grad()
    def next_token(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's next token (``inputs[req] [1, dim]``, its layer-0 input) through every layer
        against the assembled caches (copies: the arena stays as received) -> its final hidden state."""
        assert isinstance(model, Glm53Model)
        return next_token(model, self.caches(), self.totals, inputs)


def _copy(cache: KDACache | DSACache) -> KDACache | DSACache:
    """A cache with its own tensors (the layer calls rebind or extend them)."""
    if isinstance(cache, KDACache):
        return KDACache(cache.state.clone(), cache.conv.clone())
    k, gate, keys = (None if t is None else t.clone() for t in (cache.pending_k, cache.pending_gate, cache.group_keys))
    return DSACache(cache.rows, cache.latent.clone(), k, gate, keys)


@torch.no_grad()
def next_token(
    model: Glm53Model,
    caches: Sequence[Sequence[KDACache | DSACache]],
    totals: Sequence[int],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """One decode step per request over copies of ``caches`` ``[layer][request]``: the oracle's layer calls
    at position ``totals[req]`` -> ``[1, dim]`` each (the final hidden state, before the norm)."""
    out = []
    for req, (n, x) in enumerate(zip(totals, inputs)):
        request_caches = [_copy(caches[layer][req]) for layer in range(len(caches))]
        h, _ = run_layers(model, x, n, request_caches)
        out.append(h)
    return out


# ---- the checks --------------------------------------------------------------------------------


def cache_parts(cache: KDACache | DSACache) -> dict[str, torch.Tensor]:
    """A cache's parts as the decode keeps them, by name (host tensors)."""
    if isinstance(cache, KDACache):
        return {"KDA state": cache.state.cpu(), "convolution tail": cache.conv.cpu()}
    parts = {"latent rows": cache.latent.cpu()}
    if cache.group_keys is not None:
        assert cache.pending_k is not None and cache.pending_gate is not None
        parts |= {
            "group keys": cache.group_keys.cpu(),
            "pending keys": cache.pending_k.cpu(),
            "pending gates": cache.pending_gate.cpu(),
        }
    return parts


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def store_mismatches(
    decoded: Sequence[Sequence[KDACache | DSACache]], ranks_stored: list[list[dict[int, tuple]]]
) -> list[str]:
    """Where the decode's caches differ from what the prefill ranks held at rest (``Glm53Store.stored_rows``
    per rank, layer and request), byte for byte: every latent row and group key from the rank that stores
    it, each exactly once; the KDA state and tail equal to every rank's copy. (The pending indexer rows
    are not among the rows a rank reports; the oracle check compares them.)"""
    problems = []
    for layer, per_request in enumerate(decoded):
        for req, cache in enumerate(per_request):
            got = cache_parts(cache)
            if isinstance(cache, KDACache):
                for rank, stored in enumerate(ranks_stored):
                    state, conv = stored[layer][req]
                    for what, held in (("KDA state", state), ("convolution tail", conv)):
                        if held is None or not _bytes_equal(got[what], held.cpu()):
                            problems.append(
                                f"layer {layer} request {req}: the decode's {what} differs from rank {rank}'s"
                            )
                continue
            for what, pick in (("latent rows", (0, 1)), ("group keys", (2, 3))):
                if what not in got:
                    continue
                covered = torch.zeros(got[what].shape[0], dtype=torch.int32)
                for rank, stored in enumerate(ranks_stored):
                    ids, rows = stored[layer][req][pick[0]], stored[layer][req][pick[1]]
                    covered[ids] += 1
                    if not _bytes_equal(got[what][ids], rows.cpu()):
                        problems.append(f"layer {layer} request {req}: the decode's {what} differ from rank {rank}'s")
                if not bool((covered == 1).all()):
                    problems.append(
                        f"layer {layer} request {req}: the prefill ranks do not hold each of its {what} once"
                    )
    return problems


# ---- the family's payload ------------------------------------------------------------------------


OracleCheck = Callable[[RunConfig, list[list[Any]], Glm53OracleResult], list[str]]


class Glm53PDPayload(PartPayload):
    """GLM-5.3 behind :class:`~reference_impl.families.base.PDPayload` for one run.

    ``oracle_check``: the decode's caches against the oracle's, problems as strings (the family passes its
    check's bounds, :func:`~.check.decode_cache_mismatches`: a CP run's KDA states are composed in another
    order than the oracle's recurrence, so they agree within a bound, not byte for byte)."""

    oracle_check_kind = "within the family check's bounds (KDA states composed in another order)"

    def __init__(self, run: RunConfig, oracle_check: OracleCheck) -> None:
        cfg = run.model
        assert isinstance(cfg, Glm53Config)
        super().__init__(run, Glm53Parts(run))
        self.cfg, self.oracle_check = cfg, oracle_check

    def sender(self, transport: BlockTransport, decode_rank: int) -> Glm53LayerStreamer:
        return Glm53LayerStreamer(self.run, transport, decode_rank)

    def decoder(self, device: torch.device) -> Glm53Decoder:
        return Glm53Decoder(self.run, device)

    def store_mismatches(self, decoded: list[list[KDACache | DSACache]], ranks_stored: list[Any]) -> list[str]:
        return store_mismatches(decoded, ranks_stored)

    def oracle_mismatches(self, decoded: list[list[KDACache | DSACache]], oracle: Glm53OracleResult) -> list[str]:
        return self.oracle_check(self.run, decoded, oracle)

    def step(
        self, model: torch.nn.Module, caches: list[list[KDACache | DSACache]], inputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        return next_token(cast(Glm53Model, model), caches, [r.total for r in self.run.requests], inputs)
