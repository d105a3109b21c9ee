"""Prefill -> decode of a DeepSeek-V4 cache: what each prefill rank ships, and how the decode lays it
out and continues.

**What travels**, per layer and finished request, as row blocks
(:class:`~reference_impl.pd.transport.RowBlock`, told apart by their ``part``):

=================  ===========================  =========================================================
part               rows (positions)             sent by
=================  ===========================  =========================================================
``ENTRIES`` (1)    compressed entries, CSA's    CSA: every rank, the entries it stores (sharded by their
                   main bytes then indexer key  compute owner, phase 2); HCA (replicated): the request's
                   bytes (entry indices)        **replica sender** only
``WINDOW`` (2)     the last ``window - 1`` raw  the replica sender
                   entries (token positions)
``STATE`` (3)      the compressor's float32     the replica sender (CSA and HCA layers)
                   pre-pool rows of the
                   incomplete block, as bytes
                   (token positions)
=================  ===========================  =========================================================

The **replica sender** of a request is the rank that owns the slot of its last token (its page with
the page interleave): every rank holds the same replicated bytes, so exactly one sends them, and
different requests spread that work over the ranks. Every rank sends one block per part, layer and
request, empty where it has nothing, so a two-sided decode knows how many blocks to expect
(:meth:`V4Decoder.blocks_per_rank`) and never counts ranks' ownership.

**The decode** (:class:`V4Decoder`) allocates, per request and layer, one region per part in one
arena (``uint8``; the Mooncake transport registers it and publishes the regions,
:class:`V4DecodeTarget`), places each block's rows at ``position - first position`` and books every
row exactly once. It assembles a :class:`~.model.cache.V4LayerCache` per layer and request: the
window tail as ``raw`` (``raw_start`` says its first position), the entries, the indexer keys and
the compressor state unpacked, and continues one token (:meth:`V4Decoder.next_token`) with the
oracle's layer call :func:`~.model.cache.v4_layer_forward`.

Bytes per request and layer (``B`` the main entry's bytes, ``Bi`` the indexer key's, ``n`` tokens,
``W`` the window): CSA ``(n // 4) (B + Bi) + min(n, W - 1) B + s_4 (4 D + 4 Di) 4``, HCA
``(n // 128) B + min(n, W - 1) B + s_128 2 D 4``, sliding ``min(n, W - 1) B``, with ``s_m`` the
state's rows (:func:`~.model.compressor.state_start`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig, compute_dtype
from reference_impl.cp.ownership import Ownership
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.cp.store import V4Store, entry_owners, pack_pool, pool_width
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache, v4_layer_forward
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.families.deepseek_v4.model.oracle import V4Block, V4Model, V4OracleResult
from reference_impl.pd.mooncake import NOTIFY_NAME, Completion, TransferTimeoutError
from reference_impl.pd.mooncake_engine import MooncakeEngine
from reference_impl.pd.staging import Overlap, SideStreamStaging, overlap
from reference_impl.pd.transport import BlockTransport, Pending, RowBlock

ENTRIES, WINDOW, STATE = 1, 2, 3
PART_NAMES = {ENTRIES: "entries", WINDOW: "window tail", STATE: "compressor state"}
F32 = 4  # bytes of a float32 pre-pool value
ALIGN = 16  # each region of the decode's arena starts on a multiple of this many bytes


def parts_of(cfg: V4ModelConfig, layer: int) -> tuple[int, ...]:
    """The parts a layer ships: the window tail everywhere, entries and state on CSA and HCA layers."""
    return (ENTRIES, WINDOW, STATE) if cfg.ratio(layer) else (WINDOW,)


def row_bytes(cfg: V4ModelConfig, codec: str, layer: int, part: int) -> int:
    """Bytes of one row of ``part`` on ``layer``."""
    m = cfg.ratio(layer)
    if part == ENTRIES:
        return main_entry_bytes(codec) + (index_entry_bytes(codec, cfg.index_head_dim) if m == 4 else 0)
    if part == WINDOW:
        return main_entry_bytes(codec)
    return pool_width(cfg, m) * F32


def first_and_count(cfg: V4ModelConfig, layer: int, part: int, n_tokens: int) -> tuple[int, int]:
    """``(first position, rows)`` of a request's ``part`` on ``layer`` after ``n_tokens`` tokens."""
    m = cfg.ratio(layer)
    if part == ENTRIES:
        return 0, n_tokens // m
    if part == WINDOW:
        rows = min(n_tokens, cfg.window_size - 1)
        return n_tokens - rows, rows
    first = state_start(n_tokens, m)
    return first, n_tokens - first


