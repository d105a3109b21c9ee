"""Prefill on a CP group, then hand the KV cache to a decode process: the PD driver.

``C + 1`` processes over gloo: ranks ``0 .. C-1`` prefill as one CP group (a subgroup) with KV
sharded at rest (phase 2), each sends its owned pages (:mod:`reference_impl.pd`), and rank ``C``
rebuilds the full layout. With ``run.check`` the decode cache is compared with the single-device
oracle byte for byte.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError, RunConfig
from reference_impl.cp.comm import CPGroup
from reference_impl.engine import RankResult, build_metadata, replay_page_table, run_id_space, run_rank
from reference_impl.kvcache.layout import KVLayout
from reference_impl.launch import launch, rank_cpu_threads
from reference_impl.model.oracle import OracleResult, run_oracle
from reference_impl.pd.manifest import TransferManifest, build_manifest
from reference_impl.pd.transfer import DecodeCache, RequestRows, receive_pages, send_owned_pages
from reference_impl.workload import build_inputs, build_model

logger = logging.getLogger(__name__)


@dataclass
class PDResult:
    """A prefill + decode run: the prefill ranks' manifests and results, the decode cache's rows."""

    manifests: tuple[TransferManifest, ...]  # per prefill rank
    prefill: tuple[RankResult, ...]  # per prefill rank (``store`` dropped)
    rows: list[dict[int, RequestRows]]  # [layer][request] the decode pool's rows at the request's locs
    bytes_received: int  # page payload bytes the decode rank received
    problems: list[str]  # differences from the oracle's cache (empty: byte for byte equal; unchecked: empty)

    @property
    def matches_oracle(self) -> bool:
        return not self.problems


@dataclass
class _RoleResult:
    """What one process of the PD world returns: a prefill rank's manifest and result, or the decode's rows."""

    manifests: list[TransferManifest]  # prefill: its own manifest; decode: the manifests it received, in rank order
    prefill: RankResult | None = None
    rows: list[dict[int, RequestRows]] = field(default_factory=list)
    bytes_received: int = 0


def _pd_rank(world: CPGroup, run: RunConfig) -> _RoleResult:
    """One process of the ``C + 1`` world: prefill (CP rank) when ``rank < C``, else decode."""
    cp_size = run.cp_size
    subgroup = dist.new_group(list(range(cp_size)))  # collective over the world: every rank calls it
    if world.rank < cp_size:
        cp_group = CPGroup(process_group=subgroup, device=world.device, debug=world.debug)
        result = run_rank(cp_group, run, keep_store=True)
        store, result.store = result.store, None  # the store stays in this process
        assert store is not None
        manifest = build_manifest(store, cp_group.rank, cp_size)  # refuses anything but a sharded store
        send_owned_pages(manifest, store.pool, decode_rank=cp_size)
        return _RoleResult([manifest], prefill=result)
    table = replay_page_table(run)  # the logical locs every prefill rank allocated
    request_locs = [table.locs(req, world.device) for req in range(len(run.requests))]
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    id_space = run_id_space(table, len(run.requests))
    cache = DecodeCache(id_space, layout, run.model.n_layers, world.device, world.debug)
    manifests = receive_pages(cache, list(range(cp_size)))
    rows = [
        {req: cache.request_rows(layer, locs) for req, locs in enumerate(request_locs)}
        for layer in range(run.model.n_layers)
    ]
    return _RoleResult(manifests, rows=rows, bytes_received=cache.bytes_received)


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
    if not run.phases.sharded_kv:
        raise ConfigError(f"PD transfer of owned pages needs phase 2 (KV sharded at rest); phases are {run.phases}")
    if run.interleave != run.page_size:
        raise ConfigError(
            f"this transfer moves whole owned pages, and kv_interleave={run.interleave} spreads every page over the "
            "ranks: send the token shards to a DCP decode instead (reference_impl.pd.dcp.transfer_to_dcp)"
        )
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
    manifests = tuple(p for r in prefill for p in r.manifests)
    if manifests != tuple(decode.manifests):
        problems.append("the manifests the decode rank received differ from the ones the prefill ranks built")
    ranks = tuple(r.prefill for r in prefill if r.prefill is not None)
    return PDResult(manifests, ranks, rows, decode.bytes_received, problems)
