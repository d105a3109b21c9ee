"""``bench.ranks``: every rank of a real CP group at each level (the harness of the multi-GPU runs),
dry-run on gloo CPU ranks at the tiny preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_impl.bench import ranks as bench


def test_every_rank_reports_each_level_and_the_point_is_the_slowest(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    argv = [
        "--out",
        str(out),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--cp-size",
        "2",
        "--levels",
        "0,8",
        "--workloads",
        "current-only:0+256,prefix-heavy:128+64",
        "--layers",
        "2",
    ]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["backend"] == "gloo" and doc["cp_size"] == 2 and doc["gpu_count"] == 0
    assert [w["workload"]["name"] for w in doc["workloads"]] == ["current-only", "prefix-heavy"]
    for entry in doc["workloads"]:
        total = entry["workload"]["prefix"] + entry["workload"]["extend"]
        levels = {p["level"]: p for p in entry["levels"]}
        assert set(levels) == {0, 8}
        for point in levels.values():
            ranks = point["per_rank"]
            assert [r["rank"] for r in ranks] == [0, 1]
            assert sum(r["tokens"] for r in ranks) == entry["workload"]["extend"]  # the new tokens, split
            assert point["layer_ms_median"] == max(r["layer_ms_median"] for r in ranks) > 0
            assert all(r["gather_bytes"] > 0 and r["measured_peak_bytes"] is None for r in ranks)  # no CUDA here
        kv = {lvl: sum(r["kv_bytes"] + r["index_bytes"] for r in p["per_rank"]) for lvl, p in levels.items()}
        assert kv[8] * 2 == pytest.approx(kv[0], rel=0.05), (total, kv)  # level 2+: the KV sharded over 2 ranks
        assert levels[0]["store_path"] == "replicated"
        has_planner = entry["workload"]["prefix"] == 0  # the planner's scenario: no prefix
        if has_planner:  # 256 new tokens: page-sized blocks, each rank writes its own pages
            assert levels[8]["store_path"] == "direct"
        assert all(("planner" in p) == has_planner for p in levels.values())
    assert "current-only (0 cached + 256 new)" in bench.format_table(doc)


def test_a_bad_workload_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = bench.main(
        [
            "--out",
            str(tmp_path / "x.json"),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--cp-size",
            "2",
            "--workloads",
            "0+256",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "expected name:prefix" in err and err.count("\n") == 1, err