def next_token_inputs(run: RunConfig, device: torch.device) -> list[torch.Tensor]:
    """Per request, the layer-0 input ``[1, dim]`` of the token after its prompt (a stand-in for the
    sampled token's embedding; the workload's inputs are seeded hidden states too), from ``seed + 2``."""
    gen = torch.Generator(device=device).manual_seed(run.seed + 2)
    dtype = compute_dtype(run, device)
    return [torch.randn(1, run.model.dim, generator=gen, device=device).to(dtype) for _ in run.requests]


def replica_sender(store: V4Store, locs: torch.Tensor) -> int:
    """The rank that ships a request's replicated parts: the owner of its last token's slot."""
    assert store.ownership is not None  # PD runs phase 2: CSA entries sharded
    return int(store.ownership.owner(locs[-1:].cpu())[0])


# ---- the prefill side ------------------------------------------------------------------------


class V4LayerStreamer:
    """A prefill rank's layer-wise send of its V4 cache (an engine
    :class:`~reference_impl.engine.LayerStoredHook`): after layer ``l`` is stored, one block per part
    for each request the chunk finishes (the module docstring's table); on CUDA the reads and the
    copy to pinned host run on a side stream (:mod:`reference_impl.pd.staging`)."""

    def __init__(self, transport: BlockTransport, decode_rank: int) -> None:
        self.transport, self.decode_rank = transport, decode_rank
        self.store: V4Store | None = None
        self.replicas: dict[int, bool] = {}  # finished request -> whether this rank ships its replicated parts
        # (request, layer, part) -> the rows it will hold and its wire header
        self.headers: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}
        self.pending: dict[int, list[Pending]] = {}
        self.staging: SideStreamStaging | None = None
        self.loop_end: torch.cuda.Event | None = None
        self.overlap: Overlap | None = None
        self.bytes_sent = self.rows_sent = self.blocks_sent = 0

    def begin_chunk(self, store: Any, finished: dict[int, torch.Tensor]) -> None:
        if not isinstance(store, V4Store) or not store.sharded:
            raise ConfigError("a layer-wise V4 PD send needs the V4 store with CSA entries sharded (phase 2)")
        self.store = store
        device = store.group.device
        if device.type == "cuda" and self.staging is None:
            self.staging = SideStreamStaging(device)
        self.replicas = {req: replica_sender(store, locs) == store.group.rank for req, locs in finished.items()}
        # The headers, from the rows each block will hold (the ownership and the cache's arithmetic), built
        # here: a tensor built from host data inside the layer loop counts as a host sync (phase 6).
        cfg, rank, self.headers = store.cfg, store.group.rank, {}
        assert store.ownership is not None
        for req, locs in finished.items():
            n = int(locs.numel())
            for layer in range(cfg.n_layers):
                for part in parts_of(cfg, layer):
                    rows = first_and_count(cfg, layer, part, n)[1]
                    if part == ENTRIES and cfg.ratio(layer) == 4:
                        rows = entry_owners(store.ownership, locs.cpu(), range(rows)).count(rank)
                    elif not self.replicas[req]:
                        rows = 0
                    width = row_bytes(cfg, store.codec, layer, part)
                    header = torch.tensor([req, layer, rows, width, 0, part], dtype=torch.long)
                    self.headers[req, layer, part] = (rows, header)

    def block(self, layer: int, req: int, replica: bool, part: int) -> RowBlock:
        """This rank's ``part`` of ``req`` on ``layer`` (no rows where it ships nothing of it)."""
        store = self.store
        assert store is not None
        cfg, st = store.cfg, store.state(layer, req)
        n = st.n_tokens
        width = row_bytes(cfg, store.codec, layer, part)
        if self.staging is not None:  # read on the side stream: a later chunk may free these (main stream)
            for t in (st.main, st.index, st.window, st.pool):
                t.record_stream(self.staging.stream)
        rows, positions = st.window.new_empty(0, width), torch.zeros(0, dtype=torch.long)
        if part == ENTRIES and (store.owns(layer) or replica):  # CSA: the rank's share; HCA: replicated
            rows = torch.cat([st.main, st.index], dim=1) if cfg.ratio(layer) == 4 else st.main
            positions = st.ids
        elif part == WINDOW and replica:
            rows, positions = st.window, torch.arange(n - st.window.shape[0], n)
        elif part == STATE and replica:
            rows = st.pool.contiguous().view(torch.uint8).reshape(st.pool.shape[0], width)
            positions = torch.arange(n - st.pool.shape[0], n)
        return RowBlock(req, layer, positions, rows, rows.new_empty(rows.shape[0], 0), _no_scale(), part)

    def layer_stored(self, layer: int) -> None:
        assert self.store is not None
        for req, replica in self.replicas.items():
            for part in parts_of(self.store.cfg, layer):
                rows, header = self.headers[req, layer, part]
                if self.staging is not None:  # read and copy on the side stream (its allocations too)
                    staged = self.staging.stage(partial(self.block, layer, req, replica, part))
                    block = staged.block
                    sent = self.transport.isend(block, self.decode_rank, header, ready=staged.done)
                else:
                    block = self.block(layer, req, replica, part)
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
            if layer == self.store.cfg.n_layers - 1:
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


