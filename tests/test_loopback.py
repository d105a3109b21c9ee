"""LoopbackGroup: one rank of C alone in a process runs what that rank runs in a real CP group."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.config import ConfigError, PhaseSet, Request
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank

MIXED = (Request(16, 150), Request(13, 130))


@pytest.mark.parametrize("level", [0, 2, 3, 5, 7, 8])
def test_rank_of_loopback_issues_what_the_real_rank_issues(report_of, level: int) -> None:
    """Same collective sequence, gathered, materialized and stored bytes as rank 1 of a real gloo group."""
    run = tiny(cp_size=3, requests=MIXED, page_size=8, phases=PhaseSet.level(level))
    real = report_of(run)["per_rank"][1]
    solo = run_rank(LoopbackGroup(1, 3, "cpu"), run.replace(check=False))
    assert solo.stats["collectives"] == real["collectives"]
    for key in ("gather_bytes", "materialized_bytes", "output_gather_bytes", "kv_bytes", "index_bytes"):
        assert solo.stats[key] == real[key], key
    assert solo.store_path == report_of(run)["store_path"]
    assert len(solo.timings["layer_ms"]) == run.model.n_layers


def test_loopback_gather_fills_every_slot_with_the_local_rows() -> None:
    group = LoopbackGroup(2, 4, "cpu")
    local = torch.arange(6.0).reshape(3, 2)
    raw = group.all_gather_rows_padded_raw(local, [4, 4, 3, 3], "kv")
    assert raw.shape == (4, 4, 2)
    assert all(torch.equal(raw[r, :3], local) for r in range(4)) and not raw[:, 3].any()
    assert group.stats[-1].bytes_received == 3 * 4 * 2 * 4


def test_loopback_rejects_bad_identity_and_wire_without_cuda() -> None:
    with pytest.raises(ConfigError, match="rank 4 is not in a group of 4"):
        LoopbackGroup(4, 4, "cpu")
    with pytest.raises(ConfigError, match="wire_gbps"):
        LoopbackGroup(0, 4, "cpu", wire_gbps=450.0)


def test_layer_bench_dry_run(tmp_path) -> None:
    """The end-to-end harness on CPU (tiny preset): every level's record, the planner beside the
    current-only workload, the prefetch figures beside the prefix-heavy one."""
    import json

    from reference_impl.bench.layer import main

    out = tmp_path / "layer.json"
    main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--cp-size",
            "4",
            "--rank",
            "1",
            "--levels",
            "0,7,8",
            "--workloads",
            "current-only:0+256,prefix-heavy:128+64",
            "--layers",
            "2",
        ]
    )
    doc = json.loads(out.read_text())
    current, prefix = doc["workloads"]
    assert [p["level"] for p in current["levels"]] == [0, 7, 8]
    kv = {p["level"]: p["kv_bytes"] for p in current["levels"]}
    assert kv[7] < kv[0]  # sharded at rest from level 2
    assert all(abs(p["planner_error"]["kv_bytes"]) < 1e-9 for p in current["levels"])  # layouts: exact
    assert "prefetch" not in current and prefix["prefetch"]["payload_ms"] > 0
    assert all(len(p["layer_ms"]) == 2 for w in doc["workloads"] for p in w["levels"])


def test_layer_bench_level_repeats_pool_every_runs_layers(tmp_path) -> None:
    """``--level-repeats 3``: each level's median is over the layers of its three runs."""
    import json
    import statistics

    from reference_impl.bench.layer import main

    out = tmp_path / "layer.json"
    main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--cp-size",
            "2",
            "--levels",
            "0,3",
            "--workloads",
            "current-only:0+128",
            "--layers",
            "2",
            "--level-repeats",
            "3",
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["level_repeats"] == 3
    for point in doc["workloads"][0]["levels"]:
        assert len(point["layer_ms"]) == 6
        assert point["layer_ms_median"] == statistics.median(point["layer_ms"])


def test_layer_bench_compares_the_split_modes_in_one_run(tmp_path) -> None:
    """``--split-modes in-seq,round-robin``: each workload once per mode; round-robin's levels drop
    phases 4 and 5, keep the KV sharded at rest and write directly."""
    import json

    from reference_impl.bench.layer import main

    out = tmp_path / "layer.json"
    main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--cp-size",
            "4",
            "--levels",
            "0,7,8",
            "--workloads",
            "prefix:64+128",
            "--layers",
            "2",
            "--prefetch-repeats",
            "1",
            "--split-modes",
            "in-seq,round-robin",
        ]
    )
    in_seq, round_robin = json.loads(out.read_text())["workloads"]
    assert (in_seq["split_mode"], round_robin["split_mode"]) == ("in-seq", "round-robin")
    rr8 = round_robin["levels"][2]
    assert rr8["phases"] == "1,2,3,6,7,8" and rr8["store_path"] == "direct"
    assert rr8["kv_bytes"] <= in_seq["levels"][2]["kv_bytes"] < in_seq["levels"][0]["kv_bytes"]
    assert "prefetch" in round_robin and round_robin["prefetch"]["payload_ms"] > 0
    # The one-page history: one page in-seq; at interleave 1 each rank's quarter of it, a page each.
    assert round_robin["levels"][1]["materialized_bytes"] == 4 * in_seq["levels"][1]["materialized_bytes"] > 0


@pytest.mark.parametrize("flag", ["--prefetch-repeats", "--level-repeats", "--layers"])
def test_layer_bench_refuses_zero_repeats_by_name(tmp_path, capsys, flag: str) -> None:
    from reference_impl.bench.layer import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "x.json"), "--device", "cpu", "--preset", "tiny", flag, "0"])
    assert exc.value.code == 2 and f"{flag} must be at least 1, got 0" in capsys.readouterr().err
