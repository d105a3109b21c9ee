"""The long-context benchmark and the planner's model of a chunked prefill, on a CPU.

The benchmark (``python -m reference_impl.bench.long_context``) runs dry at tiny scale and writes
the JSON the docs render from; the planner's transient bytes of a later chunk (a prefix) equal
what the engine counts; every level of ``bench.layer`` is warmed before it is timed.
"""

from __future__ import annotations

import json

import pytest
import torch

from reference_impl.bench import layer as layer_bench
from reference_impl.bench.long_context import chunk_contexts, last_prefix, local_positions, main
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank
from reference_impl.planner import local_queries, transient_bytes
from reference_impl.presets import get_preset


def test_chunks_and_the_last_chunks_queries() -> None:
    assert chunk_contexts(1000, 256) == [256, 512, 768, 1000] and chunk_contexts(256, 256) == [256]
    assert last_prefix(1000, 256) == 768 and last_prefix(1024, 256) == 768 and last_prefix(200, 256) == 0
    pos = local_positions(1 << 20, 131072, 8, 64, 8, 0)
    assert pos.numel() == 16384 == local_queries(1 << 20, 8, 64, 8, 0, prefix=917504)
    assert int(pos[0]) == 917504 and int(pos[-1]) == (1 << 20) - 1  # blocks 0 and 15 of the last chunk


@pytest.mark.parametrize("level", [0, 3, 7, 8])
def test_planner_transient_of_a_later_chunk_equals_the_engines(level: int) -> None:
    """A 512-token request in two chunks: the engine's transient count (its largest chunk, the
    second: 256 history tokens) is the planner's for ``prefix=256``."""
    run = RunConfig(
        preset="tiny",
        cp_size=2,
        requests=(Request(0, 512),),
        chunk_size=256,
        n_layers=1,
        check=False,
        device="cpu",
        phases=PhaseSet.level(level),
    )
    stats = run_rank(LoopbackGroup(0, 2, torch.device("cpu")), run).stats
    want = transient_bytes(get_preset("tiny"), 512, level, "fp8", 64, act_bytes=4, cp_size=2, prefix=256)
    assert stats["transient_peak_bytes"] == want


def test_the_long_context_bench_runs_dry_on_cpu(tmp_path) -> None:
    out = tmp_path / "long.json"
    args = [
        "--out",
        str(out),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--contexts",
        "256,512",
        "--chunk",
        "256",
        "--cp-size",
        "2",
        "--layers",
        "2",
        "--levels",
        "0,8",
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["chunk_tokens"] == 256 and doc["local_queries_per_chunk"] == 128 and doc["planner_estimate_s"] >= 0
    assert [r["context"] for r in doc["runs"]] == [256, 512]
    longest = doc["runs"][1]
    assert longest["prefix_of_last_chunk"] == 256 and longest["components"]["T_local"] == 128
    for point in longest["levels"]:
        assert point["chunk_contexts"] == [256, 512]
        assert [len(c) for c in point["chunk_layer_ms"]] == [2, 2]
        assert point["planner_error"]["kv_bytes"] == 0  # the pools hold every chunk's tokens, as planned
        assert point["kv_bytes"] > 0 and point["planner"]["terms_ms"]["indexer_logits"] > 0
        assert "other_ms" in point
    assert set(doc["transient_ratio_longest_over_shortest"]) == {"0", "8"}
    assert [row["context"] for row in doc["table"]] == [256, 512] and doc["table_level"] == 8
    assert {
        "level_0_ms",
        "level_8_ms",
        "planner_level_8_ms",
        "prefill_ms_per_layer",
        "peak_gib",
        "attention_ms",
    } <= set(doc["table"][1])


def test_bench_layer_warms_every_level_before_timing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up round runs every level untimed before the first timed round (a level-7 layer was once
    timed with the compiler in it, 721 ms beside 5.6 ms)."""
    calls: list[tuple[str, int, bool]] = []
    real = layer_bench._run

    def spy(
        run: RunConfig, group: object, keep_store: bool = False, empty_cache: bool = True, prebuilt: object = None
    ) -> object:
        calls.append((str(run.phases), run.model.n_layers, empty_cache))
        return real(run, group, keep_store=keep_store, empty_cache=empty_cache, prebuilt=prebuilt)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_bench, "_run", spy)
    layer_bench.measure("tiny", layer_bench.Workload("w", 64, 64), [7, 8], 2, 0, 3, "cpu", None, prefetch_repeats=1)
    l7, l8 = str(PhaseSet.level(7)), str(PhaseSet.level(8))
    assert calls[:4] == [(l7, 2, True), (l8, 2, True), (l7, 3, False), (l8, 3, False)]


def test_the_h200_run_is_replanned_and_the_planner_is_within_its_bar() -> None:
    """``docs/results/long_context_h200.json``: its planner fields are today's planner (re-run
    ``python -m reference_impl.bench.long_context --replan`` after a planner change), each layer time
    within 30% of the measured, and the transient at the longest context within 1.5x the shortest's."""
    from pathlib import Path

    from reference_impl.bench.long_context import replan
    from reference_impl.figures import same_up_to_rounding

    path = Path(__file__).resolve().parent.parent / "docs" / "results" / "long_context_h200.json"
    committed = json.loads(path.read_text())
    assert same_up_to_rounding(replan(json.loads(path.read_text())), committed), "stale planner fields: --replan"
    assert committed["contexts"][-1] >= 1_048_576
    for run in committed["runs"]:
        for point in run["levels"]:
            assert abs(point["planner_error"]["last_chunk_layer_ms"]) <= 0.30, (run["context"], point["level"])
    assert all(ratio <= 1.5 for ratio in committed["transient_ratio_longest_over_shortest"].values())


def test_the_planner_reads_a_later_chunks_prefix() -> None:
    """A later chunk of a 1M-token prefill costs what its 917,504 cached tokens add (the indexer scores
    them all), not what the chunk alone would: the planner is given the prefix by name."""
    run = RunConfig(
        preset="deepseek-v3.2",
        n_layers=2,
        cp_size=8,
        requests=(Request(0, 1_048_576),),
        chunk_size=131_072,
        check=False,
        device="cpu",
        phases=PhaseSet.level(8),
    )
    last = layer_bench.planner_point(run, 0, 8, None, prefix=917_504, context=1_048_576)
    first = layer_bench.planner_point(run, 0, 8, None, prefix=0, context=131_072)
    assert last["terms_ms"]["indexer_logits"] > 6 * first["terms_ms"]["indexer_logits"]
