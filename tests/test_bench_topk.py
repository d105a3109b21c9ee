"""``bench.topk`` (the top-k selection's three kernels, ``torch.topk`` and a config sweep) run dry on a
CPU: its own file, so pytest-xdist's per-file scheduling runs it beside the selection's tests."""

from __future__ import annotations


def test_the_topk_bench_runs_dry_on_cpu(tmp_path, monkeypatch) -> None:
    """``bench.topk``'s script logic at toy sizes under the interpreter: the default config and a
    one-candidate sweep, each checked exact and timed per kernel."""
    import json

    from reference_impl.bench import topk

    monkeypatch.setattr(topk, "SWEEP", [{"bound_steps": 4, "segment_keys": 16}])
    out = tmp_path / "topk.json"
    argv = [
        "--device",
        "cpu",
        "--context",
        "64",
        "--cp-size",
        "2",
        "--topk",
        "8",
        "--index-heads",
        "2",
        "--index-dim",
        "32",
    ]
    assert topk.main([*argv, "--sweep", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"]["rows"] == 32 and result["torch_topk_ms"] > 0
    for row in (result["default"], result["fused_bound"], *result["sweep"]):
        assert row["exact"] and set(row["kernel_ms"]) == {"bound", "compact", "finish"} and row["select_ms"] > 0
        assert sum(row["rows_per_path"]) == 32
    assert result["fused_bound"]["fused_bound"] and not result["default"]["fused_bound"]
    assert result["logits_ms"]["plain"] > 0 and result["logits_ms"]["with_maxima"] > 0
    assert result["sweep"][0]["config"]["bound_steps"] == 4
