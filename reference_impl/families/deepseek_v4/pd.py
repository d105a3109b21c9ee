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

**The decode** (:class:`V4Decoder`, a :class:`~reference_impl.pd.arena.BookedArena`) allocates, per
request and layer, one region per part in one ``uint8`` arena (the Mooncake transport registers it and
publishes the regions), places each block's rows at ``position - first position`` and books every
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
from collections.abc import Sequence
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig
from reference_impl.cp.ownership import Ownership
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.cp.store import V4Store, entry_owners, pack_pool, pool_width
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache, v4_layer_forward
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.families.deepseek_v4.model.oracle import V4Block, V4Model, V4OracleResult
from reference_impl.pd.arena import BookedArena
from reference_impl.pd.payload import (
    PartPayload,
    PartStreamer,
    arena_shapes,
    part_block,
    replica_sender,
)
from reference_impl.pd.transport import BlockTransport, RowBlock

ENTRIES, WINDOW, STATE = 1, 2, 3
PART_NAMES = {ENTRIES: "entries", WINDOW: "window tail", STATE: "compressor state"}
F32 = 4  # bytes of a float32 pre-pool value


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


class V4Parts:
    """DeepSeek-V4's parts for one run (a :class:`~reference_impl.pd.payload.PartLayout`): CSA entries
    sharded by their compute owner, every other part replicated."""

    part_names = PART_NAMES

    def __init__(self, run: RunConfig) -> None:
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        self.cfg, self.codec, self.n_layers = cfg, run.kv_dtype, cfg.n_layers

    def parts(self, layer: int) -> tuple[int, ...]:
        return parts_of(self.cfg, layer)

    def row_bytes(self, layer: int, part: int) -> int:
        return row_bytes(self.cfg, self.codec, layer, part)

    def first_and_count(self, layer: int, part: int, n_tokens: int) -> tuple[int, int]:
        return first_and_count(self.cfg, layer, part, n_tokens)

    def rows_stored(self, own: Ownership, rank: int, locs: torch.Tensor, layer: int, part: int) -> int | None:
        if part != ENTRIES or self.cfg.ratio(layer) != 4:
            return None
        return entry_owners(own, locs, range(len(locs) // 4)).count(rank)

    def ships_replicas(self, own: Ownership, locs: torch.Tensor, rank: int) -> bool:
        return replica_sender(own, locs) == rank


# ---- the prefill side ------------------------------------------------------------------------


class V4LayerStreamer(PartStreamer):
    """A prefill rank's layer-wise send of its V4 cache: one block per part for each request the chunk
    finishes (the module docstring's table), after each layer is stored."""

    def __init__(self, run: RunConfig, transport: BlockTransport, decode_rank: int) -> None:
        super().__init__(transport, decode_rank, V4Parts(run))
        self.store: V4Store | None = None
        self.replicas: dict[int, bool] = {}  # finished request -> whether this rank ships its replicated parts

    def begin_chunk(self, store: Any, finished: dict[int, torch.Tensor]) -> None:
        if not isinstance(store, V4Store) or not store.sharded:
            raise ConfigError("a layer-wise V4 PD send needs the V4 store with CSA entries sharded (phase 2)")
        self.store = store
        self.start_chunk(store.group.device, finished)
        assert store.ownership is not None
        self.replicas = {
            req: self.plan_request(store.ownership, store.group.rank, req, locs) for req, locs in finished.items()
        }

    def block(self, layer: int, request: int, part: int) -> RowBlock:
        store, replica = self.store, self.replicas[request]
        assert store is not None
        cfg, st = store.cfg, store.state(layer, request)
        n = st.n_tokens
        width = self.layout.row_bytes(layer, part)
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
        return part_block(request, layer, part, positions, rows)


# ---- the decode side -------------------------------------------------------------------------


class V4Decoder(BookedArena):
    """The decode's V4 cache of every request (see the module docstring): one arena, a region per
    (request, layer, part), exactly-once bookkeeping of every row."""

    def __init__(self, run: RunConfig, device: torch.device | str = "cpu") -> None:
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        self.run, self.cfg, self.codec = run, cfg, run.kv_dtype
        self.totals = [r.total for r in run.requests]
        super().__init__(arena_shapes(V4Parts(run), self.totals), PART_NAMES, device)

    def caches(self) -> list[list[V4LayerCache]]:
        """``[layer][request]``: the caches assembled from the arena (views of it)."""
        cfg, codec = self.cfg, self.codec
        b = main_entry_bytes(codec)
        out: list[list[V4LayerCache]] = []
        for layer in range(cfg.n_layers):
            m = cfg.ratio(layer)
            row: list[V4LayerCache] = []
            for req, n in enumerate(self.totals):
                cache = V4LayerCache.empty(codec, m, cfg.head_dim, cfg.index_head_dim, self.buffer.device)
                cache.n_tokens = n
                window = self.view(req, layer, WINDOW)
                cache.raw, cache.raw_start = window, n - window.shape[0]
                if m:
                    entries = self.view(req, layer, ENTRIES)
                    cache.entries = entries[:, :b]
                    if m == 4:
                        cache.index_keys = entries[:, b:]
                    values = self.typed(req, layer, STATE, torch.float32)
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


# ---- the family's payload ------------------------------------------------------------------------


class V4PDPayload(PartPayload):
    """DeepSeek-V4 behind :class:`~reference_impl.families.base.PDPayload` for one run."""

    def __init__(self, run: RunConfig) -> None:
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        super().__init__(run, V4Parts(run))
        self.cfg = cfg

    def sender(self, transport: BlockTransport, decode_rank: int) -> V4LayerStreamer:
        return V4LayerStreamer(self.run, transport, decode_rank)

    def decoder(self, device: torch.device) -> V4Decoder:
        return V4Decoder(self.run, device)

    def store_mismatches(self, decoded: list[list[V4LayerCache]], ranks_stored: list[Any]) -> list[str]:
        return store_mismatches(decoded, ranks_stored, self.cfg.window_size)

    def oracle_mismatches(self, decoded: list[list[V4LayerCache]], oracle: V4OracleResult) -> list[str]:
        return oracle_mismatches(decoded, oracle, self.cfg.window_size)

    def step(
        self, model: torch.nn.Module, caches: list[list[V4LayerCache]], inputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        assert isinstance(model, V4Model)
        return next_token(model, caches, [r.total for r in self.run.requests], inputs)
