"""The V4 benchmark's CPU dry run and the planner's V4 terms."""

from __future__ import annotations

import json

from reference_impl.families.deepseek_v4 import bench as bench_v4
from reference_impl.families.deepseek_v4 import planner as planner_v4
from reference_impl.presets import get_preset


def test_bench_dry_run_writes_levels_bytes_and_layer_types(tmp_path):
    out = tmp_path / "v4.json"
    assert (
        bench_v4.main(
            [
                "--out",
                str(out),
                "--device",
                "cpu",
                "--preset",
                "tiny-v4",
                "--workloads",
                "a:0+300,b:600+150",
                "--levels",
                "0,3",
                "--layers",
                "3",
                "--repeats",
                "1",
                "--cp-size",
                "2",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["layer_types"] == ["sliding", "csa", "hca"] and len(doc["workloads"]) == 2
    for w in doc["workloads"]:
        base, top = w["levels"]
        assert set(base["layer_ms_by_type"]) == {"sliding", "csa", "hca"}
        assert top["csa_bytes"] < base["csa_bytes"] and top["hca_bytes"] == base["hca_bytes"]
        assert base["bytes_by_tag"]["v4_entries"] > 0 and "v4_window" in top["bytes_by_tag"]
    prefix = doc["workloads"][1]["levels"][1]
    assert prefix["bytes_by_tag"].get("materialize", 0) > 0  # history comes from the owners


def test_planner_v4_terms():
    cfg = get_preset("deepseek-v4-flash")
    per_token = planner_v4.bytes_per_token(cfg)
    assert per_token == {"sliding": 0.0, "csa": (584 + 68) / 4, "hca": 584 / 128}
    one_m = 1 << 20
    replicated = planner_v4.kv_at_rest(cfg, one_m, 8, sharded=False)
    sharded = planner_v4.kv_at_rest(cfg, one_m, 8, sharded=True)
    assert replicated["csa"] == 21 * (one_m // 4) * 652 and sharded["csa"] * 8 == replicated["csa"]
    assert sharded["hca"] == replicated["hca"] == 20 * (one_m // 128) * 584
    gathered = planner_v4.gather_bytes(cfg, 131072, 8, level=2, ratio=4)
    assert gathered["materialize"] > 0 and "materialize" not in planner_v4.gather_bytes(
        cfg, 131072, 8, level=3, ratio=4
    )
    doc = planner_v4.plan_v4("deepseek-v4-flash", 8, [131072], [0, 3], 48.0)
    v4_kv, v32_kv = doc["points"][1]["kv_bytes_per_rank"]["total"], doc["points"][1]["v32"]["kv_bytes_per_rank"]
    assert v4_kv * 5 < v32_kv  # compressed: a fraction of V3.2's bytes at the same context
