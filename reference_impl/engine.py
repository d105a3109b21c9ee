"""One rank's CP prefill: a batch through N layers under a phase set, with byte accounting.

SPMD: every rank runs :func:`run_rank` with the same :class:`RunConfig`; they differ only in
``group.rank``. The engine is the same for every model family (:mod:`reference_impl.families`): it
owns the chunk schedule, the page table and each chunk's split and locs, the layer loop with its
clock and host-sync audit, and the tail; the run's family supplies the caches
(:meth:`~reference_impl.families.base.ModelFamily.make_store`), the cached prefixes, and the layer
step (:meth:`~reference_impl.families.base.ModelFamily.chunk_step`). The DSA family's step is the
baseline's per-layer work (:mod:`reference_impl.families.dsa.layer_step`): project the rank's tokens,
**all-gather #1** of the current chunk's latent KV and indexer K, store, build the full view, select
and attend.

After the last layer, **all-gather #2** (the tail, :mod:`reference_impl.cp.tail`) brings the
output rows back; phase 1 narrows it (:mod:`reference_impl.cp.narrow_output`).

Where the phases plug in: the store the family builds (phase 2 sharding, phase 3 current reuse,
phase 5 direct writes, phase 7 fused ops), the split (:func:`chunk_metadata`, phase 4), the layer
loop of :func:`_run_chunk` (phase 6's host-sync audit; the step's host key ranges, phase 7's fused
rerange and phase 8's prefetch), and the chunk schedule (:mod:`reference_impl.schedule`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from reference_impl.config import RunConfig
from reference_impl.cp.batch import BatchLocs, new_page_table
from reference_impl.cp.comm import CPGroup, note_step
from reference_impl.cp.designs import audits_layer_loop, design_page_lanes
from reference_impl.cp.narrow_output import collect_narrow
from reference_impl.cp.split import SplitMetadata, build_split
from reference_impl.cp.split_index import SplitIndex
from reference_impl.cp.tail import OutputSpec, collect_full
from reference_impl.families import ChunkInputs, ModelFamily, RankStore, family_of
from reference_impl.kernels import fallback
from reference_impl.kvcache.allocator import PageAllocator, PrefixCache, RequestPageTable, page_locs
from reference_impl.schedule import Chunk, chunk_schedule, frees_after_batch
from reference_impl.sync_audit import HostSyncAudit
from reference_impl.workload import build_inputs, build_model

logger = logging.getLogger(__name__)


def per_layer_tags(run: RunConfig) -> tuple[str, ...]:
    """The collectives' tags that count as per-layer gather traffic in this run's family."""
    return family_of(run.model).per_layer_tags


def build_metadata(run: RunConfig) -> SplitMetadata:
    """The split of the run's whole batch as one chunk (the token numbering reports and checks use)."""
    extend = tuple(r.extend for r in run.requests)
    whole = Chunk(tuple(range(len(extend))), tuple(r.prefix for r in run.requests), extend, tuple(range(sum(extend))))
    return chunk_metadata(run, whole)


def output_spec(run: RunConfig) -> OutputSpec:
    return OutputSpec(input_logprobs=run.input_logprobs, return_hidden_states=run.return_hidden_states)


@dataclass
class RankResult:
    """What one rank reports back (CPU tensors)."""

    rank: int
    stats: dict[str, int]
    timings: dict[str, Any]
    tail_mode: str
    store_path: str  # "replicated", "gathered" (phase 2: owned share of the gathered chunk) or "direct" (phase 5)
    row_ids: tuple[int, ...]  # run-global token ids of ``rows`` (every chunk's output rows)
    rows: torch.Tensor  # [n_rows, dim] hidden states of the output rows
    logits: torch.Tensor  # [n_rows, vocab] float32
    collectives: list[str]  # "op:tag:shape:dtype" in issue order
    token_ids: tuple[int, ...] = ()  # run-global ids of this rank's tokens, all chunks, in local order
    local_hidden: torch.Tensor | None = None  # [n_local, dim] rows of token_ids (check runs only)
    local_topk: list[torch.Tensor] = field(default_factory=list)  # per layer [n_local, K], request positions
    stored: list[dict[int, tuple[torch.Tensor | None, ...]]] = field(default_factory=list)  # per layer (check runs)
    store: Any = None  # the rank's store (its family's), only with ``run_rank(..., keep_store=True)`` (PD transfer)
    host_sync_audit: str = ""  # how phase 6 counted the layer loop's host syncs ("" without phase 6)
    kernel_fallbacks: dict[str, str] = field(default_factory=dict)  # kernel -> first error, in this rank's process
    pool_occupancy: list[dict[str, int]] = field(default_factory=list)  # per batch: pages in use, requests freed
    prefix_cache: dict[str, int] | None = None  # a budgeted pool's hits, evictions, recomputed tokens (RunPool.counts)


