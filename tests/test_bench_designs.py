"""The KV designs' benchmark (CPU dry run at tiny scale) and their planner.

The dry run drives ``python -m reference_impl.bench.designs`` end to end on one rank of a loopback
group: every design runs, its collectives and bytes are counted per layer, the planner's prediction
sits beside each measured row and the shared-VMM row is the planner's, marked modeled. The planner
is checked on what each design promises: who keeps what at rest, what moves, and what it costs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_impl.bench import designs as bench
from reference_impl.bench.layer import Workload
from reference_impl.planner.designs import PLANNED_DESIGNS, design_layer, kv_bytes_at_rest, max_context, plan_designs
from reference_impl.planner.rates import load_rates
from reference_impl.presets import get_preset

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("designs") / "dry.json"
    assert (
        bench.main(
            [
                "--out",
                str(out),
                "--device",
                "cpu",
                "--preset",
                "tiny",
                "--workloads",
                "prefix-heavy:80+48",
                "--cp-size",
                "2",
                "--layers",
                "2",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def test_the_dry_run_measures_every_design_beside_the_planner(dry_run: dict) -> None:
    assert dry_run["kind"] == "measured" and dry_run["estimated_s"] > 0 and dry_run["wall_s"] > 0
    (workload,) = dry_run["workloads"]
    rows = {r["design"]: r for r in workload["designs"]}
    assert list(rows) == [*bench.MEASURED_DESIGNS, "shared-vmm"]
    assert rows["shared-vmm"]["status"].startswith("modeled")
    assert rows["phases"]["phases"] == list(range(1, 9))
    for design in bench.MEASURED_DESIGNS:
        row = rows[design]
        assert row["status"] == "measured" and row["planner"]["design"] == design
        assert row["host_syncs_per_layer"] == 0 and row["layer_ms"] > 0
        # A prefix: every design moves history (or, dcp-gather, every shard) and builds views from it.
        assert row["history_bytes_moved_per_layer"] > 0 and row["bytes_materialized_per_layer"] > 0
        assert row["collectives_per_layer"] == 4  # all-gather #1 (2) + the design's two gathers
    assert rows["layer-split"]["store_path"] == "layer-owner" and rows["rotated-shard"]["store_path"] == "gathered"


def test_the_h200_run_fits_one_device_call() -> None:
    workloads = [Workload.parse(w) for w in bench.DEFAULT_WORKLOADS.split(",")]
    seconds = bench.estimate_s("deepseek-v3.2", workloads, list(bench.MEASURED_DESIGNS), 8, 0, 4, 2, 450.0)
    assert 30 < seconds < 300


def test_the_benchmark_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--out", "x.json", "--device", "cpu", "--designs", "phases,vmm"]) == 2
    assert "--designs" in capsys.readouterr().err


# ---- the planner ---------------------------------------------------------------------------------


def test_the_planner_keeps_what_each_design_promises_at_rest() -> None:
    cfg = get_preset("deepseek-v3.2")  # 61 layers
    s, c = 131072, 8
    replica = kv_bytes_at_rest(cfg, "layer-split", s, 1, 0)  # one rank owning every layer holds everything
    phases = kv_bytes_at_rest(cfg, "phases", s, c, 0)
    assert phases == replica // c  # 2048 pages, 256 per rank
    assert kv_bytes_at_rest(cfg, "rotated-shard", s, c, 0) == phases + replica // 2048  # one trash page per layer
    assert kv_bytes_at_rest(cfg, "layer-split", s, c, 0) == replica * 8 // 61  # rank 0 owns 8 of 61 layers
    assert kv_bytes_at_rest(cfg, "layer-split", s, c, 7) == replica * 7 // 61
    budget = 48 * 2**30
    assert (
        max_context(cfg, "layer-split", budget, c)
        < max_context(cfg, "rotated-shard", budget, c)
        <= max_context(cfg, "phases", budget, c)
    )


def test_the_planner_moves_what_each_design_moves() -> None:
    cfg, rates = get_preset("deepseek-v3.2"), load_rates()
    current = {d: design_layer(cfg, rates, d, 8, 0, 131072) for d in PLANNED_DESIGNS}
    history = {d: design_layer(cfg, rates, d, 8, 122880, 8192) for d in PLANNED_DESIGNS}
    for d in ("phases", "layer-split", "rotated-shard", "shared-vmm"):
        assert current[d]["history_bytes_moved_per_layer"] == 0 and current[d]["bytes_materialized_per_layer"] == 0
    assert current["dcp-gather"]["history_bytes_moved_per_layer"] > 0  # it gathers the current shards back
    assert (
        history["shared-vmm"]["collectives_per_layer"] == 2 and history["shared-vmm"]["peer_bytes_read_per_layer"] > 0
    )
    assert history["dcp-gather"]["terms_ms"]["full_view"] > history["rotated-shard"]["terms_ms"]["full_view"]
    assert all(r["host_syncs_per_layer"] == 0 for r in history.values())
    with pytest.raises(ValueError, match="plan one of"):
        design_layer(cfg, rates, "vmm", 8, 0, 1024)


def test_the_committed_modeled_results_come_from_the_planner() -> None:
    committed = json.loads((RESULTS / "kv_designs_modeled.json").read_text())
    fresh = plan_designs()
    assert committed["kind"] == "modeled" and [w["name"] for w in committed["workloads"]] == [
        w["name"] for w in fresh["workloads"]
    ]
    for old, new in zip(committed["workloads"], fresh["workloads"]):
        assert [d["design"] for d in old["designs"]] == list(PLANNED_DESIGNS)
        for a, b in zip(old["designs"], new["designs"]):  # bytes are arithmetic on the layouts: exact
            assert (
                a["kv_bytes_at_rest"] == b["kv_bytes_at_rest"]
                and a["bytes_moved_per_layer"] == b["bytes_moved_per_layer"]
            )
