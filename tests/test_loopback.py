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
    rounds = doc["level_repeats"]  # the command line's default: enough rounds for a verdict
    assert rounds >= 5 and doc["protocol"] == "paired"
    assert all(len(p["layer_ms"]) == 2 * rounds for w in doc["workloads"] for p in w["levels"])
    assert all(len(w["orders"]) == rounds and len(w["comparisons"]) == 3 for w in doc["workloads"])


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


class _FakeResult:
    """What ``bench.layer`` reads of a run: layer times set by the test, fixed counts, no store."""

    def __init__(self, layer_ms: float, n_layers: int) -> None:
        self.timings = {"layer_ms": [layer_ms] * n_layers, "tail_ms": 0.0, "tail_collective_ms": 0.0}
        self.stats = dict.fromkeys(
            ("kv_bytes", "index_bytes", "transient_peak_bytes", "gather_bytes", "materialized_bytes", "collectives"), 1
        )
        self.store_path = "fake"
        self.store = None


def _fake_layer_bench(monkeypatch, times: dict[int, list[float]]) -> tuple[list[tuple[int, bool]], dict]:
    """``bench.layer.measure`` of levels 0, 2 and 7 with a fake timer: round ``r``'s run of level ``k`` reports
    ``times[k][r]`` ms per layer. Returns the runs in the order they ran, ``(level, timed)``, and the result."""
    from reference_impl.bench import layer

    ran: list[tuple[int, bool]] = []
    rounds: dict[int, int] = {}

    def fake_run(run, group, keep_store=False, empty_cache=True, prebuilt=None) -> _FakeResult:
        level = max(run.phases.enabled, default=0)
        timed = prebuilt is not None  # the warm-up round builds its own (shorter) model
        ran.append((level, timed))
        if not timed:
            return _FakeResult(1.0, run.model.n_layers)
        r = rounds[level] = rounds.get(level, -1) + 1
        return _FakeResult(times[level][r], run.model.n_layers)

    monkeypatch.setattr(layer, "_run", fake_run)
    n = len(times[0])
    out = layer.measure("tiny", layer.Workload("w", 64, 64), [0, 2, 7], 2, 0, 2, "cpu", None, level_repeats=n)
    return ran, out


def test_layer_bench_rotates_the_level_order_every_round(monkeypatch) -> None:
    """A warm-up round, then each round runs every level once, the order rotated by one per round."""
    times = {0: [5.0] * 5, 2: [4.0] * 5, 7: [3.0] * 5}
    ran, out = _fake_layer_bench(monkeypatch, times)
    assert ran[:3] == [(0, False), (2, False), (7, False)]
    timed = [level for level, is_timed in ran if is_timed]
    assert timed == [0, 2, 7, 2, 7, 0, 7, 0, 2, 0, 2, 7, 2, 7, 0]
    assert out["orders"] == [[0, 2, 7], [2, 7, 0], [7, 0, 2], [0, 2, 7], [2, 7, 0]] and out["rounds"] == 5
    level2 = out["levels"][1]
    assert level2["run_ms"] == times[2] and level2["run_ms_spread"]["median"] == 4.0
    pairs = [(c["a"], c["b"]) for c in out["comparisons"]]
    assert pairs == [("level 2", "level 0"), ("level 7", "level 2"), ("level 7", "level 0")]


@pytest.mark.parametrize("disagree", [False, True])
def test_layer_bench_verdict_needs_every_round_to_agree(monkeypatch, disagree: bool) -> None:
    """Level 2 is 1 ms below level 0 in every round: "level 2 faster". One round the other way round (its
    medians barely move) and the paired rule says "within noise"."""
    times = {0: [5.0, 5.2, 4.9, 5.1, 5.0], 2: [4.0, 4.2, 3.9, 4.1, 4.0], 7: [3.0] * 5}
    if disagree:
        times[2][3] = 5.3
    _, out = _fake_layer_bench(monkeypatch, times)
    c = next(c for c in out["comparisons"] if (c["a"], c["b"]) == ("level 2", "level 0"))
    assert c["verdict"] == ("within noise" if disagree else "level 2 faster")
    assert c["difference"]["max"] == pytest.approx(0.2 if disagree else -1.0)
    assert c["difference"]["median"] == pytest.approx(-1.0)
    medians = [p["layer_ms_median"] for p in out["levels"]]
    assert medians[1] < medians[0]  # the medians alone would call level 2 faster either way