LAYER_LOOP_RANGE = "dsacp.layer_loop"  # a profiler range around each chunk's layer loop (scripts/profile_layer.py)


class LayerStoredHook(Protocol):
    """Called by the layer loop when a layer's KV is in the store (the PD transfer streams from it).

    ``begin_chunk`` runs before a chunk's layer loop (outside the phase-6 audit): ``finished``
    maps each request whose last tokens this chunk computes to its logical locs, so plans are made
    there. ``layer_stored(layer)`` runs inside the loop right after ``store_current``: from then
    on the finished requests' rows of that layer are final. ``loop_done()`` runs right after the
    loop, before anything waits for the device (a CUDA event recorded there marks the loop's end).
    """

    def begin_chunk(self, store: Any, finished: dict[int, torch.Tensor]) -> None: ...

    def layer_stored(self, layer: int) -> None: ...

    def loop_done(self) -> None: ...


def make_kv_store(run: RunConfig, batch: BatchLocs, group: CPGroup) -> RankStore:
    """The rank's store for ``run``, serving ``batch``: its family's
    (:meth:`~reference_impl.families.base.ModelFamily.make_store`)."""
    return family_of(run.model).make_store(run, batch, group)


def install_prefixes(
    run: RunConfig,
    model: Any,
    inputs: list[torch.Tensor],
    store: Any,
    chunk: Chunk | None = None,
    shared_tokens: dict[int, int] | None = None,
    family: ModelFamily | None = None,
) -> None:
    """Fill the store with the cached prefixes of ``chunk``'s requests (default: the run's first chunk),
    as an earlier prefill left them (:meth:`~reference_impl.families.base.ModelFamily.install_prefixes`).
    ``shared_tokens[req]``: leading tokens already in the pool by reference (a shared prefix's whole
    pages); only the rest is written."""
    family = family or family_of(run.model)
    chunk = chunk if chunk is not None else chunk_schedule(run)[0]
    with torch.no_grad():
        family.install_prefixes(run, model, inputs, store, chunk, shared_tokens or {})


