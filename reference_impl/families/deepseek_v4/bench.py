"""DeepSeek-V4 per-layer benchmark: one rank of ``C`` at several phase levels, V3.2 beside.

Usage::

    python -m reference_impl.bench.v4 --out docs/results/v4_h200.json          # H200: ~3 minutes
    python -m reference_impl.bench.v4 --out dry.json --device cpu --preset tiny-v4 --layers 3 \\
        --workloads 128k:0+1021,1m:3000+301 --levels 0,2                      # CPU dry run

**How CP runs here** (as :mod:`reference_impl.bench.layer`): one process plays rank ``--rank`` of
``--cp-size`` through :class:`~reference_impl.cp.loopback.LoopbackGroup`; every all-gather is a
local copy of the rank's own rows plus, with ``--wire-gbps``, a stream-held delay of
``bytes received / wire`` (a modeled interconnect, named in the JSON). Outputs are not checked.

**Workloads**: ``128k`` is one request of 131,072 tokens in one chunk (current only); ``1m`` is the
last 8,192-token chunk of a 1,048,576-token request: its 1,040,384-token prefix is installed as
random entries of the right shapes (:func:`~reference_impl.families.deepseek_v4.cp.store.install_synthetic_prefixes`;
computing it with the oracle would take hours, and no time or byte count depends on the values).

**Per workload and level**: each layer's time (CUDA events, median over ``--repeats`` runs after
a warm-up run), by layer type (``--layers`` of the preset: V4-Flash's first four are sliding,
sliding, CSA, HCA); the measured peak (``torch.cuda.max_memory_allocated`` above the allocations
before the layer loop); bytes at rest by part; bytes per collective tag; and the planner's V4 and
V3.2 figures at the same context and level (:mod:`~reference_impl.families.deepseek_v4.planner`).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from reference_impl import engine
from reference_impl.bench.layer import Workload, layers_arg, parse_levels, parse_workloads, split_fits
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import MAX_PLAN_CP, ConfigError, PhaseSet, Request, RunConfig, get_preset
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.families.deepseek_v4.config import V4_PRESETS
from reference_impl.families.deepseek_v4.family import DeepSeekV4Family, synthetic_prefixes
from reference_impl.families.deepseek_v4.planner import plan_v4
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_REPEATS,
    ToolParser,
    choice_arg,
    device_arg,
    float_arg,
    int_arg,
    output_file,
    rank_fits,
    rank_of,
    refusing,
    require_cuda,
)

PROG = "python -m reference_impl.bench.v4"
DTYPE_BYTES = {"uint8": 1, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}


BENCH_FAMILY = DeepSeekV4Family(prefixes=synthetic_prefixes)
"""The family the bench runs: cached prefixes installed as random entries of the right shapes and codecs
(computing a 1M-token prefix with the oracle takes hours, and no timing or byte count depends on the values)."""


def tag_bytes(collectives: list[str], cp_size: int) -> dict[str, int]:
    """Gathered-buffer bytes per collective tag (``C`` padded slots each), from a rank's record."""
    out: dict[str, int] = {}
    for entry in collectives:
        _, tag, shape, dtype = entry.split(":")
        dims = [int(v) for v in shape.strip("()").split(",") if v.strip()]
        out[tag] = out.get(tag, 0) + cp_size * math.prod(dims) * DTYPE_BYTES.get(dtype, 4)
    return out


