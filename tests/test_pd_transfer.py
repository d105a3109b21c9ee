"""PD transfer (phase 2): every prefill rank's owned pages rebuild the decode's full-layout cache,
byte for byte equal to the single-device oracle's cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_replicated import ReplicatedKV
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.ownership import owned_page_count
from reference_impl.engine import build_metadata, run_rank
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool
from reference_impl.launch import rank_cpu_threads
from reference_impl.model.oracle import OracleResult, run_oracle
from reference_impl.pd import (
    DecodeCache,
    TransferManifest,
    build_manifest,
    check_manifests_cover,
    transfer_in_process,
)
from reference_impl.prefill_decode import oracle_mismatches, run_prefill_and_decode
from reference_impl.workload import build_inputs, build_model

MIXED = (Request(0, 96), Request(40, 70), Request(13, 37))  # prefixes 40 and 13 end mid-page
PAGE = 16
CPU = torch.device("cpu")


@dataclass(frozen=True)
class RankSlot:
    """The identity a ShardedKV reads from its group; storing needs no collective."""

    rank: int
    size: int
    device: torch.device = field(default=CPU)


def pd_run(cp_size: int, kv_dtype: str = "fp8", level: int = 2, requests: tuple[Request, ...] = MIXED) -> RunConfig:
    return RunConfig(
        preset="tiny",
        cp_size=cp_size,
        kv_dtype=kv_dtype,
        phases=PhaseSet.level(level),
        page_size=PAGE,
        requests=requests,
        device="cpu",
    )


def oracle_of(run: RunConfig, threads: int | None = None) -> OracleResult:
    """The oracle, with torch threads pinned as the ranks pin theirs (byte-exact matmul splits)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        model = build_model(run, CPU)
        return run_oracle(model, [r.prefix for r in run.requests], build_inputs(run, CPU), run.kv_dtype, run.page_size)
    finally:
        torch.set_num_threads(saved)


@functools.cache
def cached_oracle(kv_dtype: str) -> OracleResult:
    return oracle_of(pd_run(1, kv_dtype))  # the oracle does not depend on C


def sharded_stores(run: RunConfig, oracle: OracleResult) -> list[ShardedKV]:
    """The C ranks' phase-2 stores after the prefill, filled the way the engine fills them.

    Prefixes go through ``write_prefix``; the extend chunk (unquantized, sequence order) through
    ``store_current``, from the oracle's own projections.
    """
    manifest = BatchLocs.build(build_metadata(run), CPU)
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    n_layers = run.model.n_layers
    stores = [
        ShardedKV(manifest, layout, n_layers, RankSlot(r, run.cp_size), debug=True, reuse_current=False)  # type: ignore
        for r in range(run.cp_size)
    ]
    for layer in range(n_layers):
        kv_seq = torch.cat([p.kv for p in oracle.projections[layer]])
        index_k_seq = torch.cat([p.index_k for p in oracle.projections[layer]])
        for store in stores:
            for req, r in enumerate(run.requests):
                if r.prefix:
                    cache = oracle.caches[layer][req]
                    p = r.prefix
                    store.write_prefix(layer, req, cache.mla_rows[:p], cache.index_fp8[:p], cache.index_scale[:p])
            store.store_current(layer, kv_seq, index_k_seq)
    return stores


def assert_pool_equals_oracle(pool: PagedKVPool, manifest: BatchLocs, oracle: OracleResult) -> None:
    """Rows at every request's logical locs equal the oracle's cache byte for byte."""
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            locs = manifest.request_locs[req]
            assert locs.shape[0] == len(cache)
            k_fp8, k_scale = pool.read_index(layer, locs)
            assert torch.equal(pool.read_mla(layer, locs), cache.mla_rows)
            assert torch.equal(k_fp8.view(torch.uint8), cache.index_fp8.view(torch.uint8))
            assert torch.equal(k_scale.view(torch.uint8), cache.index_scale.view(torch.uint8))


