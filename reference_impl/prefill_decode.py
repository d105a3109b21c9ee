"""Prefill on a CP group, then hand the KV cache to a decode process: the PD driver.

``C + 1`` processes over gloo: ranks ``0 .. C-1`` prefill as one CP group (a subgroup) with KV
sharded at rest (phase 2), and rank ``C`` decodes. Two transfers:

* ``transfer="rows"`` (serving-shaped): each prefill rank sends, per layer and request, the rows
  it stores with their request positions (:mod:`reference_impl.pd.transport`), **layer by layer**:
  as soon as layer ``l`` is stored, a non-blocking send per finished request leaves while layer
  ``l + 1`` computes (an engine :class:`~reference_impl.engine.LayerStoredHook`, planned before the
  loop, so phase 6's audit still counts no host sync; :mod:`reference_impl.pd.stream`); after the
  prefill, one completion wait per request. The decode allocates its own pages per request from
  its own allocator (:class:`~reference_impl.pd.dcp.DcpDecodeShard`, one rank) and never sees a prefill page id.
  Bytes sent equal the rows each rank holds at rest: no empty slot of a partial page travels.
  The transport (``transport=``) is ``"torch"``, gloo point-to-point: on CUDA (``run.device ==
  "cuda"``, processes sharing the GPUs) the rows are read and copied to pinned host memory on a
  side stream (:mod:`reference_impl.pd.staging`) and a sender thread puts them on the wire when
  they are there; or ``"mooncake"``, the Mooncake Transfer Engine (:mod:`reference_impl.pd.mooncake`):
  the decode registers its pool and publishes each request's slots over a torch.distributed
  broadcast, each prefill rank writes its rows into them with one-sided writes, and the decode
  waits for one completion notice per (request, prefill rank).
* ``transfer="pages"``: each prefill rank sends its owned pages with their logical ids
  (:mod:`reference_impl.pd.manifest`), and the decode mirrors the prefill's page-id space by
  replaying its allocator (page interleave only).

With ``run.check`` the decode cache is compared byte for byte with the rows the prefill ranks hold
at rest and, on CPU, with the single-device oracle (a GPU's GEMMs do not reproduce the CPU's bits;
the GPU tier checks the prefill itself against the oracle).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.check import EXACT_TOLERANCE
from reference_impl.config import ConfigError, RunConfig, check_environment
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.engine import RankResult, build_metadata, replay_page_table, request_locs, run_id_space, run_rank
from reference_impl.families import family_of
from reference_impl.families.base import PDPayload
from reference_impl.footprint import check_fits, decode_bytes
from reference_impl.kvcache.layout import KVLayout
from reference_impl.launch import launch, plan_launch, rank_cpu_threads
from reference_impl.model.oracle import OracleResult, run_oracle
from reference_impl.pd.dcp import DcpDecodeShard, DcpLayout
from reference_impl.pd.manifest import TransferManifest, build_manifest
from reference_impl.pd.mooncake import MooncakeReceiver, MooncakeTransport
from reference_impl.pd.mooncake_engine import MooncakeEngine, mooncake_unavailable
from reference_impl.pd.stream import LayerStreamer
from reference_impl.pd.transfer import DecodeCache, RequestRows, receive_pages, send_owned_pages
from reference_impl.pd.transport import TorchDistributedTransport
from reference_impl.workload import build_inputs, build_model

logger = logging.getLogger(__name__)

TRANSPORTS = ("torch", "mooncake")  # the ``transport`` knob's values (``--transport``, ``DSACP_TRANSPORT``)
# The decode's next token against the oracle's step over the oracle's caches (a family payload): the
# same layer call over byte-equal caches, on a CPU with the ranks' thread count, so they agree to the
# last bit; the bound is check.py's exact-arithmetic tolerance, relative to the largest value. GLM-5.3's
# caches are the oracle's within its check's bounds (a CP run composes KDA states in another order), so its
# step differs by that difference carried through the layers: 3e-7 to 6e-5 on tiny-glm53, inside the bound.
NEXT_TOKEN_BOUND = EXACT_TOLERANCE


@dataclass(frozen=True)
class RankTransfer:
    """What one prefill rank sent (``transfer="rows"``)."""

    rank: int
    bytes_sent: int  # cache bytes of the row blocks (MLA, index, scale), every layer
    bytes_at_rest: int  # the same layout's bytes of the tokens this rank stores, counted from its ownership
    rows_sent: int
    blocks_sent: int  # one per (layer, request), empty ones included
    blocks_sent_in_layer_loop: int  # sent while later layers computed
    wait_ms_after_prefill: tuple[float, ...]  # per request: its one completion wait, after the prefill
    staging_ms: float | None = None  # CUDA: side-stream time of every block (pool read + copy to pinned host)
    staging_hidden_fraction: float | None = None  # CUDA: the part of it before the layer loop's end
    staging_exposed_ms: float | None = None  # CUDA: how long the last block landed after the loop's end
    transport: str = "torch"
    protocol: str = "gloo"  # what carried the bytes: gloo, or the protocol Mooncake installed (tcp, rdma)


@dataclass
class PDResult:
    """A prefill + decode run: the prefill ranks' results, what they sent, the decode cache's rows."""

    manifests: tuple[TransferManifest, ...]  # per prefill rank (``transfer="pages"``; empty for rows)
    prefill: tuple[RankResult, ...]  # per prefill rank (``store`` dropped)
    rows: list[dict[int, RequestRows]] | Any  # [layer][request]: the decode pool's rows, in position order
    # (a family with its own payload, ModelFamily.pd_payload: its decode caches, [layer][request])
    bytes_received: int  # payload bytes the decode rank received
    problems: list[str]  # differences from the prefill's rows at rest or the oracle's cache (unchecked: empty)
    transfer: str = "pages"
    sent: tuple[RankTransfer, ...] = ()  # per prefill rank (``transfer="rows"``)
    decode_pages: tuple[tuple[int, ...], ...] = ()  # per request: the decode's own page ids (``transfer="rows"``)
    oracle_checked: bool = True  # False on CUDA: the rows at rest are the reference there
    transport: str = "torch"
    protocol: str = "gloo"  # the decode side's: gloo, or the protocol Mooncake installed (tcp, rdma)
    next_token: tuple[torch.Tensor, ...] = ()  # per request: the decode's next-token hidden state (family payload)
    next_token_error: float | None = None  # its difference from the oracle's step (CPU check runs)

    @property
    def matches_oracle(self) -> bool:
        """No difference found (from the oracle on CPU; on CUDA from the prefill's rows at rest)."""
        return not self.problems


@dataclass
class _RoleResult:
    """What one process of the PD world returns: a prefill rank's manifest and result, or the decode's rows."""

    manifests: list[TransferManifest]  # prefill: its own manifest; decode: the manifests it received, in rank order
    prefill: RankResult | None = None
    rows: list[Any] = field(default_factory=list)  # [layer]: request -> rows (DSA), or a payload's caches
    bytes_received: int = 0
    sent: RankTransfer | None = None
    decode_pages: tuple[tuple[int, ...], ...] = ()
    protocol: str = "gloo"
    next_token: tuple[torch.Tensor, ...] = ()


def _bytes_at_rest(run: RunConfig, store: ShardedKV, rank: int) -> int:
    """Cache bytes (every layer) of the tokens ``rank`` stores, counted from its ownership."""
    locs = request_locs(run)  # this rank's own page table: its locs of every request, freed ones too
    owned = sum(int((store.ownership.owner(request) == rank).sum()) for request in locs.values())
    layout = store.layout
    index_layers = len(store.pool.index_layers)  # IndexShare: the full layers only
    return owned * (layout.mla_bytes * run.model.n_layers + (layout.index_head_dim + 4) * index_layers)


def _receive_rows(run: RunConfig, device: torch.device, transport: str, deadline_s: float) -> _RoleResult:
    """The decode rank: its own pages per request, filled from every prefill rank's row blocks
    (``torch``: it receives them; ``mooncake``: the prefill ranks write them into its registered pool)."""
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    n_layers, totals = run.model.n_layers, [r.total for r in run.requests]
    shard = DcpDecodeShard(0, DcpLayout(1, 1), layout, n_layers, sum(-(-n // run.page_size) for n in totals), device)
    for req, n_tokens in enumerate(totals):
        shard.admit(req, n_tokens)
    protocol = "gloo"
    if transport == "mooncake":
        engine = MooncakeEngine.start()
        receiver = MooncakeReceiver(shard, engine, range(len(totals)))
        dist.broadcast_object_list([receiver.target], src=run.cp_size)  # where each request's rows go
        receiver.wait(range(len(totals)), range(run.cp_size), n_layers, deadline_s)
        receiver.close()
        protocol = engine.protocol
    else:
        wire = TorchDistributedTransport("cpu")
        for src in range(run.cp_size):
            for _ in range(n_layers * len(totals)):
                shard.receive(wire.recv(src))
    shard.check_complete(n_layers)
    rows = [
        {req: tuple(t.cpu() for t in shard.rows(layer, req)) for req in range(len(totals))} for layer in range(n_layers)
    ]
    pages = tuple(tuple(shard.table.pages(req)) for req in range(len(totals)))
    return _RoleResult([], rows=rows, bytes_received=shard.bytes_received, decode_pages=pages, protocol=protocol)


def _receive_payload(
    run: RunConfig, payload: PDPayload, device: torch.device, transport: str, deadline_s: float
) -> _RoleResult:
    """The decode rank of a family with its own payload (:meth:`~reference_impl.families.base.ModelFamily.pd_payload`):
    its decoder's cache filled from every prefill rank's blocks, then one more token per request."""
    decoder = payload.decoder(device)
    n_requests = len(run.requests)
    protocol = "gloo"
    if transport == "mooncake":
        engine = MooncakeEngine.start()
        receiver = decoder.mooncake_receiver(engine)
        dist.broadcast_object_list([receiver.target], src=run.cp_size)  # where each request's rows go
        receiver.wait(range(n_requests), range(run.cp_size), run.model.n_layers, deadline_s)
        receiver.close()
        protocol = engine.protocol
    else:
        wire = TorchDistributedTransport("cpu")
        for src in range(run.cp_size):
            for _ in range(decoder.blocks_per_rank):
                decoder.receive(wire.recv(src))
    decoder.check_complete()
    caches = decoder.caches()
    next_token = decoder.next_token(build_model(run, device), payload.next_inputs(device))
    cpu = [[_to_cpu(cache) for cache in per_layer] for per_layer in caches]
    return _RoleResult(
        [],
        rows=cpu,
        bytes_received=decoder.bytes_received,
        protocol=protocol,
        next_token=tuple(h.cpu() for h in next_token),
    )


def _to_cpu(cache: Any) -> Any:
    """A dataclass of tensors with its tensors on the CPU, each its own copy (what the launcher pickles
    back: a view would carry the whole arena it points into)."""
    fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
    return dataclasses.replace(cache, **{k: v.cpu().clone() for k, v in fields.items() if isinstance(v, torch.Tensor)})


def _prefill_transport(
    transport: str, cp_size: int, rank: int
) -> tuple[TorchDistributedTransport | MooncakeTransport, str]:
    """A prefill rank's end of the row transfer, and the protocol that carries it."""
    if transport == "mooncake":
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=cp_size)  # the decode's DecodeTarget
        engine = MooncakeEngine.start()
        return MooncakeTransport(engine, box[0], rank), engine.protocol
    return TorchDistributedTransport("cpu"), "gloo"  # a CUDA rank's blocks are staged to pinned host


def _pd_rank(world: CPGroup, job: tuple[RunConfig, str, str, float]) -> _RoleResult:
    """One process of the ``C + 1`` world: prefill (CP rank) when ``rank < C``, else decode."""
    run, transfer, transport_name, deadline_s = job
    cp_size = run.cp_size
    subgroup = dist.new_group(list(range(cp_size)))  # collective over the world: every rank calls it
    payload = family_of(run.model).pd_payload(run) if transfer == "rows" else None
    if world.rank < cp_size:
        cp_group = CPGroup(process_group=subgroup, device=world.device, debug=world.debug)
        if transfer == "rows":
            transport, protocol = _prefill_transport(transport_name, cp_size, cp_group.rank)
            streamer = payload.sender(transport, cp_size) if payload is not None else LayerStreamer(transport, cp_size)
            result = run_rank(cp_group, run, keep_store=True, on_layer_stored=streamer)
            waits = streamer.wait_all()
            transport.close()
            store, result.store = result.store, None
            if payload is not None:
                at_rest = payload.bytes_at_rest(cp_group.rank, request_locs(run))
            else:
                assert isinstance(store, ShardedKV)
                at_rest = _bytes_at_rest(run, store, cp_group.rank)
            o = streamer.overlap
            sent = RankTransfer(
                cp_group.rank,
                streamer.bytes_sent,
                at_rest,
                streamer.rows_sent,
                streamer.blocks_sent,
                streamer.blocks_sent,
                tuple(waits),
                staging_ms=o.staging_ms if o else None,
                staging_hidden_fraction=o.hidden_fraction if o else None,
                staging_exposed_ms=o.exposed_after_loop_ms if o else None,
                transport=transport_name,
                protocol=protocol,
            )
            return _RoleResult([], prefill=result, sent=sent)
        result = run_rank(cp_group, run, keep_store=True)
        store, result.store = result.store, None  # the store stays in this process
        assert store is not None
        manifest = build_manifest(store, cp_group.rank, cp_size)  # refuses anything but a sharded store
        send_owned_pages(manifest, store.pool, decode_rank=cp_size)
        return _RoleResult([manifest], prefill=result)
    if transfer == "rows" and payload is not None:
        return _receive_payload(run, payload, world.device, transport_name, deadline_s)
    if transfer == "rows":
        return _receive_rows(run, world.device, transport_name, deadline_s)
    table = replay_page_table(run)  # the logical locs every prefill rank allocated
    locs_of = [table.locs(req, world.device) for req in range(len(run.requests))]
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    id_space = run_id_space(table)
    cache = DecodeCache(id_space, layout, run.model.n_layers, world.device, world.debug)
    manifests = receive_pages(cache, list(range(cp_size)))
    rows = [
        {req: cache.request_rows(layer, locs) for req, locs in enumerate(locs_of)}
        for layer in range(run.model.n_layers)
    ]
    return _RoleResult(manifests, rows=rows, bytes_received=cache.bytes_received)


def oracle_mismatches(rows: list[dict[int, RequestRows]], oracle: OracleResult) -> list[str]:
    """Where decode rows differ from the oracle's cache (MLA rows, index fp8 bytes, index scales; an
    IndexShare shared layer keeps no index K in either, so the decode's must be empty there)."""
    problems = []
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            mla, k_bytes, k_scale = rows[layer][req]
            no_index = k_bytes.new_empty(k_bytes.shape[0], 0)  # a shared layer: the decode keeps none either
            ref_bytes = cache.index_fp8.view(torch.uint8) if cache.with_index else no_index
            for part, got, ref in (
                ("MLA rows", mla, cache.mla_rows),
                ("index fp8", k_bytes, ref_bytes),
                ("index scale", k_scale.view(torch.uint8), cache.index_scale.view(torch.uint8)),
            ):
                if not torch.equal(got.cpu(), ref.cpu()):
                    problems.append(f"layer {layer} request {req}: decode {part} differ from the oracle's")
    return problems


def store_mismatches(rows: list[dict[int, RequestRows]], ranks_stored: list[list[dict[int, tuple]]]) -> list[str]:
    """Where the decode's rows differ from what the prefill ranks held at rest (``RankResult.stored``:
    per rank, per layer, request -> positions and rows): the transfer's own exactness."""
    problems = []
    for layer, decoded in enumerate(rows):
        for req, got in decoded.items():
            expect = [torch.zeros_like(part) for part in got]
            covered = torch.zeros(got[0].shape[0], dtype=torch.long)
            for stored in ranks_stored:
                positions, *parts = stored[layer][req]
                covered[positions] += 1
                for dst, src in zip(expect, parts):
                    if src is not None:  # None: an IndexShare shared layer's index K, which it does not keep
                        dst[positions] = src.view(dst.dtype)
            if not bool((covered == 1).all()):
                problems.append(
                    f"layer {layer} request {req}: the prefill ranks do not hold every position exactly once"
                )
            elif not all(torch.equal(a.cpu(), b) for a, b in zip(got, expect)):
                problems.append(f"layer {layer} request {req}: decode rows differ from the prefill ranks' rows at rest")
    return problems


class _DsaRows:
    """The DSA rows' check beside a family payload's (:meth:`PDPayload.store_mismatches`)."""

    @staticmethod
    def store_mismatches(rows: Any, ranks_stored: list[Any]) -> list[str]:
        return store_mismatches(rows, ranks_stored)


def run_prefill_and_decode(
    run: RunConfig, timeout_s: float = 300, *, transfer: str = "pages", transport: str = "torch"
) -> PDResult:
    """Prefill ``run`` on ``run.cp_size`` CP ranks (phase 2), transfer the KV to a decode process.

    Launches ``C + 1`` processes over gloo (see the module docstring), on the GPUs when
    ``run.device == "cuda"`` (``transfer="rows"`` only); ``transfer`` is ``"rows"`` (the decode
    allocates its own pages) or ``"pages"`` (it mirrors the prefill's page ids); ``transport`` is
    ``"torch"`` (gloo point-to-point) or ``"mooncake"`` (one-sided writes into the decode's
    registered pool; rows only). With ``run.check``
    the decode cache is compared byte for byte with the rows the prefill ranks held at rest and, on
    CPU, with the single-device oracle (``PDResult.problems``).
    """
    if transfer not in ("rows", "pages"):
        raise ConfigError(f"transfer={transfer!r}: use 'rows' or 'pages'")
    family = family_of(run.model)
    family.check_pd(run)
    payload = family.pd_payload(run)
    if payload is not None and transfer != "rows":
        raise ConfigError(
            f"transfer={transfer!r}: the page transfer mirrors the DSA pool's pages; {run.preset} ships its own "
            "cache parts as rows: use transfer='rows'"
        )
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport={transport!r}: use {' or '.join(map(repr, TRANSPORTS))}")
    if transport == "mooncake":
        if transfer != "rows":
            raise ConfigError("the mooncake transport writes row blocks into the decode's pool: use transfer='rows'")
        reason = mooncake_unavailable()  # here, before any rank starts
        if reason is not None:
            raise ConfigError(f"transport='mooncake': {reason}")
    if transfer == "pages" and run.batch_sizes is not None and len(run.batch_sizes) > 1:
        raise ConfigError(
            "the page transfer mirrors one batch's page ids; a run of several batches (--batches) sends "
            "rows: use transfer='rows'"
        )
    if run.pool_pages is not None:
        raise ConfigError(
            f"pool_pages={run.pool_pages}: the PD transfer is not built over a budgeted pool (an evicted "
            "request's pages are reused before the decode reads them); drop the budget"
        )
    if run.kv_design != "phases":
        raise ConfigError(
            f"kv_design={run.kv_design}: the PD transfer ships the phases' layout (KV sharded by page "
            "from phase 2); the competing KV designs run under `run` only: drop the design"
        )
    if not run.phases.sharded_kv:
        raise ConfigError(f"PD transfer of owned pages needs phase 2 (KV sharded at rest); phases are {run.phases}")
    if transfer == "pages" and run.model.index_share.shares:
        raise ConfigError(
            f"the page transfer moves index pages for every layer; IndexShare ({run.preset}, pattern "
            f"{run.model.index_share.pattern}) keeps them on full layers only: use transfer='rows'"
        )
    if transfer == "pages" and run.interleave != run.page_size:
        raise ConfigError(
            f"this transfer moves whole owned pages, and kv_interleave={run.interleave} spreads every page over the "
            "ranks: send the token shards to a DCP decode instead (reference_impl.pd.dcp.transfer_to_dcp)"
        )
    on_cuda = run.device == "cuda"
    if on_cuda and transfer != "rows":
        raise ConfigError("the page transfer runs on CPU (gloo point-to-point): use device='cpu', or transfer='rows'")
    run = run.replace(device="cuda" if on_cuda else "cpu")
    world = run.cp_size + 1
    # Before any rank starts, cheapest first: the environment, the C + 1 processes this machine can
    # run, the memory (arithmetic, with the decode process), then the split in this process.
    check_environment()
    plan = plan_launch(world, run.device, "gloo")
    check_fits(
        run,
        run.device,
        plan.start_method,
        cuda_devices=max(1, torch.cuda.device_count()) if on_cuda else 1,
        extra_process=decode_bytes(run),
    )
    build_metadata(run)
    # On CUDA every process shares the GPUs over gloo (NCCL refuses two ranks on one device); the
    # row blocks travel from pinned host memory (pd/staging.py).
    # The decode gives up on missing completions before the launcher stops the ranks, naming them.
    results = launch(
        _pd_rank,
        world,
        (run, transfer, transport, 0.9 * timeout_s),
        device=run.device,
        backend="gloo",
        timeout_s=timeout_s,
        debug=run.debug,
    )
    prefill, decode = results[: run.cp_size], results[run.cp_size]
    rows = decode.rows
    problems: list[str] = []
    next_token_error = None
    if run.check:
        ranks_stored = [r.prefill.stored for r in prefill if r.prefill is not None]
        # the transfer itself: byte for byte, any device
        problems += (payload or _DsaRows).store_mismatches(rows, ranks_stored)
    if run.check and not on_cuda:  # a GPU's GEMMs are not bit-reproducible on the CPU oracle
        threads = torch.get_num_threads()
        torch.set_num_threads(rank_cpu_threads(world))  # the ranks' reduction splits: byte-exact math
        try:
            cpu = torch.device("cpu")
            model = build_model(run, cpu)
            inputs = build_inputs(run, cpu)
            prefixes = [r.prefix for r in run.requests]
            if payload is None:
                oracle = run_oracle(model, prefixes, inputs, run.kv_dtype, run.page_size, chunk_size=run.chunk_size)
                problems += oracle_mismatches(rows, oracle)
            else:
                # the views in bf16, as the ranks read them (the runner's check does the same)
                oracle = family.oracle(
                    model, prefixes, inputs, run.kv_dtype, run.page_size, run.chunk_size, torch.bfloat16
                )
                problems += payload.oracle_mismatches(rows, oracle)
                next_token_error = payload.next_token_error(model, oracle, payload.next_inputs(cpu), decode.next_token)
                if not next_token_error <= NEXT_TOKEN_BOUND:
                    problems.append(
                        f"the decode's next token differs from the oracle's step by {next_token_error:.3g} "
                        f"(relative; bound {NEXT_TOKEN_BOUND})"
                    )
        finally:
            torch.set_num_threads(threads)
    if problems:
        logger.error("decode cache disagrees: %s", "; ".join(problems[:5]))
    manifests = tuple(p for r in prefill for p in r.manifests)
    if manifests != tuple(decode.manifests):
        problems.append("the manifests the decode rank received differ from the ones the prefill ranks built")
    ranks = tuple(r.prefill for r in prefill if r.prefill is not None)
    sent = tuple(r.sent for r in prefill if r.sent is not None)
    return PDResult(
        manifests,
        ranks,
        rows,
        decode.bytes_received,
        problems,
        transfer,
        sent,
        decode.decode_pages,
        oracle_checked=not on_cuda,
        transport=transport,
        protocol=decode.protocol,
        next_token=decode.next_token,
        next_token_error=next_token_error,
    )


def pd_report(run: RunConfig, result: PDResult) -> dict[str, Any]:
    """The ``pd`` command's JSON: the decode's verdict and what each prefill rank sent."""
    if result.transfer == "rows":
        ranks = [
            {
                "rank": s.rank,
                "bytes_sent": s.bytes_sent,
                "bytes_at_rest": s.bytes_at_rest,
                "rows_sent": s.rows_sent,
                "blocks_sent": s.blocks_sent,
                "blocks_sent_in_layer_loop": s.blocks_sent_in_layer_loop,
                "wait_ms_after_prefill": list(s.wait_ms_after_prefill),
                "staging_ms": s.staging_ms,
                "staging_hidden_fraction": s.staging_hidden_fraction,
                "staging_exposed_ms": s.staging_exposed_ms,
                "protocol": s.protocol,
            }
            for s in result.sent
        ]
    else:
        ranks = [{"rank": m.rank, "bytes_sent": m.nbytes, "pages_sent": m.n_pages} for m in result.manifests]
    prefill_pages: dict[int, list[int]] = {}
    replay_page_table(run, prefill_pages)
    return {
        "transfer": result.transfer,
        "transport": result.transport,
        "protocol": result.protocol,
        "cp_size": run.cp_size,
        "split_mode": run.split_mode,
        "phases": str(run.phases),
        "preset": run.preset,
        "requests": [[r.prefix, r.extend] for r in run.requests],
        "device": run.device,
        "decode_matches_oracle": result.matches_oracle if run.check and result.oracle_checked else None,
        # how the decode's caches meet the oracle's: byte for byte, unless the family's payload says otherwise
        "decode_oracle_check": getattr(family_of(run.model).pd_payload(run), "oracle_check_kind", "byte for byte"),
        "decode_matches_prefill": result.matches_oracle if run.check else None,
        "problems": result.problems,
        "bytes_received": result.bytes_received,
        "decode_next_token_error": result.next_token_error,  # a family payload's continuation (CPU check runs)
        "prefill_ranks": ranks,
        "decode_pages": [list(p) for p in result.decode_pages],
        "prefill_pages": [prefill_pages[req] for req in range(len(run.requests))],
    }


def format_pd(doc: dict[str, Any]) -> str:
    """The ``pd`` command's table."""
    how_close = doc.get("decode_oracle_check", "byte for byte")
    verdict = {True: f"MATCHES the oracle {how_close}", False: "DIFFERS from the oracle", None: "not checked"}
    how = (
        "rows: the decode allocates its own pages"
        if doc["transfer"] == "rows"
        else "pages: the decode mirrors the prefill's page ids"
    )
    if doc["transfer"] == "rows" and not doc["decode_pages"]:  # a family payload: no pages of the DSA pool
        how = "rows: the decode lays out each request's cache parts itself"
    if doc["transport"] != "torch":  # the default (gloo) line stays as it was; the JSON names both always
        how += f"; transport {doc['transport']} ({doc['protocol']})"
    lines = [
        f"PD | prefill on C={doc['cp_size']} ranks ({doc['split_mode']}, phases {doc['phases']}), "
        "decode on one process "
        f"| {doc['preset']} | requests {doc['requests']} | transfer {how}",
        f"  decode {verdict[doc['decode_matches_oracle']]}; received {doc['bytes_received']:,} B",
    ]
    if doc["decode_matches_oracle"] is None and doc["decode_matches_prefill"] is not None:
        lines[-1] = (
            f"  decode {'MATCHES' if doc['decode_matches_prefill'] else 'DIFFERS from'} "
            "the prefill ranks' rows at rest "
            f"byte for byte (on {doc['device']}: the GPU tier checks the prefill against the oracle); "
            f"received {doc['bytes_received']:,} B"
        )
    if doc.get("decode_next_token_error") is not None:
        lines.append(
            "  the decode continued one token per request: relative difference from the oracle's step "
            f"{doc['decode_next_token_error']:.3g} (bound {NEXT_TOKEN_BOUND})"
        )
    unit = "rows_sent" if doc["transfer"] == "rows" else "pages_sent"
    streamed = doc["transfer"] == "rows"
    header = (
        ["rank", "bytes sent"]
        + (["bytes at rest"] if streamed else [])
        + [unit.replace("_", " ")]
        + (["blocks sent in the layer loop"] if streamed else [])
    )
    rows = [
        [str(r["rank"]), f"{r['bytes_sent']:,}"]
        + ([f"{r['bytes_at_rest']:,}"] if streamed else [])
        + [str(r[unit])]
        + ([f"{r['blocks_sent_in_layer_loop']} of {r['blocks_sent']}"] if streamed else [])
        for r in doc["prefill_ranks"]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for r in doc["prefill_ranks"]:
        if r.get("staging_ms") is not None:
            lines.append(
                f"  rank {r['rank']}: the send's device leg (pool read + copy to pinned host, side stream) took "
                f"{r['staging_ms']:.2f} ms, {r['staging_hidden_fraction']:.0%} of it before the layer loop ended; "
                f"the last block landed {r['staging_exposed_ms']:.2f} ms after"
            )
    if doc["decode_pages"]:
        lines.append(f"  decode page ids per request: {doc['decode_pages']} (prefill's: {doc['prefill_pages']})")
    lines += [f"  ! {p}" for p in doc["problems"]]
    return "\n".join(lines)
