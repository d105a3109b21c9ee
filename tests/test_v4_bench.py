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
                "--hit",
                "none",
                "--evict",
                "none",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert "prefix_hit" not in doc and "eviction" not in doc
    assert doc["layer_types"] == ["sliding", "csa", "hca"] and len(doc["workloads"]) == 2
    for w in doc["workloads"]:
        base, top = w["levels"]
        assert set(base["layer_ms_by_type"]) == {"sliding", "csa", "hca"}
        assert top["csa_bytes"] < base["csa_bytes"] and top["hca_bytes"] == base["hca_bytes"]
        assert base["bytes_by_tag"]["v4_entries"] > 0 and "v4_window" in top["bytes_by_tag"]
    prefix = doc["workloads"][1]["levels"][1]
    assert prefix["bytes_by_tag"].get("materialize", 0) > 0  # history comes from the owners


def test_bench_dry_run_times_a_hit_against_its_cold_prefill_and_an_evicting_pool(tmp_path):
    """The JSON's shape (CPU times mean nothing): a hit at 200 = 3 * 64 + 8 (a partial page of 8 tokens, two CSA
    entries, moves to its new owner), and three batches on a pool of one batch's pages."""
    out = tmp_path / "v4.json"
    argv = ["--out", str(out), "--device", "cpu", "--preset", "tiny-v4", "--layers", "3", "--cp-size", "2"]
    argv += ["--workloads", "a:0+64", "--levels", "3", "--repeats", "2"]
    argv += ["--hit", "h:200+40", "--hit-chunk-size", "120", "--evict", "e:200+40"]
    assert bench_v4.main(argv) == 0
    doc = json.loads(out.read_text())
    hit = doc["prefix_hit"]
    assert hit["workload"] == {"name": "h", "prefix": 200, "extend": 40} and hit["level"] == 3
    for key in ("cold_ms", "hit_ms", "saved_ms"):
        assert set(hit[key]) == {"median", "min", "max", "runs"} and len(hit[key]["runs"]) == 2
        assert hit[key]["min"] <= hit[key]["median"] <= hit[key]["max"]
    assert [c - h for c, h in zip(hit["cold_ms"]["runs"], hit["hit_ms"]["runs"])] == hit["saved_ms"]["runs"]
    assert hit["hit_bytes_by_tag"]["v4_hit"] == 2 * 2 * (584 + 68)  # C padded slots of the two moved entries
    assert "v4_hit" not in hit["cold_bytes_by_tag"] and hit["cold_bytes_by_tag"]["v4_entries"] > 0
    assert hit["prefix_cache"] | {"pool_pages": 0} == {
        "pool_pages": 0,
        "hits": 1,
        "hit_tokens": 192,  # its three whole pages by reference
        "misses": 0,
        "recomputed_tokens": 0,
        "evicted_requests": 0,
        "evicted_pages": 0,
    }
    assert hit["carried"] == {
        "mod_4": 0,
        "mod_8": 0,
        "mod_128": 72,
        "csa": {"entries": 50, "carried_rows": 4},
        "hca": {"entries": 1, "carried_rows": 72},
        "window_rows": 127,
    }
    ev = doc["eviction"]
    assert ev["requests"] == ["200+2", "200+40", "r0:200+40"] and ev["pool_pages"] == 4
    assert ev["prefix_cache"]["misses"] == 1 and ev["prefix_cache"]["evicted_requests"] == 2
    assert [b["requests_at_rest"] for b in ev["batches"]] == [[0], [1], [2]]  # each batch evicted the one before
    assert all(set(b["ms"]) == {"median", "min", "max", "runs"} for b in ev["batches"])


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


def test_bench_refuses_a_hit_without_a_prefix_by_flag(tmp_path, capsys):
    base = ["--out", str(tmp_path / "v4.json"), "--device", "cpu", "--preset", "tiny-v4", "--layers", "3"]
    assert bench_v4.main([*base, "--hit", "h:0+40", "--evict", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --hit 'h:0+40': a hit needs a cached prefix") and err.count("\n") == 1
    assert bench_v4.main([*base, "--evict", "e:100"]) == 2
    assert capsys.readouterr().err.startswith("error: --evict 'e:100': expected name:prefix+extend")
    assert bench_v4.main([*base, "--hit", "h:100+20", "--hit-chunk-size", "119", "--cp-size", "2"]) == 2
    assert "--hit-chunk-size" in capsys.readouterr().err  # its last chunk holds 1 token for 2 ranks
    assert not (tmp_path / "v4.json").exists()
