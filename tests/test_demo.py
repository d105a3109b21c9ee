"""The main job's batches show every phase's effect, and its table states any fallback a level took."""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.compute_owner import direct_write_ok
from reference_impl.cp.ownership import Ownership
from reference_impl.demo import CPU_CHECK, GPU_CHECK, fallbacks, format_demo
from reference_impl.engine import build_metadata


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_the_gpu_batch_is_page_aligned_up_to_eight_ranks(cp_size: int) -> None:
    run = GPU_CHECK.replace(cp_size=cp_size, phases=PhaseSet.level(5))
    assert build_metadata(run).page_aligned  # so phase 5 writes directly
    assert all(r.prefix % run.page_size == 0 and r.prefix > 0 for r in run.requests[:1])  # history to materialize


@pytest.mark.parametrize("cp_size", [2, 4, 8])
@pytest.mark.parametrize("level", [5, 6, 7, 8])
def test_the_gpu_check_batch_passes_the_direct_write_check(cp_size: int, level: int) -> None:
    """The oracle-checked run takes phase 5's direct writes at levels 5-8 (the engine's batch-level verdict on the
    check batch's own locs), so the check covers the store path the timed run measures."""
    run = GPU_CHECK.replace(cp_size=cp_size, phases=PhaseSet.level(level))
    meta = build_metadata(run)
    batch = BatchLocs.build(meta, compute_owner=run.phases.compute_owner)
    assert direct_write_ok(meta, batch.extend_locs, Ownership(run.cp_size, run.interleave, run.page_size))


def test_the_gpu_table_names_the_checked_and_the_timed_store_paths() -> None:
    """Two runs, two store paths: the verdict carries the checked run's; materialized is per layer, and ``-`` at a
    replicated level (a local read of the replica, no materialization)."""

    def level(k: int, checked: str, timed: str, materialized: int) -> dict:
        return {
            "level": k,
            "matches_oracle": True,
            "store_path": checked,
            "per_rank_store_path": timed,
            "kv_at_rest_bytes": 2**20,
            "measured_peak_bytes": 2**30,
            "materialized_bytes": materialized,
            "layer_ms": 1.0,
            "problems": [],
            "fallbacks": [],
        }

    result = {
        "device": "gpu",
        "out_dir": "x",
        "check": {
            "how": "2 ranks",
            "preset": "deepseek-v3.2",
            "n_layers": 2,
            "compute_dtype": "bfloat16",
            "requests": [],
        },
        "per_rank": {"how": "rank 0 of C=8, 4 layers", "n_layers": 4, "workload": {"prefix": 1, "extend": 2}},
        "levels": [level(0, "replicated", "replicated", 8 * 2**20), level(5, "gathered", "direct", 8 * 2**20)],
    }
    header, replicated, level5 = format_demo(result).splitlines()[2:5]
    assert "oracle (checked store)" in header and "timed store" in header and "materialized / layer" in header
    assert replicated.split()[1:4] == ["match", "(replicated)", "replicated"] and " - " in replicated
    assert level5.split()[1:4] == ["match", "(gathered)", "direct"] and "2.0 MiB" in level5


def test_the_cpu_batch_writes_directly_from_phase_5(report_of) -> None:
    run = CPU_CHECK.replace(phases=PhaseSet.level(5))
    assert build_metadata(run).page_aligned
    report = report_of(run)
    assert report["matches_oracle"] is True and report["store_path"] == "direct"
    assert fallbacks(report, run, cuda=False) == []


def test_fallbacks_are_named() -> None:
    run = CPU_CHECK.replace(phases=PhaseSet.level(8))
    report = {"tail_mode": "full", "store_path": "gathered", "kernel_fallbacks": {"fused_store": "boom"}}
    said = fallbacks(report, run, cuda=False)
    assert said == [
        "phase 1: full tail gather",
        "phase 5: gathered store (a prefix ends mid-page)",
        "phase 7: torch paths (no CUDA)",
        "phase 8: inline (no CUDA stream)",
        "fused_store: torch path (boom)",
    ]
    unaligned = CPU_CHECK.replace(
        requests=CPU_CHECK.requests[:1] + (CPU_CHECK.requests[1].__class__(0, 20),), phases=PhaseSet.level(4)
    )
    assert fallbacks(
        {"tail_mode": "narrow", "store_path": "replicated", "kernel_fallbacks": {}}, unaligned, cuda=True
    ) == ["phase 4: token-balanced split (a request has fewer than 2C pages)"]
    assert fallbacks(
        {"tail_mode": "narrow", "store_path": "gathered", "kernel_fallbacks": {}},
        unaligned.replace(phases=PhaseSet.level(5)),
        cuda=True,
    )[-1] == ("phase 5: gathered store (the split is not page-aligned)")
    result = {
        "device": "cpu",
        "per_rank": None,
        "out_dir": "x",
        "check": {"how": "4 ranks", "preset": "tiny", "n_layers": 2, "compute_dtype": "float32", "requests": []},
        "levels": [
            {
                "level": 8,
                "matches_oracle": True,
                "store_path": "gathered",
                "check_kv_at_rest_bytes": 1,
                "check_transient_peak_bytes": 2,
                "check_tail_gather_bytes": 3,
                "check_layer_ms": 1.0,
                "problems": [],
                "fallbacks": said,
            }
        ],
    }
    table = format_demo(result)
    assert "fallbacks" in table.splitlines()[2] and "phase 5: gathered store" in table.splitlines()[3]
