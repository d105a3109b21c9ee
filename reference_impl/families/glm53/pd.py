"""Prefill -> decode of a GLM-5.3 cache: what each prefill rank ships, and how the decode lays it out
and continues.

**What travels**, per layer and finished request, as row blocks
(:class:`~reference_impl.pd.transport.RowBlock`, told apart by their ``part``):

===============  =================  ===================================  ====================================
part             layers             rows (positions)                     sent by
===============  =================  ===================================  ====================================
``LATENT`` (1)   indexed            the stored latent rows (528-byte     every rank: the rows it stores (phase
                                    FP8 rows, or bf16), token positions  2: the owner of the row's loc)
``KEYS`` (2)     indexed, own       the pooled group keys (float32),     every rank: the groups whose last
                 indexer            group indices                        token's loc it owns
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

**The decode** (:class:`Glm53Decoder`) allocates, per request and layer, one region per part in one
``uint8`` arena (the Mooncake transport registers it and publishes the regions,
:class:`Glm53DecodeTarget`), places each block's rows at ``position - first position`` and books every
row exactly once. It assembles the oracle's caches (:class:`~.model.oracle.KDACache`,
:class:`~.model.oracle.DSACache`, views of the arena) and continues one token with the oracle's own
layer call (:func:`~.model.oracle.run_layers`).

Bytes per request of ``n`` tokens (``R`` the latent row's bytes, ``Di`` the indexer key's width, ``P``
the group, ``e`` the compute dtype's bytes): an indexed layer with its own indexer
``n R + (n // P) 4 Di + (n % P) 2 Di e``; one sharing its selection ``n R``; a KDA layer
``H Dk^2 4 + (conv - 1) 3 H Dk e``, whatever ``n`` (:func:`request_bytes`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig, compute_dtype
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.cp.store import Glm53Store
from reference_impl.families.glm53.model.oracle import DSACache, Glm53Model, Glm53OracleResult, KDACache, run_layers
from reference_impl.pd.mooncake import NOTIFY_NAME, Completion, TransferTimeoutError
from reference_impl.pd.mooncake_engine import MooncakeEngine
from reference_impl.pd.staging import Overlap, SideStreamStaging, overlap
from reference_impl.pd.transport import BlockTransport, Pending, RowBlock

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
ALIGN = 16  # each region of the decode's arena starts on a multiple of this many bytes (read as float32 / bf16)


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
    """A request's cache bytes, every layer and part: what the decode receives of it."""
    cfg = run.model
    return sum(
        first_and_count(cfg, part, n_tokens)[1] * row_bytes(run, part)
        for layer in range(cfg.n_layers)
        for part in parts_of(cfg, layer)
    )


def next_token_inputs(run: RunConfig, device: torch.device) -> list[torch.Tensor]:
    """Per request, the layer-0 input ``[1, dim]`` of the token after its prompt (a stand-in for the
    sampled token's embedding; the workload's inputs are seeded hidden states too), from ``seed + 2``."""
    gen = torch.Generator(device=device).manual_seed(run.seed + 2)
    dtype = compute_dtype(run, device)
    return [torch.randn(1, run.model.dim, generator=gen, device=device).to(dtype) for _ in run.requests]