def measure(run: RunConfig, rank: int, wire_gbps: float | None, repeats: int) -> dict[str, Any]:
    """One level of one workload: layer times by type, peak, bytes (see the module docstring)."""
    device = torch.device(run.device)
    cfg = run.model
    layer_ms: list[list[float]] = [[] for _ in range(cfg.n_layers)]
    result = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result = engine.run_rank(LoopbackGroup(rank, run.cp_size, device, wire_gbps), run, family=BENCH_FAMILY)
        for layer, ms in enumerate(result.timings["layer_ms"][: cfg.n_layers]):
            layer_ms[layer].append(ms)
    assert result is not None
    stats = result.stats
    by_kind: dict[str, list[float]] = {}
    for layer in range(cfg.n_layers):
        by_kind.setdefault(cfg.layer_type(layer), []).append(statistics.median(layer_ms[layer]))
    return {
        "level": run.phases.max_level,
        "phases": str(run.phases),
        "store_path": result.store_path,
        "layer_ms": [statistics.median(ms) for ms in layer_ms],
        "layer_ms_by_type": {kind: statistics.median(ms) for kind, ms in by_kind.items()},
        "measured_peak_bytes": stats.get("measured_peak_bytes"),
        "transient_peak_bytes": stats["transient_peak_bytes"],
        "kv_bytes": stats["kv_bytes"],
        "index_bytes": stats["index_bytes"],
        **{k: stats[k] for k in ("csa_bytes", "hca_bytes", "window_bytes", "compressor_state_bytes")},
        "gather_bytes": stats["gather_bytes"],
        "materialized_bytes": stats["materialized_bytes"],
        "bytes_by_tag": tag_bytes(result.collectives, run.cp_size),
    }


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after each workload)")
    parser.add_argument(
        "--preset",
        type=choice_arg(
            tuple(V4_PRESETS), "V4 preset", f"{', '.join(DSA_PRESETS)}: python -m reference_impl.bench.layer"
        ),
        default="deepseek-v4-flash",
        help=", ".join(V4_PRESETS),
    )
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the rank this process plays, 0..C-1")
    parser.add_argument("--levels", default="0,2,3,8", help="phase levels: a range 0-8 or a list 0,2,3,8")
    parser.add_argument(
        "--workloads", default="128k:0+131072,1m:1040384+8192", help="name:prefix+extend, comma separated"
    )
    parser.add_argument("--layers", type=int_arg(1), default=4, help="the preset's first layers (tiny-v4 has 3)")
    parser.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=2, help="timed runs per level")
    parser.add_argument(
        "--wire-gbps",
        type=float_arg(),
        default=None,
        help="model the interconnect, GB/s (CUDA only; e.g. 450; default: none, no wire time)",
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output_file(args.out)
    rank_of(args.rank, args.cp_size)
    layers_arg(args.preset, args.layers)
    cfg = get_preset(args.preset)
    levels = parse_levels(args.levels)
    workloads = parse_workloads(args.workloads)
    bases = [(w, workload_run(args.preset, w, args.layers, args.cp_size, args.device)) for w in workloads]
    require_cuda(args.device)
    runs = [base.replace(phases=PhaseSet.level(level)) for _, base in bases for level in levels]
    rank_fits(runs, args.rank, args.device, "--workloads / --layers")
    doc: dict[str, Any] = {
        **run_record("v4", argv, args.device),
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "n_layers": args.layers,
        "layer_types": [cfg.layer_type(i) for i in range(args.layers)],
        "how_cp_runs": loopback_cp(args.rank, args.cp_size, args.wire_gbps),
        "timing": f"CUDA events per layer, median of {args.repeats} runs after a warm-up run"
        if args.device == "cuda"
        else "perf_counter per layer (CPU dry run: the numbers mean nothing)",
        "wire_gbps": args.wire_gbps,
        "workloads": [],
    }
    for w, base in bases:
        print(f"{w.name} {w.prefix}+{w.extend}: levels {levels}", file=sys.stderr, flush=True)
        engine.run_rank(
            LoopbackGroup(args.rank, args.cp_size, torch.device(args.device), args.wire_gbps),
            base.replace(phases=PhaseSet.level(max(levels))),
            family=BENCH_FAMILY,
        )  # warm-up: compiles
        points = [
            measure(base.replace(phases=PhaseSet.level(level)), args.rank, args.wire_gbps, args.repeats)
            for level in levels
        ]
        context = w.prefix + w.extend
        planner = plan_v4(args.preset, args.cp_size, [context], levels, 48.0) if args.preset != "tiny-v4" else None
        doc["workloads"].append({"workload": w.__dict__, "context": context, "levels": points, "planner": planner})
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")  # a run cut short keeps what finished
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def workload_run(preset: str, w: Workload, n_layers: int, cp_size: int, device: str) -> RunConfig:
    """One workload's run (its level set later), built before anything runs: what :class:`RunConfig`
    refuses is refused up front, naming the workload."""
    what = f"--workloads {w.name}:{w.prefix}+{w.extend}"
    split_fits(w.extend, None, cp_size, what)
    try:
        return RunConfig(
            preset=preset,
            n_layers=n_layers,
            cp_size=cp_size,
            check=False,
            device=device,
            requests=(Request(w.prefix, w.extend),),
        )
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