# ------------------------------------------------------------------------------------ in-process


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_in_process_transfer_equals_oracle(cp_size: int, kv_dtype: str) -> None:
    run, oracle = pd_run(cp_size, kv_dtype), cached_oracle(kv_dtype)
    stores = sharded_stores(run, oracle)
    batch, layout = stores[0].batch, stores[0].layout
    pool = transfer_in_process(stores, batch.n_pages, layout, run.model.n_layers)
    assert pool.n_pages == batch.n_pages
    assert_pool_equals_oracle(pool, batch, oracle)

    # Each rank stored only its share, and the manifests move exactly the full pool's bytes.
    manifests = [build_manifest(s, s.group.rank, s.group.size) for s in stores]
    for store, manifest in zip(stores, manifests):
        assert store.pool.n_pages == owned_page_count(batch.n_pages, manifest.rank, cp_size) == manifest.n_pages
    assert sum(p.nbytes for p in manifests) == pool.bytes_total

    # The (manifest, pool) form rebuilds the same bytes.
    again = transfer_in_process(
        [(p, s.pool) for p, s in zip(manifests, stores)], batch.n_pages, layout, run.model.n_layers
    )
    assert torch.equal(again.mla, pool.mla) and torch.equal(again.index, pool.index)


def test_engine_store_transfers_in_process() -> None:
    """The engine's own store (``run_rank(..., keep_store=True)``, C=1) rebuilds the oracle's cache."""
    run = pd_run(1, "fp8", level=3)
    result = run_rank(CPGroup.single(), run, keep_store=True)
    assert isinstance(result.store, ShardedKV)
    batch = result.store.batch
    pool = transfer_in_process([result.store], batch.n_pages, result.store.layout, run.model.n_layers)
    assert_pool_equals_oracle(pool, batch, oracle_of(run))


def test_incomplete_or_overlapping_transfer_is_refused() -> None:
    run = pd_run(3)
    stores = sharded_stores(run, cached_oracle("fp8"))
    n_pages, layout, n_layers = stores[0].batch.n_pages, stores[0].layout, run.model.n_layers
    with pytest.raises(ConfigError, match="missing"):
        transfer_in_process(stores[:-1], n_pages, layout, n_layers)
    with pytest.raises(ConfigError, match="twice"):
        transfer_in_process(stores + stores[:1], n_pages, layout, n_layers)
    bf16 = KVLayout.from_config(run.model, "bf16", PAGE)
    with pytest.raises(ConfigError, match="decode pool"):
        transfer_in_process(stores, n_pages, bf16, n_layers)


def test_rank_without_pages_sends_nothing() -> None:
    """Two pages over C=4: ranks 2 and 3 own none; their empty manifests still count as covering."""
    run = pd_run(4, requests=(Request(5, 20),))
    oracle = oracle_of(run)
    stores = sharded_stores(run, oracle)
    manifests = [build_manifest(s, s.group.rank, s.group.size) for s in stores]
    assert [p.n_pages for p in manifests] == [1, 1, 0, 0] and manifests[2].nbytes == 0
    pool = transfer_in_process(stores, 2, stores[0].layout, run.model.n_layers)
    assert_pool_equals_oracle(pool, stores[0].batch, oracle)


# ------------------------------------------------------------------------------- manifest properties


@settings(max_examples=40, deadline=None)
@given(
    cp_size=st.integers(1, 6),
    page_size=st.sampled_from([4, 8, 16]),
    requests=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 60)), min_size=1, max_size=4),
)
def test_plans_partition_the_pages(cp_size: int, page_size: int, requests: list[tuple[int, int]]) -> None:
    assume(max(e for _, e in requests) >= cp_size)  # an in-seq split gives every rank a token
    run = RunConfig(
        preset="tiny",
        cp_size=cp_size,
        phases=PhaseSet.level(2),
        page_size=page_size,
        requests=tuple(Request(p, e) for p, e in requests),
    )
    batch = BatchLocs.build(build_metadata(run), CPU)
    layout = KVLayout.from_config(run.model, run.kv_dtype, page_size)
    stores = [ShardedKV(batch, layout, 1, RankSlot(r, cp_size), False, False) for r in range(cp_size)]  # type: ignore
    manifests = [build_manifest(s, s.group.rank, s.group.size) for s in stores]

    check_manifests_cover(manifests, batch.n_pages)
    assert sorted(p for manifest in manifests for p in manifest.logical_pages) == list(range(batch.n_pages))
    for manifest in manifests:
        assert manifest.physical_pages == tuple(range(manifest.n_pages))  # compact on the owner
        assert all(p % cp_size == manifest.rank for p in manifest.logical_pages)
    assert sum(p.nbytes for p in manifests) == batch.n_pages * (layout.mla_page_bytes + layout.index_page_bytes)

    with pytest.raises(ConfigError):
        check_manifests_cover(manifests + manifests[:1], batch.n_pages)  # a rank twice
    owner = next(p for p in manifests if p.n_pages)
    with pytest.raises(ConfigError, match="missing"):
        check_manifests_cover([p if p is not owner else _without_last_page(p) for p in manifests], batch.n_pages)


