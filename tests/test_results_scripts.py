"""The scripts that turn docs/results into the benchmarks page's figures."""

from __future__ import annotations

from pathlib import Path

from reference_impl.planner.rates import RESULTS_DIR


def test_results_plots_render_from_the_committed_json_and_repeat_byte_for_byte(tmp_path: Path) -> None:
    """``scripts/plot_results.py`` draws the benchmarks page's SVGs from ``docs/results`` and
    writes identical bytes when run twice (no date, fixed ids), so a rerun only shows real changes."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "plot_results.py"
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run(
            [sys.executable, str(script), "--results", str(RESULTS_DIR), "--out", str(out)],
            check=True,
            capture_output=True,
        )
        outputs.append(
            {
                name: (out / name).read_bytes()
                for name in ("layer_bench.svg", "prefetch.svg", "kv_designs.svg", "long_context.svg")
            }
        )
    assert outputs[0] == outputs[1]
    assert all(svg.startswith(b"<?xml") and b"<svg" in svg for svg in outputs[0].values())


def test_the_layer_profile_counts_only_the_layer_loop(tmp_path: Path) -> None:
    """``scripts/profile_layer.py`` on CPU (tiny preset): ops that start inside the engine's
    layer-loop ranges, self times; the weight init (random-number ops) and the prefix install fall
    outside, and the ops' sum stays within the loops' wall time."""
    import json

    module = _profile_layer_module()
    out = tmp_path / "profile.json"
    doc = module.main(
        [
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--prefix",
            "64",
            "--extend",
            "128",
            "--cp-size",
            "4",
            "--level",
            "8",
            "--json",
            str(out),
        ]
    )
    names = {op["name"] for op in doc["ops"]}
    assert json.loads(out.read_text())["ops"] == doc["ops"]
    assert "aten::mm" in names or "aten::addmm" in names  # the projections run inside the loop
    assert not names & {"aten::normal_", "aten::randn", "aten::uniform_"}  # weight init is outside
    assert 0 < doc["loop_ops_ms_total"] <= doc["loop_wall_ms"] * 1.05


def _profile_layer_module():  # noqa: ANN202
    import importlib.util
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "profile_layer.py"
    spec = importlib.util.spec_from_file_location("profile_layer", script)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_cuda_profile_counts_kernels_no_aten_op_launched() -> None:
    """On CUDA the layer profile takes the device window of the kernels launched from inside the
    loop range: kernels those launches made, and kernels no recorded launch made that start inside
    their device window (Triton through the driver); never a kernel launched outside the range
    (weight init, the tail), the range's own device annotation, or an ATen op's id taken for CUPTI's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    module = _profile_layer_module()
    E = module.TraceEvent
    loop = module.LAYER_LOOP_RANGE
    events = [
        E("cudaLaunchKernel", False, 40, 45, 1),
        E("normal_ (weight init)", True, 50, 160, 1),  # launched before
        E(loop, False, 100, 200, 0),
        E(loop, True, 140, 245, 0),  # the range, and its device-side annotation
        E("aten::mm", False, 105, 115, 1),  # an ATen op's id: another number space than CUPTI's
        E("cudaLaunchKernel", False, 110, 112, 2),
        E("gemm", True, 150, 170, 2),
        E("_sparse_mla_fwd", True, 170, 230, 7),  # Triton: its driver launch is not in the trace
        E("cudaLaunchKernel", False, 190, 192, 3),
        E("norm", True, 230, 240, 3),
        E("cudaLaunchKernel", False, 300, 302, 4),
        E("tail gather", True, 300, 310, 4),  # after the loop
        E("late orphan", True, 400, 410, 8),  # no launch recorded, outside the loop's device window
    ]
    ms, calls, wall = module.loop_kernels(events)
    assert ms == {"gemm": 20 / 1e6, "_sparse_mla_fwd": 60 / 1e6, "norm": 10 / 1e6}
    assert calls == {"gemm": 1, "_sparse_mla_fwd": 1, "norm": 1} and wall == 100 / 1e6
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the raw events read on any machine
        with torch.profiler.record_function(loop):
            torch.ones(8) @ torch.ones(8)
    raw = module.trace_events(prof)
    assert any(e.name == loop and not e.on_device and e.end_ns > e.start_ns for e in raw)


