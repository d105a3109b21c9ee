"""Every rank of one CP group at each phase level: per-layer time and memory per rank, with real collectives.

Usage::

    python -m reference_impl.bench.ranks --out FILE.json --cp-size 8 [--levels 0,7,8] \\
        [--workloads current-only:0+131072,prefix-heavy:131072+8192] [--layers 4]
    python -m reference_impl.bench.ranks --out dry.json --device cpu --preset tiny --cp-size 2 --workloads w:0+256

:mod:`reference_impl.bench.layer` plays one rank alone, its all-gathers local copies behind a
modeled wire. This benchmark runs all ``--cp-size`` ranks through the launcher
(:mod:`reference_impl.launch`): NCCL with one rank per GPU where the machine has ``cp_size`` GPUs,
gloo otherwise (ranks sharing GPUs, or on the CPU); the JSON's ``backend``, ``gpu_count`` and
``ranks_share_device`` say which ran. Each point is the engine's report for one level
(:func:`reference_impl.runner.run_prefills`, no oracle check): per rank its per-layer median, the
measured peak above what was allocated before the layer loop (CUDA), the bytes it gathered; the
point's time is the slowest rank's. All points share one launch, so the ranks start once; a
warm-up run per workload at its highest level goes first and is dropped, so no timed layer
compiles a kernel (an H200 smoke run that warmed up at level 0 only timed level 8's layers
compiling its kernels, twenty times a level-0 layer).

Beside each current-only point, the planner's prediction for its slowest rank, with the planner's
interconnect rate as the wire (:func:`reference_impl.bench.layer.planner_point`): on a multi-GPU
machine the difference between the two is what the modeled wire of ``bench.layer`` leaves out.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from typing import Any

import torch

from reference_impl.bench.layer import Workload, parse_levels, parse_workloads, planner_point, split_fits
from reference_impl.config import MAX_PLAN_CP, PhaseSet, Request, RunConfig
from reference_impl.planner import load_rates
from reference_impl.runner import run_prefills
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_LAYERS,
    ToolParser,
    device_arg,
    dsa_preset_arg,
    float_arg,
    int_arg,
    output_file,
    refusing,
    require_cuda,
)

RANK_FIELDS = (
    "rank",
    "tokens",
    "layer_ms_median",
    "tail_ms",
    "measured_peak_bytes",
    "kv_bytes",
    "index_bytes",
    "transient_peak_bytes",
    "gather_bytes",
    "materialized_bytes",
    "collectives",
)


def measure(
    preset: str,
    workloads: list[Workload],
    levels: list[int],
    cp_size: int,
    n_layers: int,
    device: str,
    timeout_s: float | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every level of every workload on all ``cp_size`` ranks, in one launch -> (how it ran, the workloads' points)."""
    runs, keys, warm_ups = [], [], []
    for workload in workloads:
        base = RunConfig(
            preset=preset,
            n_layers=n_layers,
            cp_size=cp_size,
            check=False,
            device=device,
            requests=(Request(workload.prefix, workload.extend),),
        )
        # The highest level runs every kernel the lower ones do, and more: one run of it per workload
        # compiles them at this workload's shapes before anything is timed.
        warm_ups.append(base.replace(phases=PhaseSet.level(max(levels))))
        for level in levels:
            runs.append(base.replace(phases=PhaseSet.level(level)))
            keys.append((workload, level))
    reports = run_prefills([*warm_ups, *runs], timeout_s)[len(warm_ups) :]
    wire = load_rates().interconnect_gbps
    by_workload: dict[str, dict[str, Any]] = {}
    for run, (workload, level), report in zip(runs, keys, reports):
        ranks = [{k: r.get(k) for k in RANK_FIELDS} for r in report["per_rank"]]
        point: dict[str, Any] = {
            "level": level,
            "phases": str(run.phases),
            "layer_ms_median": report["timings"]["layer_ms_median"],  # the slowest rank's
            "store_path": report["store_path"],
            "attention_kernel": report["attention_kernel"],
            "per_rank": ranks,
        }
        peaks = [r["measured_peak_bytes"] for r in ranks if r["measured_peak_bytes"] is not None]
        if peaks:
            point["measured_peak_bytes_max"] = max(peaks)
        if workload.prefix == 0:  # the planner's scenario: one request, no prefix
            predicted = max((planner_point(run, r, level, wire) for r in range(cp_size)), key=lambda p: p["layer_ms"])
            point["planner"] = {
                "layer_ms": predicted["layer_ms"],
                "peak_bytes": predicted["peak_bytes"],
                "wire_gbps": wire,
            }
            point["planner_error"] = {"layer_ms": predicted["layer_ms"] / point["layer_ms_median"] - 1}
            if peaks:
                point["planner_error"]["peak_bytes"] = predicted["peak_bytes"] / max(peaks) - 1
        entry = by_workload.setdefault(workload.name, {"workload": workload.__dict__, "levels": []})
        entry["levels"].append(point)
    first = reports[0]
    how = {"backend": first["backend"], "ranks_share_device": first["ranks_share_device"], "device": first["device"]}
    return how, list(by_workload.values())


def format_table(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['device']}: {doc['cp_size']} ranks over {doc['backend']}"
        + (" (ranks share a device)" if doc["ranks_share_device"] else "")
        + f", {doc['n_layers']} layers"
    ]
    for entry in doc["workloads"]:
        w = entry["workload"]
        lines.append(f"{w['name']} ({w['prefix']} cached + {w['extend']} new)")
        lines.append(f"{'level':>6}{'layer ms (max)':>16}{'per rank ms':>28}{'peak MiB (max)':>16}{'planner ms':>12}")
        for p in entry["levels"]:
            per_rank = " ".join(f"{r['layer_ms_median']:.2f}" for r in p["per_rank"])
            peak = p.get("measured_peak_bytes_max")
            planned = p.get("planner", {}).get("layer_ms")
            lines.append(
                f"{p['level']:>6}{p['layer_ms_median']:>16.2f}{per_rank[:27]:>28}"
                f"{'-' if peak is None else f'{peak / 2**20:,.0f}':>16}"
                f"{'-' if planned is None else f'{planned:.2f}':>12}"
            )
    return "\n".join(lines)


PROG = "python -m reference_impl.bench.ranks"


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C (processes)")
    parser.add_argument("--levels", default="0,7,8", help="phase levels: a range 0-8 or a list 0,7,8")
    parser.add_argument("--workloads", default="current-only:0+131072", help="name:prefix+extend, comma separated")
    parser.add_argument("--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=4, help="layers run")
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    parser.add_argument(
        "--timeout-s", type=float_arg(), default=None, help="bound on the launch, seconds (default: the runs' own)"
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    workloads = parse_workloads(args.workloads)
    levels = parse_levels(args.levels)
    for w in workloads:
        split_fits(w.extend, None, args.cp_size, f"--workloads {w.name}:{w.prefix}+{w.extend}")
    require_cuda(args.device)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    how, points = measure(args.preset, workloads, levels, args.cp_size, args.layers, args.device, args.timeout_s)
    doc = {
        "command": "python -m reference_impl.bench.ranks "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        **how,
        "gpu_count": torch.cuda.device_count() if args.device == "cuda" else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started": started,
        "preset": args.preset,
        "cp_size": args.cp_size,
        "n_layers": args.layers,
        "timing": "per rank: CUDA events (CPU: wall clock) per layer, median over the layers of one run after a "
        "warm-up run; a point's layer_ms_median is the slowest rank's",
        "workloads": points,
    }
    out.write_text(json.dumps(doc, indent=1))
    print(format_table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