def _without_last_page(manifest: TransferManifest) -> TransferManifest:
    return TransferManifest(
        manifest.rank,
        manifest.cp_size,
        manifest.page_size,
        manifest.logical_pages[:-1],
        manifest.physical_pages[:-1],
        manifest.n_layers,
        manifest.mla_page_bytes,
        manifest.index_page_bytes,
    )


def test_plan_rejects_pages_the_rank_does_not_own() -> None:
    with pytest.raises(ConfigError, match="not owned"):
        TransferManifest(1, 2, PAGE, (2,), (1,), 1, 10, 10)


# ------------------------------------------------------------------------------ phase 0 refused


def test_replicated_store_is_refused() -> None:
    run = pd_run(2).replace(phases=PhaseSet.level(1))
    batch = BatchLocs.build(build_metadata(run), CPU)
    layout = KVLayout.from_config(run.model, run.kv_dtype, PAGE)
    with pytest.raises(ConfigError, match="phase 2"):
        build_manifest(ReplicatedKV(batch, layout, run.model.n_layers, CPU, False), 0, run.cp_size)
    with pytest.raises(ConfigError, match="phase 2"):
        run_prefill_and_decode(run)


# ----------------------------------------------------------------------- real processes (C + 1)


@pytest.mark.parametrize(
    ("cp_size", "kv_dtype", "level", "requests"),
    [
        (2, "fp8", 2, MIXED),
        (3, "bf16", 3, MIXED),
        # Rank 2 owns no page and sends only the header. Level 3 with no prefix materializes nothing:
        # a phase-2 materialization on a rank that owns no page trips PagedKVPool.read_pages (a pool of
        # 0 pages), so this case runs at level 3.
        (3, "fp8", 3, (Request(0, 20),)),
    ],
)
def test_multiprocess_transfer_equals_oracle(
    cp_size: int, kv_dtype: str, level: int, requests: tuple[Request, ...]
) -> None:
    run = pd_run(cp_size, kv_dtype, level, requests)
    res = run_prefill_and_decode(run, timeout_s=120)
    assert res.problems == [] and res.matches_oracle

    oracle = oracle_of(run, threads=rank_cpu_threads(cp_size + 1))  # pinned like the C + 1 ranks
    assert oracle_mismatches(res.rows, oracle) == []
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            mla, k_bytes, k_scale = res.rows[layer][req]
            assert torch.equal(mla, cache.mla_rows)
            assert torch.equal(k_bytes, cache.index_fp8.view(torch.uint8))
            assert torch.equal(k_scale.view(torch.uint8), cache.index_scale.view(torch.uint8))

    batch = BatchLocs.build(build_metadata(run), CPU)
    check_manifests_cover(res.manifests, batch.n_pages)
    assert [p.rank for p in res.manifests] == list(range(cp_size))
    assert res.bytes_received == sum(p.nbytes for p in res.manifests)
    full = DecodeCache(batch.n_pages, KVLayout.from_config(run.model, kv_dtype, PAGE), run.model.n_layers).pool
    assert res.bytes_received == full.bytes_total
    assert all(r.store is None for r in res.prefill)  # the store stays in its process
    assert [p.n_pages == 0 for p in res.manifests] == [r >= batch.n_pages for r in range(cp_size)]


def test_multiprocess_transfer_after_chunked_compute_owner_prefill() -> None:
    """Phase 5 lanes and chunked prefill change the logical locs; the decode side derives the same ones."""
    run = RunConfig(
        preset="tiny",
        cp_size=2,
        phases=PhaseSet.level(5),
        page_size=8,
        chunk_size=64,
        device="cpu",
        requests=(Request(16, 150), Request(8, 100)),
    )
    result = run_prefill_and_decode(run)
    assert result.problems == [] and result.matches_oracle