def test_the_test_run_summary_reads_each_jobs_pytest_line(tmp_path: Path) -> None:
    """``scripts/summarize_test_run.py`` (what ``test.sh`` writes as summary.json on a GPU box) takes each
    job's counts and seconds from pytest's final line, keeps failures, and refuses a log that never
    reached one (a job cut short must not read as a pass)."""
    import sys

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import summarize_test_run

    (tmp_path / "gpu-tier.log").write_text("....F.\n1 failed, 69 passed, 614 deselected in 293.17s (0:04:53)\n")
    (tmp_path / "cpu-tier.log").write_text(
        "42.45s call tests/x.py::t\n614 passed, 69 skipped, 440 warnings in 385.57s\n"
    )
    summary = summarize_test_run.summarize(tmp_path, 416.0, {"device": "test"})
    assert summary["gpu_tier"] == {"failed": 1, "passed": 69, "deselected": 614, "seconds": 293.17}
    assert summary["cpu_tier"] == {"passed": 614, "skipped": 69, "failed": 0, "seconds": 385.57}
    assert "notebooks" not in summary and summary["seconds"] == 416.0
    with pytest.raises(LookupError, match="did not finish"):
        summarize_test_run.pytest_outcome("......\nTimeout\n")


def _script(name: str):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import importlib

    return importlib.import_module(name)


def test_the_memory_peak_replays_the_allocator_trace_from_the_mark() -> None:
    """``scripts/memory_peak.py``: counted from the mark as the engine's statistic counts (frees of
    older tensors lower it); the layer marks place the peak and each live allocation; the peak's
    live allocations are grouped by innermost ``reference_impl`` frame and layer; a trace without
    the mark is refused."""
    import pytest

    memory_peak = _script("memory_peak")
    ours = {"filename": "/x/reference_impl/model/attention.py", "line": 7, "name": "attend"}
    caller = {"filename": "/x/reference_impl/engine.py", "line": 3, "name": "_run_chunk"}
    torch_frame = {"filename": "/usr/lib/torch/functional.py", "line": 1, "name": "empty"}

    def alloc(addr: int, size: int, *frames: dict) -> dict:
        return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}

    def free(addr: int) -> dict:
        return {"action": "free_requested", "addr": addr}

    layer_mark = alloc(99, memory_peak.LAYER_MARKER_BYTES)
    trace = [
        alloc(1, 1000, ours),
        alloc(7, 40, caller),
        free(7),  # before the mark: the store, the input
        alloc(2, memory_peak.MARKER_BYTES),
        free(2),
        layer_mark,
        free(99),  # layer 0
        alloc(3, 300, torch_frame, ours, caller),
        alloc(4, 200, ours, caller),  # 500
        layer_mark,
        free(99),  # layer 1
        free(1),  # allocated before the mark: -1000
        alloc(5, 1100, caller),  # 600: the peak, in layer 1
        free(3),
        alloc(6, 100, caller),  # 400
    ]
    found = memory_peak.live_at_peak(trace)
    assert found["peak_bytes"] == 600 and found["peak_layer"] == 1
    assert [(s["site"], s["layer"], s["bytes"], s["count"]) for s in found["sites"]] == [
        ("reference_impl/engine.py:3 _run_chunk", 1, 1100, 1),
        ("reference_impl/model/attention.py:7 attend", 0, 500, 2),
    ]
    assert found["sites"][1]["chain"].endswith("<- reference_impl/engine.py:3 _run_chunk")
    with pytest.raises(ValueError, match="mark"):
        memory_peak.live_at_peak(trace[:1])