def owned_rows(own: Ownership, rank: int, cfg: Glm53Config, locs: torch.Tensor, part: int) -> torch.Tensor:
    """Which rows of a request's ``part`` ``rank`` stores (int64 positions): its latent rows' locs, or the
    groups whose last token's loc it owns (``locs``: the request's logical locs, host)."""
    if part == LATENT:
        return torch.nonzero(own.owner(locs) == rank).flatten()
    ends = locs[cfg.index_kpool - 1 :: cfg.index_kpool][: len(locs) // cfg.index_kpool]
    return torch.nonzero(own.owner(ends) == rank).flatten()


def replica_sender(own: Ownership, locs: torch.Tensor) -> int:
    """The rank that ships a request's replicated parts: the owner of its last token's slot."""
    return int(own.owner(locs[-1:].cpu())[0])


def ships_replicas(own: Ownership, locs: torch.Tensor, rank: int) -> bool:
    """Whether ``rank`` ships the replicated parts of the request at ``locs`` (its logical locs, host)."""
    return replica_sender(own, locs) == rank


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


class Glm53LayerStreamer:
    """A prefill rank's layer-wise send of its GLM-5.3 cache (an engine
    :class:`~reference_impl.engine.LayerStoredHook`): after layer ``l`` is stored, one block per part
    for each request the chunk finishes (the module docstring's table); on CUDA the reads and the
    copy to pinned host run on a side stream (:mod:`reference_impl.pd.staging`)."""

    def __init__(self, run: RunConfig, transport: BlockTransport, decode_rank: int) -> None:
        self.run, self.transport, self.decode_rank = run, transport, decode_rank
        self.store: Glm53Store | None = None
        self.plans: dict[int, _Plan] = {}
        self.headers: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}  # (req, layer, part) -> rows, header
        self.pending: dict[int, list[Pending]] = {}
        self.staging: SideStreamStaging | None = None
        self.loop_end: torch.cuda.Event | None = None
        self.overlap: Overlap | None = None
        self.bytes_sent = self.rows_sent = self.blocks_sent = 0

    def begin_chunk(self, store: Any, finished: dict[int, torch.Tensor]) -> None:
        if not isinstance(store, Glm53Store):
            raise ConfigError("a layer-wise GLM-5.3 PD send needs the GLM-5.3 store")
        self.store = store
        device, rank, cfg = store.group.device, store.group.rank, store.cfg
        if device.type == "cuda" and self.staging is None:
            self.staging = SideStreamStaging(device)
        # Unsharded (C = 1) every row is the one rank's: the run's ownership says so too.
        own = Ownership(self.run.cp_size, self.run.interleave, self.run.page_size)
        self.plans, self.headers = {}, {}
        for req, locs in finished.items():
            host = locs.cpu()
            positions = owned_rows(own, rank, cfg, host, LATENT)
            groups = owned_rows(own, rank, cfg, host, KEYS)
            ends = host[cfg.index_kpool - 1 :: cfg.index_kpool]
            plan = _Plan(
                req,
                ships_replicas(own, host, rank),
                len(host),
                positions,
                host[positions].to(device),
                groups,
                ends[groups].to(device),
            )
            self.plans[req] = plan
            # The headers, from the rows each block will hold, built here: a tensor built from host data
            # inside the layer loop counts as a host sync (phase 6).
            for layer in range(cfg.n_layers):
                for part in parts_of(cfg, layer):
                    rows = self._rows_planned(plan, part)
                    header = torch.tensor([req, layer, rows, row_bytes(self.run, part), 0, part], dtype=torch.long)
                    self.headers[req, layer, part] = (rows, header)

    def _rows_planned(self, plan: _Plan, part: int) -> int:
        if part == LATENT:
            return len(plan.latent_positions)
        if part == KEYS:
            return len(plan.group_ids)
        assert self.store is not None
        return first_and_count(self.store.cfg, part, plan.n_tokens)[1] if plan.replica else 0

    def block(self, layer: int, req: int, part: int) -> RowBlock:
        """This rank's ``part`` of ``req`` on ``layer`` (no rows where it ships nothing of it)."""
        store, plan = self.store, self.plans[req]
        assert store is not None
        width = row_bytes(self.run, part)
        rows = torch.empty(0, width, dtype=torch.uint8, device=store.group.device)
        positions = torch.zeros(0, dtype=torch.long)
        sources: list[torch.Tensor] = []  # main-stream tensors this block reads (on the side stream, with CUDA)
        if part == LATENT:
            sources = [plan.latent_locs]
            rows = _as_bytes(store.read_latent(layer, plan.latent_locs))
            positions = plan.latent_positions
        elif part == KEYS:
            sources = [plan.group_locs]
            rows = _as_bytes(store.read_group_keys(layer, plan.group_locs))
            positions = plan.group_ids
        elif plan.replica and part == PENDING:
            keys, gates = sources = list(store.pending_of(layer, plan.key))
            rows = _as_bytes(torch.cat([keys, gates], dim=1))
            positions = torch.arange(plan.n_tokens - keys.shape[0], plan.n_tokens)
        elif plan.replica:
            cache = store.kda_cache_of(layer, plan.key)
            sources = [cache.state, cache.conv]
            rows = _as_bytes(cache.state.reshape(cache.state.shape[0], -1) if part == STATE else cache.conv)
            positions = torch.arange(rows.shape[0])
        if self.staging is not None:  # read on the side stream: the main stream may free these meanwhile
            for t in sources:  # (the next chunk's plan, a rebound state, a freed request's rows)
                t.record_stream(self.staging.stream)
        return RowBlock(req, layer, positions, rows, rows.new_empty(rows.shape[0], 0), _no_scale(), part)

    def layer_stored(self, layer: int) -> None:
        assert self.store is not None
        cfg = self.store.cfg
        for req in self.plans:
            for part in parts_of(cfg, layer):
                rows, header = self.headers[req, layer, part]
                if self.staging is not None:  # read and copy on the side stream (its allocations too)
                    staged = self.staging.stage(partial(self.block, layer, req, part))
                    block = staged.block
                    sent = self.transport.isend(block, self.decode_rank, header, ready=staged.done)
                else:
                    block = self.block(layer, req, part)
                    sent = self.transport.isend(block, self.decode_rank, header)
                if block.n_rows != rows:  # shapes only: no device read
                    raise ConfigError(
                        f"request {req} layer {layer}: this rank holds {block.n_rows} {PART_NAMES[part]} rows, "
                        f"its ownership says {rows}"
                    )
                self.pending.setdefault(req, []).append(sent)
                self.bytes_sent += block.payload_bytes
                self.rows_sent += block.n_rows
                self.blocks_sent += 1
            if layer == cfg.n_layers - 1:
                self.pending[req].append(self.transport.complete(req, self.decode_rank))

    def loop_done(self) -> None:
        if self.staging is not None:
            self.loop_end = torch.cuda.Event(enable_timing=True)
            self.loop_end.record()

    def wait_all(self) -> list[float]:
        """One completion wait per request (request order); the milliseconds each took."""
        waits = []
        for req in sorted(self.pending):
            start = time.perf_counter()
            for sends in self.pending[req]:
                sends.wait()
            waits.append((time.perf_counter() - start) * 1e3)
        if self.staging is not None and self.loop_end is not None:
            self.overlap = overlap(self.staging, self.loop_end)
        return waits


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, width]`` of any dtype -> ``uint8 [n, bytes per row]`` (the wire's row form; empty ones too)."""
    return t.contiguous().view(torch.uint8)


def _no_scale() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float32)