class _LayerClock:
    """Per-layer wall time: CUDA events on the current stream (no sync in the loop) or perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


@dataclass
class _Accumulated:
    """Per-rank outputs gathered over the chunks of a run (run-global token ids)."""

    token_ids: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    topk: list[list[torch.Tensor]] = field(default_factory=list)  # [chunk][layer]
    row_ids: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    layer_ms: list[float] = field(default_factory=list)
    prefetch_wait_ms: list[float] = field(default_factory=list)  # phase 8 on CUDA: stall at each consume
    tail_ms: float = 0.0
    tail_collective_ms: float = 0.0
    transient_peak: int = 0
    tail_mode: str = ""
    store_paths: set[str] = field(default_factory=set)
    host_syncs: int = 0
    transport_syncs: int = 0
    sync_audit: str = ""
    pool_occupancy: list[dict[str, int]] = field(default_factory=list)  # per batch


class HostSyncError(AssertionError):
    """The phase-6 layer loop synchronized with the host (debug-mode audit)."""


def chunk_metadata(run: RunConfig, chunk: Chunk) -> SplitMetadata:
    """The split of one chunk (identical on every rank); page-aligned with phase 4."""
    return build_split(
        run.split_mode,
        run.cp_size,
        chunk.extend_lens,
        chunk.prefix_lens,
        run.page_size,
        page_aligned=run.phases.page_aligned,
    )


def shares_of(run: RunConfig) -> dict[int, int]:
    """Request -> the earlier request whose prefix it starts with (``rN:P+E``)."""
    return {i: r.shares for i, r in enumerate(run.requests) if r.shares is not None}


def requests_to_free(run: RunConfig, chunk: Chunk) -> list[int]:
    """After a batch's last chunk (all but the run's last batch, whose requests stay for the report
    and the PD transfer): the requests nothing later uses
    (:func:`~reference_impl.schedule.frees_after_batch`)."""
    if not chunk.last_of_batch or chunk.batch == len(run.batches) - 1:
        return []
    return frees_after_batch(run).get(chunk.batch, [])


def new_run_page_table(run: RunConfig) -> RequestPageTable:
    """The run's empty page table, with lane slack where an allocator hands out pages by lanes (phase 5, a design's);
    with a pool budget (``run.pool_pages``), exactly that many pages."""
    if run.pool_pages is not None:
        return RequestPageTable(PageAllocator(run.pool_pages, run.page_size))
    lanes = run.phases.compute_owner or design_page_lanes(run) is not None
    return new_page_table([r.total for r in run.requests], run.page_size, run.cp_size, lanes)


class RunPool:
    """The run's page table across its batches, the same on every rank (pure metadata).

    Without a budget, a finished request's pages go back once nothing later shares them
    (:func:`requests_to_free`). With ``run.pool_pages``, every finished request stays cached
    (:class:`~reference_impl.kvcache.allocator.PrefixCache`): a later ``rN:P+E`` hits request ``N``'s whole
    prefix pages while they are there, and the allocator evicts the least recently used cached request when
    a batch needs more pages than are free; a request whose source was evicted writes its whole prefix again.
    """

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.table = new_run_page_table(run)
        self.cache = PrefixCache(self.table) if run.pool_pages is not None else None
        self.shares = shares_of(run)
        self.hits = self.hit_tokens = self.misses = self.recomputed_tokens = 0

    def build(
        self, chunk: Chunk, meta: SplitMetadata, device: Any, id_space: int | None, first_of_batch: bool
    ) -> BatchLocs:
        """Allocate ``chunk``'s locs; at a batch's first chunk its hits' sources become most recently used
        first, and the hits and misses are counted after."""
        hitting = [req for req in chunk.requests if req in self.shares] if first_of_batch else []
        if self.cache is not None:
            for req in hitting:
                self.cache.touch(self.shares[req])
        batch = BatchLocs.build(
            meta,
            device,
            self.run.phases.compute_owner,
            table=self.table,
            request_ids=chunk.requests,
            id_space=id_space,
            shares=self.shares,
            page_lanes=design_page_lanes(self.run),
        )
        for req in hitting:
            whole = self.run.requests[req].prefix // self.run.page_size * self.run.page_size
            if not whole:
                continue  # less than a page: nothing is ever shared
            shared = self.table.shared_tokens(req)
            if shared:
                self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + shared
            else:
                self.misses, self.recomputed_tokens = self.misses + 1, self.recomputed_tokens + whole
        return batch

    def leaving(self, chunk: Chunk) -> list[int]:
        """After a batch's last chunk (not the run's last batch): the requests that leave the live set, freed
        (:func:`requests_to_free`) or, with a budget, cached (every request of the batch)."""
        if self.cache is None:
            return requests_to_free(self.run, chunk)
        if not chunk.last_of_batch or chunk.batch == len(self.run.batches) - 1:
            return []
        first = sum(self.run.batches[: chunk.batch])
        return list(range(first, first + self.run.batches[chunk.batch]))

    def release(self, requests: list[int]) -> None:
        """Free ``requests`` (:meth:`leaving`'s), or with a budget keep them cached."""
        for req in requests:
            if self.cache is not None:
                self.cache.hold(req)
            else:
                self.table.free(req)

    @property
    def counts(self) -> dict[str, int] | None:
        """A budgeted pool's prefix-cache counts for the report (None without a budget)."""
        if self.cache is None:
            return None
        return {
            "pool_pages": self.table.allocator.n_pages,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "misses": self.misses,
            "recomputed_tokens": self.recomputed_tokens,
            "evicted_requests": self.cache.evicted_requests,
            "evicted_pages": self.cache.evicted_pages,
        }


def replay_page_table(run: RunConfig, last_pages: dict[int, list[int]] | None = None) -> RequestPageTable:
    """The logical page table a run ends with, rebuilt without running it (pure metadata): every
    allocation, share and free between batches, in order.

    Every rank allocates identically, so a process outside the CP group (the decode side of a PD
    transfer) derives the same logical locs from the config alone. ``last_pages``, when given, is
    filled with every request's pages as they were when it finished: before its free, for a request
    an earlier batch let go (:func:`request_locs`).
    """
    return replay_pool(run, last_pages).table


def replay_pool(run: RunConfig, last_pages: dict[int, list[int]] | None = None) -> RunPool:
    """:func:`replay_page_table`'s pool, with its prefix-cache counts."""
    pool = RunPool(run)
    table = pool.table
    chunks = chunk_schedule(run)
    for index, chunk in enumerate(chunks):
        first_of_batch = index == 0 or chunks[index - 1].batch != chunk.batch
        pool.build(chunk, chunk_metadata(run, chunk), "cpu", table.allocator.n_pages, first_of_batch)
        leaving = pool.leaving(chunk)
        if last_pages is not None:
            last_pages.update({req: table.pages(req) for req in leaving})
        pool.release(leaving)
    if last_pages is not None:
        last_pages.update({req: table.pages(req) for req in table.requests})
    return pool


def request_locs(run: RunConfig) -> dict[int, torch.Tensor]:
    """Every request's logical locs as they were when it finished (freed requests included), from
    the config alone: what a PD transfer of a run of several batches sent for it."""
    pages: dict[int, list[int]] = {}
    replay_page_table(run, pages)
    return {req: page_locs(p, run.requests[req].total, run.page_size) for req, p in sorted(pages.items())}


def run_id_space(table: RequestPageTable) -> int:
    """Logical page ids a run's pools must cover: the highest page id it ever used + 1 (lane holes
    below it remain; ids freed between batches are reused)."""
    return table.allocator.high_water


@torch.no_grad()
def run_rank(
    group: CPGroup,
    run: RunConfig,
    *,
    keep_store: bool = False,
    on_layer_stored: LayerStoredHook | None = None,
    family: ModelFamily | None = None,
    prebuilt: tuple[Any, list[torch.Tensor]] | None = None,
) -> RankResult:
    """Run the batch on this rank, chunk by chunk; see the module docstring for the per-layer steps.

    ``keep_store=True`` leaves the rank's store on ``result.store`` (device tensors, not for
    pickling), for what runs after the prefill in the same process: the PD transfer.
    ``on_layer_stored`` hears of every layer stored (:class:`LayerStoredHook`: a layer-wise PD send).
    ``family``: the model family to run with (default: the run's, :func:`~reference_impl.families.family_of`);
    a benchmark passes one configured otherwise (e.g. DeepSeek-V4 with synthetic prefixes).
    ``prebuilt``: the ``(model, inputs)`` that :func:`~reference_impl.workload.build_model` and
    :func:`~reference_impl.workload.build_inputs` make of ``run`` on this device, built once by a benchmark
    that runs the same model and requests many times (at several phase levels, which change neither).
    """
    device = group.device
    family = family or family_of(run.model)
    model, inputs = prebuilt if prebuilt is not None else (build_model(run, device), build_inputs(run, device))
    note_step()  # progress: the model and the inputs are built
    chunks = chunk_schedule(run)
    id_space = run_id_space(replay_page_table(run))  # pure metadata: same on every rank
    pool = RunPool(run)
    table = pool.table
    store: Any = None
    acc = _Accumulated()
    stored: dict[int, list[tuple[torch.Tensor | None, ...]]] = {}  # request -> per layer, its rows (check runs)
    start = time.perf_counter()
    for index, chunk in enumerate(chunks):
        meta = chunk_metadata(run, chunk)
        first_of_batch = index == 0 or chunks[index - 1].batch != chunk.batch
        batch = pool.build(chunk, meta, device, id_space, first_of_batch)
        # Tokens a new request found in the pool by reference (the whole pages of a shared prefix).
        shared_tokens = {req: table.shared_tokens(req) for req in chunk.requests} if first_of_batch else {}
        if store is None:
            store = family.make_store(run, batch, group)
            install_prefixes(run, model, inputs, store, chunk, shared_tokens, family)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base_allocated = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
        else:
            store.bind(batch)
            if first_of_batch:  # a later batch of a long-lived pool: its requests' prefixes
                install_prefixes(run, model, inputs, store, chunk, shared_tokens, family)
        if on_layer_stored is not None:
            finished = {
                req: table.locs(req).to(device)
                for i, req in enumerate(chunk.requests)
                if chunk.prefix_lens[i] + chunk.extend_lens[i] == run.requests[req].total
            }
            on_layer_stored.begin_chunk(store, finished)
        _run_chunk(group, run, family, model, inputs, chunk, meta, batch, store, acc, on_layer_stored)
        if chunk.last_of_batch:
            in_use = table.allocator.n_used
            leaving = pool.leaving(chunk)
            for req in leaving:
                if run.check:  # its rows, before another request reuses (or an eviction frees) its pages
                    stored[req] = _stored_rows(store, table.locs(req).to(device), run.model.n_layers)
            pool.release(leaving)
            acc.pool_occupancy.append(
                {
                    "batch": chunk.batch,
                    "pages_in_use": in_use,
                    "requests_freed": 0 if pool.cache else len(leaving),
                    "pages_in_use_after_frees": table.allocator.n_used,
                    "pool_pages": id_space,
                }
                | ({"requests_cached": len(pool.cache.cached)} if pool.cache else {})
            )
    assert store is not None
    total_ms = (time.perf_counter() - start) * 1e3
    if group.debug:
        group.check_consistent()

    stats = {
        "kv_bytes": store.kv_bytes,
        "index_bytes": store.index_bytes,
        "transient_peak_bytes": acc.transient_peak,
        "gather_bytes": sum(s.buffer_bytes for s in group.stats if s.tag in family.per_layer_tags),
        "materialized_bytes": store.materialized_bytes,
        "output_gather_bytes": sum(s.buffer_bytes for s in group.stats if s.tag == "tail"),
        "collectives": len(group.stats),
    }
    stats.update(store.breakdown())  # what the family counts beyond KV and index bytes
    if audits_layer_loop(run):
        stats["host_syncs_in_layer_loop"] = acc.host_syncs
        stats["transport_syncs_in_layer_loop"] = acc.transport_syncs
    if device.type == "cuda":
        stats["measured_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base_allocated
    n_layers = run.model.n_layers
    if run.check:
        for req in table.requests:
            stored[req] = _stored_rows(store, table.locs(req).to(device), n_layers)
    return RankResult(
        rank=group.rank,
        stats=stats,
        timings={
            "total_ms": total_ms,
            "layer_ms": acc.layer_ms,
            "tail_ms": acc.tail_ms,
            "tail_collective_ms": acc.tail_collective_ms,
            "chunks": len(chunks),
            "prefetch_wait_ms": acc.prefetch_wait_ms,
        },
        tail_mode=acc.tail_mode,
        store_path="+".join(sorted(acc.store_paths)),
        row_ids=tuple(acc.row_ids),
        rows=torch.cat(acc.rows),
        logits=torch.cat(acc.logits),
        collectives=[f"{s.op}:{s.tag}:{tuple(s.shape)}:{s.dtype}" for s in group.stats],
        token_ids=tuple(acc.token_ids),
        local_hidden=torch.cat(acc.hidden) if run.check else None,
        local_topk=[torch.cat([c[layer] for c in acc.topk]) for layer in range(n_layers)] if run.check else [],
        stored=[{req: stored[req][layer] for req in sorted(stored)} for layer in range(n_layers)] if run.check else [],
        pool_occupancy=acc.pool_occupancy,
        prefix_cache=pool.counts,
        store=store if keep_store else None,
        host_sync_audit=acc.sync_audit,
        kernel_fallbacks=fallback.fallbacks_taken(),
    )


def _stored_rows(store: RankStore, locs: torch.Tensor, n_layers: int) -> list[tuple[torch.Tensor | None, ...]]:
    """Per layer: what this rank stores of the request at ``locs`` (CPU copies: a snapshot, whatever the store
    later does with that memory)."""
    return [
        tuple(None if t is None else t.to("cpu", copy=True) for t in store.stored_rows(layer, [locs])[0])
        for layer in range(n_layers)
    ]


def local_inputs(
    inputs: list[torch.Tensor], chunk: Chunk, meta: SplitMetadata, rank: int, positions: torch.Tensor
) -> torch.Tensor:
    """``[T_local, dim]``: the input rows of ``rank``'s tokens of ``chunk``, in local order.

    Read straight from each request's inputs (``positions`` are the tokens' absolute positions in
    their request), so the rank never holds the whole chunk's ``[T_chunk, dim]`` hidden states.
    """
    rows_of: dict[int, list[int]] = {}  # chunk request index -> local rows holding its tokens
    for row, g in enumerate(meta.local_tokens(rank)):
        rows_of.setdefault(meta.token_request[g], []).append(row)
    if len(rows_of) == 1:
        (only,) = rows_of
        return inputs[chunk.requests[only]].index_select(0, positions)
    first = inputs[chunk.requests[0]]
    x = torch.empty(len(positions), first.shape[1], dtype=first.dtype, device=first.device)
    for i, rows in rows_of.items():
        index = torch.tensor(rows, dtype=torch.long, device=x.device)
        x[index] = inputs[chunk.requests[i]].index_select(0, positions[index])
    return x


def _run_chunk(
    group: CPGroup,
    run: RunConfig,
    family: ModelFamily,
    model: Any,
    inputs: list[torch.Tensor],
    chunk: Chunk,
    meta: SplitMetadata,
    batch: BatchLocs,
    store: Any,
    acc: _Accumulated,
    on_layer_stored: LayerStoredHook | None = None,
) -> None:
    """One CP batch through every layer (the family's step per layer), then its tail collection; appends to ``acc``."""
    device = group.device
    index = SplitIndex.build(meta, group.rank, device)  # device tensors the layer loop reuses
    positions = torch.tensor(meta.local_positions(group.rank), dtype=torch.long, device=device)
    x = local_inputs(inputs, chunk, meta, group.rank, positions)  # [T_local, dim]
    step = family.chunk_step(
        ChunkInputs(group, run, model, store, chunk, meta, batch, index, positions, on_layer_stored)
    )
    clock = _LayerClock(device)
    topk_per_layer: list[torch.Tensor] = []
    audit = (
        HostSyncAudit(api=group.debug or device.type != "cuda", cuda=device.type == "cuda")
        if audits_layer_loop(run)
        else contextlib.nullcontext()
    )
    with audit, torch.profiler.record_function(LAYER_LOOP_RANGE):
        clock.mark()
        step.begin()
        for layer, block in enumerate(model.layers):
            x, topk = step.step(layer, block, x)
            acc.transient_peak = max(acc.transient_peak, step.transient_bytes)
            if run.check:
                topk_per_layer.append(topk)  # stays on device
            clock.mark()
            note_step()  # progress: a host counter in shared memory, no sync
            del topk
        step.end()
    if isinstance(audit, HostSyncAudit):
        acc.host_syncs += audit.count
        acc.transport_syncs += audit.transport
        acc.sync_audit = audit.method
        if audit.count and group.debug:
            raise HostSyncError(f"{audit.count} host sync(s) in the phase-6 layer loop: {'; '.join(audit.sites)}")
    if on_layer_stored is not None:
        on_layer_stored.loop_done()
    acc.layer_ms.extend(clock.intervals_ms())
    acc.prefetch_wait_ms.extend(step.prefetch_wait_ms())

    tail_start = time.perf_counter()
    tail_clock = _LayerClock(device)  # the collective itself: CUDA events around it on the stream
    tail_clock.mark()
    collect = collect_narrow if run.phases.narrow_output else collect_full
    tail = collect(group, meta, x, output_spec(run))
    tail_clock.mark()
    if device.type == "cuda":
        torch.cuda.synchronize()
    acc.tail_ms += (time.perf_counter() - tail_start) * 1e3  # wall time to the sync: queued layer work too
    acc.tail_collective_ms += tail_clock.intervals_ms()[0]
    acc.tail_mode = tail.mode
    acc.store_paths.add(store.store_path)
    acc.row_ids.extend(chunk.token_ids[g] for g in tail.row_ids)
    acc.rows.append(tail.rows.float().cpu())
    acc.logits.append(model.logits(tail.rows).cpu())
    acc.token_ids.extend(chunk.token_ids[g] for g in meta.local_tokens(group.rank))
    if run.check:
        acc.hidden.append(x.float().cpu())
        acc.topk.append([t.cpu() for t in topk_per_layer])