def test_the_memory_peak_takes_the_layer_profiles_arguments_and_refuses_a_machine_without_cuda() -> None:
    """``memory_peak.py`` parses the one-rank arguments it shares with ``profile_layer.py`` (its own
    defaults: level 8, 12 rows) into the same run, and without a CUDA device stops with a message."""
    import pytest
    import torch

    memory_peak, profile_layer = _script("memory_peak"), _script("profile_layer")
    parser = profile_layer.one_rank_parser("x", level=8, rows=12, json_help="")
    args = parser.parse_args(["--extend", "4096", "--layers", "1"])
    run = profile_layer.one_rank_run(args, "cpu")
    assert (args.level, args.rows, run.n_layers, run.check) == (8, 12, 1, False)
    assert run.requests[0].extend == 4096 and run.phases == profile_layer.PhaseSet.level(8)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            memory_peak.main(["--extend", "4096", "--layers", "1"])


def test_the_fused_kernel_profile_reads_ncu_csv_and_pairs_it_with_the_launches() -> None:
    """``scripts/profile_fused_kernels.py``: ncu's raw CSV (its own messages, the units row and
    thousands separators around it) -> one entry per kernel; each paired with the worker's launch
    in order, with DRAM bytes over the payload; a count mismatch is refused, not silently zipped."""
    import pytest

    profile = _script("profile_fused_kernels")
    names = list(profile.METRICS)
    header = ",".join(f'"{c}"' for c in ["ID", "Kernel Name", *names])
    units = ",".join(f'"{c}"' for c in ["", "", "ns", "byte", "byte", "%", "%", "", ""])
    row = ",".join(
        f'"{c}"' for c in ["0", "_store_index_kernel", "10,000", "20,000", "30,000", "55.5", "40", "16384", "3.9"]
    )
    text = f"==PROF== Connected to process\n{header}\n{units}\n{row}\n==PROF== Disconnected"
    kernels = profile.parse_ncu_csv(text)
    assert kernels == [
        {
            "kernel": "_store_index_kernel",
            "duration_ns": 10000.0,
            "dram_read_bytes": 20000.0,
            "dram_write_bytes": 30000.0,
            "dram_pct_of_peak": 55.5,
            "achieved_occupancy_pct": 40.0,
            "grid_size": 16384.0,
            "waves_per_sm": 3.9,
        }
    ]
    rows = profile.pair_rows([{"op": "store_index", "T": 8, "payload": 40000}], kernels)
    assert rows[0]["dram_bytes_over_payload"] == 1.25 and rows[0]["dram_gbps"] == 5.0
    with pytest.raises(ValueError, match="2 profiled launches but 1"):
        profile.pair_rows([{"op": "a", "payload": 1}, {"op": "b", "payload": 1}], kernels)
    assert profile.parse_ncu_csv("==PROF== no kernels\n") == []


def test_the_logits_profile_reads_ncus_details_page() -> None:
    """``scripts/profile_logits_kernel.py`` groups ncu's ``--page details`` rows by launch and section,
    numbers without their thousands separators, rule rows (no metric name) left out."""
    profile = _script("profile_logits_kernel")
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [
        '"0","_indexer_logits_kernel","Warp State Statistics","Warp Cycles Per Issued Instruction","cycle","5.92"',
        '"0","_indexer_logits_kernel","GPU Speed Of Light Throughput","Duration","ns","4,004,384"',
        '"0","_indexer_logits_kernel","SpeedOfLight","","",""',
        '"1","_indexer_logits_kernel","Occupancy","Achieved Active Warps Per SM","warp","11.92"',
    ]
    launches = profile.parse_details_csv("==PROF== Connected\n" + "\n".join([head, *rows]) + "\n==PROF== Disconnected")
    assert launches == [
        {
            "kernel": "_indexer_logits_kernel",
            "metrics": {
                "Warp State Statistics": {"Warp Cycles Per Issued Instruction (cycle)": 5.92},
                "GPU Speed Of Light Throughput": {"Duration (ns)": 4004384.0},
            },
        },
        {"kernel": "_indexer_logits_kernel", "metrics": {"Occupancy": {"Achieved Active Warps Per SM (warp)": 11.92}}},
    ]
