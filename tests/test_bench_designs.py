"""The KV designs' benchmark (CPU dry run at tiny scale) and their planner.

The dry run drives ``python -m reference_impl.bench.designs`` end to end on one rank of a loopback
group: every design runs, its collectives and bytes are counted per layer, the planner's prediction
sits beside each measured row and the shared-VMM row is the planner's, marked modeled. The planner
is checked on what each design promises: who keeps what at rest, what moves, and what it costs.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from reference_impl.bench import designs as bench
from reference_impl.bench import paired
from reference_impl.bench.layer import Workload
from reference_impl.planner.designs import PLANNED_DESIGNS, design_layer, kv_bytes_at_rest, max_context, plan_designs
from reference_impl.planner.rates import load_rates
from reference_impl.presets import get_preset

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
sys.path.insert(0, str(RESULTS.parent.parent / "scripts"))
import results_tables  # noqa: E402


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
    # One round: every design once, the paired comparisons exist but one round never calls a winner.
    assert workload["orders"] == [list(bench.MEASURED_DESIGNS)]
    assert all(len(rows[d]["run_ms"]) == 1 for d in bench.MEASURED_DESIGNS)
    assert len(workload["comparisons"]) == 6 and {c["verdict"] for c in workload["comparisons"]} == {"within noise"}
    assert [r["name"] for r in workload["ranking"]] == sorted(
        bench.MEASURED_DESIGNS, key=lambda d: rows[d]["run_ms"][0]
    )


# ---- paired, interleaved rounds ------------------------------------------------------------------


def test_rounds_rotate_so_no_design_always_runs_first() -> None:
    orders = paired.rotations(["a", "b", "c"], 6)
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    assert all(sorted(o) == ["a", "b", "c"] for o in orders)
    assert sorted(o[0] for o in orders) == ["a", "a", "b", "b", "c", "c"]


def test_the_rule_calls_faster_only_when_every_round_agrees() -> None:
    slow, fast = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3], [9.5, 9.8, 9.6, 9.7, 9.4, 9.9]
    c = paired.compare("x", fast, "y", slow)
    assert c["faster"] == "x" and c["verdict"] == "x faster" and c["difference"]["max"] < 0
    assert c["chance_agreement"] == pytest.approx(2 / 64)
    assert paired.compare("y", slow, "x", fast)["verdict"] == "x faster"
    # One round the other way: the medians differ as much, the verdict is noise.
    mixed = [*fast[:5], 10.4]
    c = paired.compare("x", mixed, "y", slow)
    assert c["faster"] is None and c["verdict"] == paired.WITHIN_NOISE
    assert c["difference"]["min"] < 0 < c["difference"]["max"]
    # Every round agrees, but four rounds are too few (2 x 0.5^4 = 12.5%).
    assert paired.compare("x", fast[:4], "y", slow[:4])["verdict"] == paired.WITHIN_NOISE
    with pytest.raises(ValueError, match="same number"):
        paired.compare("x", fast, "y", slow[:3])


def _fake_rounds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``bench.run_once`` and ``bench.design_row`` stood in: each run returns made-up layer times (phases
    always 1 ms faster than layer-split; rotated-shard now faster, now slower than the phases)."""
    calls: list[str] = []
    base = {"phases": 10.0, "layer-split": 11.0, "rotated-shard": 10.0, "dcp-gather": 10.5}

    def run_once(preset: str, design: str, *args: object) -> tuple[types.SimpleNamespace, None]:
        calls.append(design)
        n = len(calls)
        wobble = 0.3 * (-1) ** n if design == "rotated-shard" else 0.01 * n
        return types.SimpleNamespace(timings={"layer_ms": [base[design] + wobble] * 2}), None

    def design_row(preset: str, design: str, *args: object) -> dict:
        layer_ms, run_ms = args[-2], args[-1]
        return {"design": design, "status": "measured", "layer_ms": 0.0, "layer_ms_all": layer_ms, "run_ms": run_ms}

    monkeypatch.setattr(bench, "run_once", run_once)
    monkeypatch.setattr(bench, "design_row", design_row)
    return calls


def test_the_designs_run_interleaved_and_compared_round_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_rounds(monkeypatch)
    designs = list(bench.MEASURED_DESIGNS)
    doc = bench.measure("tiny", [Workload.parse("w:0+64")], designs, 2, 0, 2, "cpu", None, 6)
    (w,) = doc["workloads"]
    assert calls[:4] == designs  # the warm-up round
    assert calls[4:] == [d for order in paired.rotations(designs, 6) for d in order]
    assert w["orders"][1][0] == "layer-split"
    verdicts = {(c["a"], c["b"]): c["verdict"] for c in w["comparisons"]}
    assert verdicts[("phases", "layer-split")] == "phases faster"
    assert verdicts[("phases", "rotated-shard")] == paired.WITHIN_NOISE
    assert w["ranking"][-1]["name"] == "layer-split" and w["ranking"][0]["verdict_vs_next"] is not None
    # The page's sentences and table, rendered from those verdicts.
    doc.update(repeats=6, rule=paired.RULE)
    assert results_tables.design_verdict(doc, "layer-split", "phases") == "phases faster"
    assert results_tables.design_verdict(doc, "rotated-shard", "phases", 0, 64) == paired.WITHIN_NOISE
    table = results_tables.kv_design_verdicts(doc)
    assert "| w 0+64 | layer-split | +1.0" in table and "phases faster |" in table and "predate" not in table


def test_results_from_before_the_paired_protocol_read_not_re_measured() -> None:
    committed = json.loads((RESULTS / "kv_designs_h200.json").read_text())
    if any(w.get("comparisons") for w in committed["workloads"]):
        pytest.skip("the committed results were measured with paired rounds")
    table = results_tables.kv_design_verdicts(committed)
    assert "predate the paired protocol" in table and "faster" not in table
    assert results_tables.design_verdict(committed, "dcp-gather", "phases") == results_tables.NOT_REMEASURED


def test_the_h200_run_fits_one_device_call() -> None:
    workloads = [Workload.parse(w) for w in bench.DEFAULT_WORKLOADS.split(",")]
    repeats = bench.DEFAULT_REPEATS
    seconds = bench.estimate_s("deepseek-v3.2", workloads, list(bench.MEASURED_DESIGNS), 8, 0, 4, repeats, 450.0)
    assert repeats >= paired.MIN_REPEATS and 30 < seconds < 600  # a device call's limit


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