def _no_scale() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float32)


def bytes_at_rest(run: RunConfig, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
    """What ``rank`` is to ship of every request, counted from the ownership (its page table's locs)
    and the cache's arithmetic: the CSA entries and keys it stores, and the replicated parts (HCA
    entries, window tails, compressor states) of the requests it is the replica sender of
    (``request_locs``: request -> its logical locs, :func:`reference_impl.engine.request_locs`)."""

    cfg = run.model
    assert isinstance(cfg, V4ModelConfig)
    own = Ownership(run.cp_size, run.interleave, run.page_size)
    total = 0
    for req, locs in request_locs.items():
        n = run.requests[req].total
        replica = int(own.owner(locs[n - 1 : n].cpu())[0]) == rank
        for layer in range(cfg.n_layers):
            for part in parts_of(cfg, layer):
                rows = first_and_count(cfg, layer, part, n)[1]
                if part == ENTRIES and cfg.ratio(layer) == 4:
                    rows = entry_owners(own, locs.cpu(), range(rows)).count(rank)
                elif not replica:
                    continue
                total += rows * row_bytes(cfg, run.kv_dtype, layer, part)
    return total


# ---- the decode side -------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """One request's ``part`` of one layer in the decode's arena."""

    offset: int  # bytes from the arena's start
    row_bytes: int
    first: int  # position of row 0
    rows: int


class V4Decoder:
    """The decode's V4 cache of every request (see the module docstring): one arena, a region per
    (request, layer, part), exactly-once bookkeeping of every row."""

    def __init__(self, run: RunConfig, device: torch.device | str = "cpu") -> None:
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        self.run, self.cfg, self.codec = run, cfg, run.kv_dtype
        self.totals = [r.total for r in run.requests]
        self.regions: dict[tuple[int, int, int], Region] = {}
        offset = 0
        for req, n in enumerate(self.totals):
            for layer in range(cfg.n_layers):
                for part in parts_of(cfg, layer):
                    first, rows = first_and_count(cfg, layer, part, n)
                    width = row_bytes(cfg, self.codec, layer, part)
                    self.regions[req, layer, part] = Region(offset, width, first, rows)
                    offset = -(-(offset + rows * width) // ALIGN) * ALIGN  # the state is read as float32
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
            raise ConfigError(f"request {req} layer {layer}: the decode keeps no {PART_NAMES.get(part, part)} there")
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

    def caches(self) -> list[list[V4LayerCache]]:
        """``[layer][request]``: the caches assembled from the arena (views of it)."""
        cfg, codec = self.cfg, self.codec
        b = main_entry_bytes(codec)
        out: list[list[V4LayerCache]] = []
        for layer in range(cfg.n_layers):
            m = cfg.ratio(layer)
            row: list[V4LayerCache] = []
            for req, n in enumerate(self.totals):
                cache = V4LayerCache.empty(codec, m, cfg.head_dim, cfg.index_head_dim, self.arena.device)
                cache.n_tokens = n
                window = self.view(req, layer, WINDOW)
                cache.raw, cache.raw_start = window, n - window.shape[0]
                if m:
                    entries = self.view(req, layer, ENTRIES)
                    cache.entries = entries[:, :b]
                    if m == 4:
                        cache.index_keys = entries[:, b:]
                    state = self.view(req, layer, STATE)
                    values = state.reshape(-1).view(torch.float32).reshape(state.shape[0], -1)
                    widths = [cache.pool_kv.shape[1], cache.pool_score.shape[1]]
                    widths += [cache.index_pool_kv.shape[1], cache.index_pool_score.shape[1]] if m == 4 else []
                    split = values.split(widths, dim=1)
                    cache.pool_kv, cache.pool_score = split[0], split[1]
                    if m == 4:
                        cache.index_pool_kv, cache.index_pool_score = split[2], split[3]
                row.append(cache)
            out.append(row)
        return out

    @torch.no_grad()
    def next_token(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's next token (``inputs[req] [1, dim]``, its layer-0 input) through every layer
        against the assembled caches (copies: the arena stays as received) -> its final hidden state."""
        assert isinstance(model, V4Model)
        return next_token(model, self.caches(), self.totals, inputs)

    def mooncake_receiver(self, engine: MooncakeEngine) -> V4MooncakeReceiver:
        return V4MooncakeReceiver(self, engine)

    def target(self, session_id: str) -> V4DecodeTarget:
        """Where the prefill ranks write (the arena registered with the decode's Mooncake engine)."""
        return V4DecodeTarget(session_id, self.arena.data_ptr(), dict(self.regions))


@torch.no_grad()
def next_token(
    model: V4Model, caches: list[list[V4LayerCache]], totals: Sequence[int], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """One decode step per request over (copies of) ``caches`` ``[layer][request]``: ``[1, dim]`` each."""
    out = []
    for req, (n, x) in enumerate(zip(totals, inputs)):
        h = x
        for layer, block in enumerate(cast("list[V4Block]", model.layers)):  # ModuleList yields nn.Module
            cache = dataclasses.replace(caches[layer][req])  # append() rebinds fields: the original stays
            y, _, _ = v4_layer_forward(block.attn, block.attn_norm(h), n, cache)
            h = h + y
        out.append(h)
    return out


@dataclass(frozen=True)
class V4DecodeTarget:
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


class V4MooncakeReceiver:
    """The decode side over Mooncake: registers the arena, publishes :attr:`target`, books each
    completion's blocks (:attr:`~reference_impl.pd.mooncake.Completion.blocks`)."""

    def __init__(self, decoder: V4Decoder, engine: MooncakeEngine) -> None:
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


def cache_parts(cache: V4LayerCache, window: int) -> dict[str, torch.Tensor]:
    """A cache's bytes as the decode keeps them: window tail, entries, indexer keys, packed state."""
    parts = {"window tail": cache.window_tail(window).cpu(), "token count": torch.tensor(cache.n_tokens)}
    if cache.ratio:
        parts["entries"] = cache.entries.cpu()
        parts["compressor state"] = pack_pool(cache).cpu().view(torch.uint8)
        if cache.ratio == 4:
            parts["indexer keys"] = cache.index_keys.cpu()
    return parts


def oracle_mismatches(decoded: list[list[V4LayerCache]], oracle: V4OracleResult, window: int) -> list[str]:
    """Where the decode's caches differ from the oracle's, byte for byte."""
    problems = []
    for layer, caches in enumerate(oracle.caches):
        for req, ref in enumerate(caches):
            got = cache_parts(decoded[layer][req], window)
            for what, want in cache_parts(ref, window).items():
                if got[what].shape != want.shape or not torch.equal(got[what], want):
                    problems.append(f"layer {layer} request {req}: the decode's {what} differs from the oracle's")
    return problems


def store_mismatches(
    decoded: list[list[V4LayerCache]], ranks_stored: list[list[dict[int, tuple]]], window: int
) -> list[str]:
    """Where the decode's caches differ from what the prefill ranks held at rest
    (``V4Store.stored_rows`` per rank, layer and request): every entry from the rank that stores it,
    the replicated parts equal to every rank's copy."""
    problems = []
    for layer, per_request in enumerate(decoded):
        for req, cache in enumerate(per_request):
            got = cache_parts(cache, window)
            covered = torch.zeros(cache.entries.shape[0], dtype=torch.int32)
            for rank, stored in enumerate(ranks_stored):
                n_tokens, tail, pool, ids, main, index = stored[layer][req]
                held = {"token count": n_tokens.cpu(), "window tail": tail.cpu()}
                if cache.ratio:
                    held["compressor state"] = pool.cpu().contiguous().view(torch.uint8)
                    covered[ids] += 1
                    mine = (
                        {"entries": main.cpu(), "indexer keys": index.cpu()} if cache.ratio == 4 else {"entries": main}
                    )
                    for what, rows in mine.items():
                        if not torch.equal(got[what][ids], rows.cpu()):
                            problems.append(
                                f"layer {layer} request {req}: the decode's {what} differ from rank {rank}'s"
                            )
                for what, want in held.items():
                    if got[what].shape != want.shape or not torch.equal(got[what], want):
                        problems.append(f"layer {layer} request {req}: the decode's {what} differs from rank {rank}'s")
            if cache.ratio == 4 and not bool((covered == 1).all()):
                problems.append(f"layer {layer} request {req}: the prefill ranks do not hold every CSA entry once")
    return problems


def next_token_error(
    model: V4Model,
    oracle: V4OracleResult,
    totals: Sequence[int],
    inputs: Sequence[torch.Tensor],
    got: Sequence[torch.Tensor],
) -> float:
    """The largest difference of the decode's next-token hidden states from the oracle's step (the same
    layer call over the oracle's own caches), relative to the reference's largest value."""
    want = next_token(model, oracle.caches, totals, inputs)
    err = 0.0
    for a, b in zip(got, want):
        scale = max(1.0, b.float().abs().max().item())
        err = max(err, (a.float().cpu() - b.float().cpu()).abs().max().item() / scale)
    return err


# ---- the family's payload ------------------------------------------------------------------------


class V4PDPayload:
    """DeepSeek-V4 behind :class:`~reference_impl.families.base.PDPayload` for one run."""

    def __init__(self, run: RunConfig) -> None:
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        self.run, self.cfg = run, cfg

    def sender(self, transport: BlockTransport, decode_rank: int) -> V4LayerStreamer:
        return V4LayerStreamer(transport, decode_rank)

    def bytes_at_rest(self, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
        return bytes_at_rest(self.run, rank, request_locs)

    def decoder(self, device: torch.device) -> V4Decoder:
        return V4Decoder(self.run, device)

    def next_inputs(self, device: torch.device) -> list[torch.Tensor]:
        return next_token_inputs(self.run, device)

    def store_mismatches(self, decoded: list[list[V4LayerCache]], ranks_stored: list[Any]) -> list[str]:
        return store_mismatches(decoded, ranks_stored, self.cfg.window_size)

    def oracle_mismatches(self, decoded: list[list[V4LayerCache]], oracle: V4OracleResult) -> list[str]:
        return oracle_mismatches(decoded, oracle, self.cfg.window_size)

    def next_token_error(
        self,
        model: torch.nn.Module,
        oracle: V4OracleResult,
        inputs: Sequence[torch.Tensor],
        got: Sequence[torch.Tensor],
    ) -> float:
        assert isinstance(model, V4Model)
        return next_token_error(model, oracle, [r.total for r in self.run.requests], inputs, got)