def bytes_at_rest(run: RunConfig, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
    """What ``rank`` is to ship of every request, counted from the ownership (its page table's locs)
    and the cache's arithmetic: the latent rows and group keys it stores, and the replicated parts
    (KDA states and tails, pending indexer rows) of the requests it is the replica sender of
    (``request_locs``: request -> its logical locs, :func:`reference_impl.engine.request_locs`)."""
    cfg = run.model
    assert isinstance(cfg, Glm53Config)
    own = Ownership(run.cp_size, run.interleave, run.page_size)
    total = 0
    for req, locs in request_locs.items():
        n = run.requests[req].total
        host = locs[:n].cpu()
        replica = ships_replicas(own, host, rank)
        for layer in range(cfg.n_layers):
            for part in parts_of(cfg, layer):
                if part in SHARDED_PARTS:
                    rows = len(owned_rows(own, rank, cfg, host, part))
                else:
                    rows = first_and_count(cfg, part, n)[1] if replica else 0
                total += rows * row_bytes(run, part)
    return total


# ---- the decode side -------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """One request's ``part`` of one layer in the decode's arena."""

    offset: int  # bytes from the arena's start
    row_bytes: int
    first: int  # position of row 0
    rows: int


class Glm53Decoder:
    """The decode's GLM-5.3 cache of every request (see the module docstring): one arena, a region per
    (request, layer, part), exactly-once bookkeeping of every row."""

    def __init__(self, run: RunConfig, device: torch.device | str = "cpu") -> None:
        cfg = run.model
        assert isinstance(cfg, Glm53Config)
        self.run, self.cfg, self.rows_format = run, cfg, latent_rows(run)
        self.dtype = run_dtype(run)
        self.totals = [r.total for r in run.requests]
        self.regions: dict[tuple[int, int, int], Region] = {}
        offset = 0
        for req, n in enumerate(self.totals):
            for layer in range(cfg.n_layers):
                for part in parts_of(cfg, layer):
                    first, rows = first_and_count(cfg, part, n)
                    width = row_bytes(run, part)
                    self.regions[req, layer, part] = Region(offset, width, first, rows)
                    offset = -(-(offset + rows * width) // ALIGN) * ALIGN
        self.arena = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.written = {key: torch.zeros(r.rows, dtype=torch.int32) for key, r in self.regions.items()}
        self.bytes_received = 0

    @property
    def blocks_per_rank(self) -> int:
        """Blocks each prefill rank sends (one per part, layer and request, empty ones included)."""
        return len(self.regions)

    def view(self, req: int, layer: int, part: int) -> torch.Tensor:
        """``uint8 [rows, row bytes]``: the region in the arena."""
        r = self.regions[req, layer, part]
        return self.arena[r.offset : r.offset + r.rows * r.row_bytes].view(r.rows, r.row_bytes)

    def _rows(self, req: int, layer: int, part: int, positions: torch.Tensor) -> torch.Tensor:
        key = (req, layer, part)
        if key not in self.regions:
            name = PART_NAMES.get(part, part)
            raise ConfigError(f"request {req} layer {layer}: the decode keeps no {name} rows there")
        r = self.regions[key]
        rows = positions.cpu() - r.first
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= r.rows):
            raise ConfigError(
                f"request {req} layer {layer}: {PART_NAMES[part]} positions {int(positions.min())}.."
                f"{int(positions.max())} outside the decode's [{r.first}, {r.first + r.rows})"
            )
        return rows

    def _book(self, req: int, layer: int, part: int, rows: torch.Tensor) -> None:
        counts = self.written[req, layer, part]
        if bool((counts[rows] > 0).any()):
            raise ConfigError(f"request {req} layer {layer}: a {PART_NAMES[part]} row arrived twice")
        counts[rows] += 1

    def receive(self, block: RowBlock) -> None:
        """Place a block's rows in their region (two-sided transports)."""
        rows = self._rows(block.request, block.layer, block.part, block.positions)
        r = self.regions[block.request, block.layer, block.part]
        if block.has_index or (block.n_rows and block.mla.shape[1] != r.row_bytes):
            raise ConfigError(
                f"request {block.request} layer {block.layer}: {PART_NAMES[block.part]} rows of "
                f"{block.mla.shape[1]} bytes, the decode's are {r.row_bytes}"
            )
        self._book(block.request, block.layer, block.part, rows)
        view = self.view(block.request, block.layer, block.part)
        view.index_copy_(0, rows.to(view.device), block.mla.to(view.device))
        self.bytes_received += block.payload_bytes

    def landed(self, req: int, layer: int, part: int, positions: torch.Tensor) -> None:
        """Book rows a one-sided transport wrote into the arena itself."""
        self._book(req, layer, part, self._rows(req, layer, part, positions))

    def check_complete(self) -> None:
        """:class:`ConfigError` unless every row of every region arrived exactly once."""
        for (req, layer, part), counts in self.written.items():
            if bool((counts != 1).any()):
                row = int((counts != 1).nonzero()[0])
                first = self.regions[req, layer, part].first
                raise ConfigError(
                    f"request {req} layer {layer}: the decode's {PART_NAMES[part]} row at position {first + row} "
                    f"arrived {int(counts[row])} times (no prefill rank shipped it, or two did)"
                )

    def _typed(self, req: int, layer: int, part: int, dtype: torch.dtype) -> torch.Tensor:
        """The region as ``dtype [rows, row bytes / itemsize]`` (a view of the arena)."""
        region = self.view(req, layer, part)
        width = region.shape[1] * region.element_size() // dtype.itemsize  # named: a region may have no rows
        return region.reshape(-1).view(dtype).reshape(region.shape[0], width)

    def caches(self) -> list[list[KDACache | DSACache]]:
        """``[layer][request]``: the oracle's cache types assembled from the arena (views of it)."""
        cfg, fmt = self.cfg, self.rows_format
        out: list[list[KDACache | DSACache]] = []
        for layer in range(cfg.n_layers):
            row: list[KDACache | DSACache] = []
            for req in range(len(self.totals)):
                if cfg.is_kda(layer):
                    H, D = cfg.linear_num_heads, cfg.linear_head_dim
                    state = self._typed(req, layer, STATE, torch.float32).view(H, D, D)
                    row.append(KDACache(state, self._typed(req, layer, CONV, self.dtype)))
                    continue
                cache = DSACache(fmt, self._typed(req, layer, LATENT, fmt.storage_dtype))
                if not cfg.shares_selection(layer):
                    pending = self._typed(req, layer, PENDING, self.dtype)
                    cache.pending_k, cache.pending_gate = pending.split(cfg.index_head_dim, dim=1)
                    cache.group_keys = self._typed(req, layer, KEYS, torch.float32)
                row.append(cache)
            out.append(row)
        return out

    @torch.no_grad()
    def next_token(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's next token (``inputs[req] [1, dim]``, its layer-0 input) through every layer
        against the assembled caches (copies: the arena stays as received) -> its final hidden state."""
        assert isinstance(model, Glm53Model)
        return next_token(model, self.caches(), self.totals, inputs)

    def mooncake_receiver(self, engine: MooncakeEngine) -> Glm53MooncakeReceiver:
        return Glm53MooncakeReceiver(self, engine)

    def target(self, session_id: str) -> Glm53DecodeTarget:
        """Where the prefill ranks write (the arena registered with the decode's Mooncake engine)."""
        return Glm53DecodeTarget(session_id, self.arena.data_ptr(), dict(self.regions))


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


@dataclass(frozen=True)
class Glm53DecodeTarget:
    """A :class:`~reference_impl.pd.mooncake.WriteTarget`: the decode's arena and its regions."""

    session_id: str
    arena_address: int
    regions: dict[tuple[int, int, int], Region]

    @property
    def notify_address(self) -> int:
        return self.arena_address

    def check_widths(self, rank: int, block: RowBlock) -> None:
        region = self.regions.get((block.request, block.layer, block.part))
        if region is None or block.has_index or (block.n_rows and block.mla.shape[1] != region.row_bytes):
            raise ConfigError(
                f"rank {rank} sends {PART_NAMES.get(block.part, block.part)} rows of request {block.request} "
                f"layer {block.layer} the decode has no region of that width for"
            )

    def destinations(self, request: int, layer: int, positions: torch.Tensor, part: int = 0) -> tuple[torch.Tensor]:
        r = self.regions[request, layer, part]
        rows = positions.cpu() - r.first
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= r.rows):
            raise ConfigError(f"request {request} layer {layer}: {PART_NAMES[part]} positions outside the decode's")
        return (self.arena_address + r.offset + rows * r.row_bytes,)


class Glm53MooncakeReceiver:
    """The decode side over Mooncake: registers the arena, publishes :attr:`target`, books each
    completion's blocks (:attr:`~reference_impl.pd.mooncake.Completion.blocks`)."""

    def __init__(self, decoder: Glm53Decoder, engine: MooncakeEngine) -> None:
        self.decoder, self.engine = decoder, engine
        engine.register(decoder.arena)
        self.target = decoder.target(engine.session_id)

    def wait(
        self, requests: Sequence[int], prefill_ranks: Sequence[int], n_layers: int, deadline_s: float
    ) -> list[Completion]:
        """One completion per (request, prefill rank); :class:`TransferTimeoutError` names the missing."""
        missing = {(r, k) for r in requests for k in prefill_ranks}
        stop, done_all = time.monotonic() + deadline_s, []
        while missing:
            for name, message in self.engine.notifications():
                if name != NOTIFY_NAME:
                    continue
                done = Completion.parse(message)
                if (done.request, done.rank) not in missing:
                    raise ConfigError(f"an unexpected or repeated completion: {json.loads(message)}")
                for layer, part, runs in done.blocks:
                    parts = [torch.arange(a, a + n) for a, n in runs]
                    positions = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
                    self.decoder.landed(done.request, layer, part, positions)
                self.decoder.bytes_received += done.nbytes
                done_all.append(done)
                missing.discard((done.request, done.rank))
            if missing and time.monotonic() > stop:
                pairs = ", ".join(f"request {r} from prefill rank {k}" for r, k in sorted(missing)[:6])
                raise TransferTimeoutError(
                    f"the decode waited {deadline_s:.0f} s for Mooncake completions; missing {pairs}"
                )
            if missing:
                time.sleep(0.001)
        return done_all

    def close(self) -> None:
        self.engine.unregister(self.decoder.arena)


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


def next_token_error(
    model: Glm53Model,
    oracle: Glm53OracleResult,
    totals: Sequence[int],
    inputs: Sequence[torch.Tensor],
    got: Sequence[torch.Tensor],
) -> float:
    """The largest difference of the decode's next-token hidden states from the oracle's step (the same
    layer calls over the oracle's own caches), relative to the reference's largest value."""
    want = next_token(model, oracle.caches, totals, inputs)
    err = 0.0
    for a, b in zip(got, want):
        scale = max(1.0, b.float().abs().max().item())
        err = max(err, (a.float().cpu() - b.float().cpu()).abs().max().item() / scale)
    return err


# ---- the family's payload ------------------------------------------------------------------------


OracleCheck = Callable[[RunConfig, list[list[Any]], Glm53OracleResult], list[str]]


class Glm53PDPayload:
    """GLM-5.3 behind :class:`~reference_impl.families.base.PDPayload` for one run.

    ``oracle_check``: the decode's caches against the oracle's, problems as strings (the family passes its
    check's bounds, :func:`~.check.decode_cache_mismatches`: a CP run's KDA states are composed in another
    order than the oracle's recurrence, so they agree within a bound, not byte for byte)."""

    oracle_check_kind = "within the family check's bounds (KDA states composed in another order)"

    def __init__(self, run: RunConfig, oracle_check: OracleCheck) -> None:
        cfg = run.model
        assert isinstance(cfg, Glm53Config)
        self.run, self.cfg, self.oracle_check = run, cfg, oracle_check

    def sender(self, transport: BlockTransport, decode_rank: int) -> Glm53LayerStreamer:
        return Glm53LayerStreamer(self.run, transport, decode_rank)

    def bytes_at_rest(self, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
        return bytes_at_rest(self.run, rank, request_locs)

    def decoder(self, device: torch.device) -> Glm53Decoder:
        return Glm53Decoder(self.run, device)

    def next_inputs(self, device: torch.device) -> list[torch.Tensor]:
        return next_token_inputs(self.run, device)

    def store_mismatches(self, decoded: list[list[KDACache | DSACache]], ranks_stored: list[Any]) -> list[str]:
        return store_mismatches(decoded, ranks_stored)

    def oracle_mismatches(self, decoded: list[list[KDACache | DSACache]], oracle: Glm53OracleResult) -> list[str]:
        return self.oracle_check(self.run, decoded, oracle)

    def next_token_error(
        self,
        model: torch.nn.Module,
        oracle: Glm53OracleResult,
        inputs: Sequence[torch.Tensor],
        got: Sequence[torch.Tensor],
    ) -> float:
        return next_token_error(cast(Glm53Model, model), oracle, [r.total for r in self.run.requests], inputs, got)
