"""DeepSeek-V4 per-layer benchmark: one rank of ``C`` at several phase levels, V3.2 beside.

Usage::

    python -m reference_impl.bench.v4 --out docs/results/v4_h200.json          # H200: ~3 minutes
    python -m reference_impl.bench.v4 --out dry.json --device cpu --preset tiny-v4 \\
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
V3.2 figures at the same context and level (:mod:`reference_impl.planner.v4`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from reference_impl import engine
from reference_impl.bench.layer import Workload, parse_levels
from reference_impl.config import PhaseSet, Request, RunConfig, get_preset
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.families.deepseek_v4.cp.store import install_synthetic_prefixes
from reference_impl.planner.v4 import plan_v4
from reference_impl.tool_args import output_file, refusing, require_cuda
from reference_impl.bench.record import loopback_cp, run_record

DTYPE_BYTES = {"uint8": 1, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}


@contextlib.contextmanager
def synthetic_prefixes() -> Iterator[None]:
    """The engine installs prefixes as random entries (see the module docstring) inside this block."""
    real = engine.install_v4_prefixes
    engine.install_v4_prefixes = lambda run, model, inputs, store, chunk: install_synthetic_prefixes(run, store, chunk)  # type: ignore[assignment]
    try:
        yield
    finally:
        engine.install_v4_prefixes = real  # type: ignore[assignment]


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
        result = engine.run_rank(LoopbackGroup(rank, run.cp_size, device, wire_gbps), run)
        for layer, ms in enumerate(result.timings["layer_ms"][: cfg.n_layers]):
            layer_ms[layer].append(ms)
    assert result is not None
    stats = result.stats
    by_kind: dict[str, list[float]] = {}
    for layer in range(cfg.n_layers):
        by_kind.setdefault(cfg.layer_type(layer), []).append(statistics.median(layer_ms[layer]))
    return {
        "level": run.phases.max_level, "phases": str(run.phases), "store_path": result.store_path,
        "layer_ms": [statistics.median(ms) for ms in layer_ms],
        "layer_ms_by_type": {kind: statistics.median(ms) for kind, ms in by_kind.items()},
        "measured_peak_bytes": stats.get("measured_peak_bytes"),
        "transient_peak_bytes": stats["transient_peak_bytes"],
        "kv_bytes": stats["kv_bytes"], "index_bytes": stats["index_bytes"],
        **{k: stats[k] for k in ("csa_bytes", "hca_bytes", "window_bytes", "compressor_state_bytes")},
        "gather_bytes": stats["gather_bytes"], "materialized_bytes": stats["materialized_bytes"],
        "bytes_by_tag": tag_bytes(result.collectives, run.cp_size),
    }


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="deepseek-v4-flash")
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--levels", default="0,2,3,8")
    parser.add_argument("--workloads", default="128k:0+131072,1m:1040384+8192")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--wire-gbps", type=float, default=None, help="model the interconnect (CUDA only; e.g. 450)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    output_file(args.out)
    require_cuda(args.device)
    cfg = get_preset(args.preset)
    levels = parse_levels(args.levels)
    workloads = [Workload.parse(w) for w in args.workloads.split(",")]
    doc: dict[str, Any] = {
        **run_record("v4", argv, args.device),
        "preset": args.preset, "cp_size": args.cp_size, "rank": args.rank, "n_layers": args.layers,
        "layer_types": [cfg.layer_type(i) for i in range(args.layers)],
        "how_cp_runs": loopback_cp(args.rank, args.cp_size, args.wire_gbps),
        "timing": f"CUDA events per layer, median of {args.repeats} runs after a warm-up run" if args.device == "cuda"
        else "perf_counter per layer (CPU dry run: the numbers mean nothing)",
        "wire_gbps": args.wire_gbps, "workloads": [],
    }
    with synthetic_prefixes():
        for w in workloads:
            base = RunConfig(preset=args.preset, n_layers=args.layers, cp_size=args.cp_size, check=False, device=args.device,
                             requests=(Request(w.prefix, w.extend),))
            print(f"{w.name} {w.prefix}+{w.extend}: levels {levels}", file=sys.stderr, flush=True)
            engine.run_rank(LoopbackGroup(args.rank, args.cp_size, torch.device(args.device), args.wire_gbps),
                            base.replace(phases=PhaseSet.level(max(levels))))  # warm-up: compiles the kernels
            points = [measure(base.replace(phases=PhaseSet.level(level)), args.rank, args.wire_gbps, args.repeats)
                      for level in levels]
            context = w.prefix + w.extend
            planner = plan_v4(args.preset, args.cp_size, [context], levels, 48.0) if args.preset != "tiny-v4" else None
            doc["workloads"].append({"workload": w.__dict__, "context": context, "levels": points, "planner": planner})
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")  # a run cut short keeps what finished
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
