"""Prefill -> decode KV transfer: owned pages from every prefill rank into one full-layout pool.

The decode side is not CP: a :class:`DecodeCache` owns a :class:`PagedKVPool` of the batch's
``n_pages`` logical pages (physical == logical) and writes each received page at its logical
position. It counts every (layer, page) it receives and is complete when the prefill ranks' plans
partition the pages and every page of every layer arrived exactly once.

Two transports move the same page rows (one row per page and layer: MLA page bytes, then index
page bytes, as :func:`pack_pages` builds them):

* **in-process** (:func:`transfer_in_process`): stores (or ``(plan, pool)`` pairs) of one process,
  copied with ``read_pages`` / ``write_pages``; what the unit tests use.
* **point-to-point** (:func:`send_owned_pages` / :func:`receive_pages`, run end to end by
  :func:`run_prefill_and_decode`): a world of ``C + 1`` processes over gloo; ranks ``0 .. C-1``
  prefill as one CP group (a subgroup), rank ``C`` decodes. Each prefill rank sends a header
  (``int64 [4]``: pages, layers, MLA page bytes, index page bytes), its logical page ids
  (``int64 [n]``), then one ``uint8 [n, page row bytes]`` tensor per layer; the decode rank
  receives from the prefill ranks in rank order. Nothing is sent for an empty list (a rank that
  owns no page sends only the header).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError, RunConfig
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.engine import RankResult, build_metadata, replay_page_table, run_id_space, run_rank
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool
from reference_impl.launch import launch, rank_cpu_threads
from reference_impl.model.oracle import OracleResult, run_oracle
from reference_impl.workload import build_inputs, build_model

from .plan import TransferPlan, build_transfer_plan, check_plans_cover

logger = logging.getLogger(__name__)

HEADER_FIELDS = 4  # pages, layers, MLA page bytes, index page bytes
RequestRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (mla uint8 [N, B], index uint8 [N, D], scale f32 [N])


def pack_pages(pool: PagedKVPool, physical_pages: torch.Tensor, layer: int) -> torch.Tensor:
    """Pages ``physical_pages [n] int64`` of ``layer`` -> ``uint8 [n, mla_page_bytes + index_page_bytes]``."""
    if not physical_pages.numel():  # a rank may own no page (and a pool of 0 pages has no page view)
        layout = pool.layout
        return torch.empty(0, layout.mla_page_bytes + layout.index_page_bytes, dtype=torch.uint8, device=pool.device)
    mla, index = pool.read_pages(layer, physical_pages)
    return torch.cat([mla, index], dim=1)


class DecodeCache:
    """The decode side's full-layout pool of ``n_pages`` logical pages, filled page by page."""

    def __init__(
        self, n_pages: int, layout: KVLayout, n_layers: int, device: torch.device | str = "cpu", debug: bool = False
    ) -> None:
        self.layout = layout
        self.pool = PagedKVPool(n_layers, n_pages, layout.page_size, layout, device, debug)
        self.plans: list[TransferPlan] = []
        self.bytes_received = 0
        self._received = torch.zeros(n_layers, n_pages, dtype=torch.int32)  # host-side counts

    def _check_plan(self, plan: TransferPlan) -> None:
        layout, pool = self.layout, self.pool
        if (plan.page_size, plan.n_layers, plan.mla_page_bytes, plan.index_page_bytes) != (
            layout.page_size, pool.n_layers, layout.mla_page_bytes, layout.index_page_bytes
        ):
            raise ConfigError(
                f"rank {plan.rank} sends pages of {plan.page_size} tokens, {plan.n_layers} layers, "
                f"{plan.mla_page_bytes}+{plan.index_page_bytes} bytes; the decode pool has {layout.page_size} "
                f"tokens, {pool.n_layers} layers, {layout.mla_page_bytes}+{layout.index_page_bytes} bytes"
            )
        if plan.logical_pages and not 0 <= min(plan.logical_pages) <= max(plan.logical_pages) < pool.n_pages:
            raise ConfigError(f"rank {plan.rank} sends pages outside the decode pool's {pool.n_pages} pages")

    def add_plan(self, plan: TransferPlan) -> None:
        """Announce a prefill rank's plan (before its pages arrive)."""
        self._check_plan(plan)
        self.plans.append(plan)

    def write(self, plan: TransferPlan, layer: int, rows: torch.Tensor) -> None:
        """Install ``rows uint8 [plan.n_pages, page row bytes]`` (:func:`pack_pages`) at ``plan``'s logical pages."""
        if plan not in self.plans:
            self.add_plan(plan)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (plan.n_pages, plan.page_row_bytes):
            raise ConfigError(
                f"rank {plan.rank} layer {layer}: expected page rows uint8 [{plan.n_pages}, {plan.page_row_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        if not plan.n_pages:
            return
        pages = list(plan.logical_pages)
        if bool((self._received[layer, pages] > 0).any()):
            raise ConfigError(f"rank {plan.rank} layer {layer}: a page arrived twice (plans overlap)")
        self._received[layer, pages] += 1
        rows = rows.to(self.pool.device)
        split = plan.mla_page_bytes
        self.pool.write_pages(layer, plan.logical_tensor(self.pool.device), rows[:, :split], rows[:, split:])
        self.bytes_received += rows.numel()

    def check_complete(self) -> None:
        """Raise :class:`ConfigError` unless every page of every layer arrived exactly once."""
        check_plans_cover(self.plans, self.pool.n_pages)
        missing = (self._received != 1).nonzero()
        if missing.numel():
            layer, page = missing[0].tolist()
            raise ConfigError(
                f"decode cache incomplete: {missing.shape[0]} (layer, page) pairs missing, "
                f"first: layer {layer} page {page}"
            )

    def request_rows(self, layer: int, locs: torch.Tensor) -> RequestRows:
        """Rows at logical ``locs``: ``(mla uint8 [N, mla_bytes], index fp8 bytes uint8 [N, D], scale float32 [N])``."""
        locs = locs.to(self.pool.device)
        k_fp8, k_scale = self.pool.read_index(layer, locs)
        return self.pool.read_mla(layer, locs), k_fp8.view(torch.uint8), k_scale


# --------------------------------------------------------------------------------------------
# Transport 1: in-process
# --------------------------------------------------------------------------------------------


def transfer_in_process(
    sources: Sequence[ShardedKV | tuple[TransferPlan, PagedKVPool]],
    n_pages: int,
    layout: KVLayout,
    n_layers: int,
    device: torch.device | str = "cpu",
) -> PagedKVPool:
    """Rebuild the full-layout pool from every prefill rank's store (or ``(plan, pool)`` pair).

    Raises :class:`ConfigError` for a non-sharded store or when the sources do not cover every page once.
    """
    cache = DecodeCache(n_pages, layout, n_layers, device)
    for source in sources:
        plan, pool = source if isinstance(source, tuple) else (build_transfer_plan(source), source.pool)
        cache.add_plan(plan)
        physical = plan.physical_tensor(pool.device)
        for layer in range(plan.n_layers):
            cache.write(plan, layer, pack_pages(pool, physical, layer))
    cache.check_complete()
    return cache.pool


# --------------------------------------------------------------------------------------------
# Transport 2: torch.distributed point-to-point
# --------------------------------------------------------------------------------------------


def send_owned_pages(plan: TransferPlan, pool: PagedKVPool, decode_rank: int) -> int:
    """Send ``plan``'s pages of ``pool`` to global rank ``decode_rank``; returns the payload bytes sent."""
    header = torch.tensor([plan.n_pages, plan.n_layers, plan.mla_page_bytes, plan.index_page_bytes], dtype=torch.long)
    dist.send(header, decode_rank)
    if not plan.n_pages:
        return 0
    dist.send(plan.logical_tensor(), decode_rank)
    physical = plan.physical_tensor(pool.device)
    for layer in range(plan.n_layers):
        dist.send(pack_pages(pool, physical, layer).cpu(), decode_rank)  # gloo moves host tensors
    return plan.nbytes


def receive_pages(cache: DecodeCache, prefill_ranks: Sequence[int]) -> list[TransferPlan]:
    """Receive every prefill rank's pages (CP rank ``i`` is global rank ``prefill_ranks[i]``) in rank order."""
    cp_size, page_size = len(prefill_ranks), cache.layout.page_size
    plans = []
    for cp_rank, src in enumerate(prefill_ranks):
        header = torch.empty(HEADER_FIELDS, dtype=torch.long)
        dist.recv(header, src)
        n, n_layers, mla_page_bytes, index_page_bytes = header.tolist()
        pages = torch.empty(n, dtype=torch.long)
        if n:
            dist.recv(pages, src)
        plan = TransferPlan.from_logical(
            cp_rank, cp_size, page_size, pages.tolist(), n_layers, mla_page_bytes, index_page_bytes
        )
        cache.add_plan(plan)  # checks the layout before any page bytes arrive
        for layer in range(n_layers if n else 0):
            rows = torch.empty(n, plan.page_row_bytes, dtype=torch.uint8)
            dist.recv(rows, src)
            cache.write(plan, layer, rows)
        plans.append(plan)
    cache.check_complete()
    return plans


@dataclass
class PDResult:
    """A prefill + decode run: the prefill ranks' plans and results, the decode cache's rows."""

    plans: tuple[TransferPlan, ...]  # per prefill rank
    prefill: tuple[RankResult, ...]  # per prefill rank (``store`` dropped)
    rows: list[dict[int, RequestRows]]  # [layer][request] the decode pool's rows at the request's locs
    bytes_received: int  # page payload bytes the decode rank received
    problems: list[str]  # differences from the oracle's cache (empty: byte for byte equal; unchecked: empty)

    @property
    def matches_oracle(self) -> bool:
        return not self.problems


@dataclass
class _RoleResult:
    """What one process of the PD world returns: a prefill rank's plan and result, or the decode's rows."""

    plans: list[TransferPlan]  # prefill: its own plan; decode: the plans it received, in rank order
    prefill: RankResult | None = None
    rows: list[dict[int, RequestRows]] = field(default_factory=list)
    bytes_received: int = 0


def _pd_rank(world: CPGroup, run: RunConfig) -> _RoleResult:
    """One process of the ``C + 1`` world: prefill (CP rank) when ``rank < C``, else decode."""
    cp_size = run.cp_size
    subgroup = dist.new_group(list(range(cp_size)))  # collective over the world: every rank calls it
    if world.rank < cp_size:
        result = run_rank(CPGroup(process_group=subgroup, device=world.device, debug=world.debug), run, keep_store=True)
        store, result.store = result.store, None  # the store stays in this process
        plan = build_transfer_plan(store)  # refuses anything but a sharded store
        assert isinstance(store, ShardedKV)
        send_owned_pages(plan, store.pool, decode_rank=cp_size)
        return _RoleResult([plan], prefill=result)
    table = replay_page_table(run)  # the logical locs every prefill rank allocated
    request_locs = [table.locs(req, world.device) for req in range(len(run.requests))]
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    id_space = run_id_space(table, len(run.requests))
    cache = DecodeCache(id_space, layout, run.model.n_layers, world.device, world.debug)
    plans = receive_pages(cache, list(range(cp_size)))
    rows = [
        {req: cache.request_rows(layer, locs) for req, locs in enumerate(request_locs)}
        for layer in range(run.model.n_layers)
    ]
    return _RoleResult(plans, rows=rows, bytes_received=cache.bytes_received)


def oracle_mismatches(rows: list[dict[int, RequestRows]], oracle: OracleResult) -> list[str]:
    """Where decode rows differ from the oracle's cache (MLA rows, index fp8 bytes, index scales)."""
    problems = []
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            mla, k_bytes, k_scale = rows[layer][req]
            for part, got, ref in (
                ("MLA rows", mla, cache.mla_rows),
                ("index fp8", k_bytes, cache.index_fp8.view(torch.uint8)),
                ("index scale", k_scale.view(torch.uint8), cache.index_scale.view(torch.uint8)),
            ):
                if not torch.equal(got.cpu(), ref.cpu()):
                    problems.append(f"layer {layer} request {req}: decode {part} differ from the oracle's")
    return problems


def run_prefill_and_decode(run: RunConfig, timeout_s: float = 300) -> PDResult:
    """Prefill ``run`` on ``run.cp_size`` CP ranks (phase 2), transfer the KV to a decode process.

    Launches ``C + 1`` CPU processes over gloo (see the module docstring). With ``run.check`` the
    decode cache is compared with the single-device oracle byte for byte (``PDResult.problems``).
    """
    if 2 not in run.phases:
        raise ConfigError(f"PD transfer of owned pages needs phase 2 (KV sharded at rest); phases are {run.phases}")
    if run.device == "cuda":
        raise ConfigError("the PD transfer transport runs on CPU (gloo point-to-point); use device='cpu'")
    run = run.replace(device="cpu")
    build_metadata(run)  # validates the split in this process before any rank starts
    world = run.cp_size + 1
    results = launch(_pd_rank, world, run, device="cpu", backend="gloo", timeout_s=timeout_s, debug=run.debug)
    prefill, decode = results[: run.cp_size], results[run.cp_size]
    rows = decode.rows
    problems: list[str] = []
    if run.check:
        threads = torch.get_num_threads()
        torch.set_num_threads(rank_cpu_threads(world))  # the ranks' reduction splits: byte-exact math
        try:
            model = build_model(run, torch.device("cpu"))
            inputs = build_inputs(run, torch.device("cpu"))
            prefixes = [r.prefix for r in run.requests]
            oracle = run_oracle(model, prefixes, inputs, run.kv_dtype, run.page_size, chunk_size=run.chunk_size)
        finally:
            torch.set_num_threads(threads)
        problems = oracle_mismatches(rows, oracle)
        if problems:
            logger.error("decode cache disagrees with the oracle: %s", "; ".join(problems[:5]))
    plans = tuple(p for r in prefill for p in r.plans)
    if plans != tuple(decode.plans):
        problems.append("the plans the decode rank received differ from the ones the prefill ranks built")
    ranks = tuple(r.prefill for r in prefill if r.prefill is not None)
    return PDResult(plans, ranks, rows, decode.bytes_received, problems)
