"""Where one rank's layer time goes: torch.profiler over the loopback harness of bench/layer.py,
counting only what runs inside the layer loop.

    PYTHONPATH=. python3 scripts/profile_layer.py --level 7 --prefix 0 --extend 131072 [--cp-size 8] [--rows 30]
    PYTHONPATH=. python3 scripts/profile_layer.py --device cpu --preset tiny --extend 256 --cp-size 4   # CPU dry run

The profiled run is the second of two identical runs (the first compiles the kernels). The engine
marks each chunk's layer loop with a profiler range (``engine.LAYER_LOOP_RANGE``); weight init,
input building, the prefix install and the tail fall outside it and are left out. On CUDA: every
kernel that runs on the device while the loop's work does, by kernel name, its device time
(``device_ms``, the key ``planner/elementwise.py`` reads): every kernel a runtime or driver launch
inside a loop range made (matched by CUPTI correlation id), and every kernel no recorded launch made
that starts inside the device window of those (so Triton and Gluon kernels count whichever way the
trace records their launch); a kernel launched outside the ranges never counts. On a CPU: each op's
self CPU time (``cpu_ms``), so a nested op is counted once. Prints the top ``--rows``, their sum per
layer next to the engine's per-layer times, and with ``--json`` writes every one.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, PhaseSet, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import LAYER_LOOP_RANGE, run_rank
from reference_impl.errors import ConfigError
from reference_impl.presets import preset_names
from reference_impl.tool_args import (
    MAX_LAYERS,
    ToolParser,
    choice_arg,
    device_arg,
    float_arg,
    int_arg,
    output_file,
    rank_fits,
    rank_of,
    refusing_exit,
    require_cuda,
)

PROG = "python3 scripts/profile_layer.py"


def loop_ops(events: Any, device: str) -> tuple[dict[str, float], dict[str, int], float]:
    """``(ms per name, calls per name, loop ranges' wall ms)`` of what runs inside the layer-loop
    ranges: ops by name with their self CPU time (on CUDA, the kernels ops launched; the CUDA path
    uses :func:`loop_kernels`, which also sees the driver's launches)."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == LAYER_LOOP_RANGE]
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if e.name == LAYER_LOOP_RANGE or not any(a <= e.time_range.start < b for a, b in ranges):
            continue
        if device == "cuda":
            for kernel in e.kernels:  # attached to the op that launched them: each kernel once
                ms[kernel.name] += kernel.duration / 1e3
                calls[kernel.name] += 1
        elif e.self_cpu_time_total > 0:
            ms[e.name] += e.self_cpu_time_total / 1e3
            calls[e.name] += 1
    return dict(ms), dict(calls), sum(b - a for a, b in ranges) / 1e3


@dataclass(frozen=True)
class TraceEvent:
    """One event of the raw trace: a host op or API call (``on_device=False``) or a device kernel."""

    name: str
    on_device: bool
    start_ns: int
    end_ns: int
    correlation: int  # CUPTI's link from a launch call to its kernel (0: none)


def trace_events(prof: Any) -> list[TraceEvent]:
    """The profiler's raw (Kineto) events: every launch call and every kernel, driver launches included."""
    from torch.autograd import DeviceType

    return [
        TraceEvent(
            e.name(),
            e.device_type() == DeviceType.CUDA,
            e.start_ns(),
            e.start_ns() + e.duration_ns(),
            e.correlation_id(),
        )
        for e in prof.profiler.kineto_results.events()
    ]


def _is_launch(event: TraceEvent) -> bool:
    """A CUDA runtime or driver API call (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``...):
    the host events whose correlation ids are CUPTI's (an ATen op's id is another number space)."""
    return not event.on_device and event.correlation != 0 and event.name.startswith(("cuda", "cu"))


def loop_kernels(events: Iterable[TraceEvent]) -> tuple[dict[str, float], dict[str, int], float]:
    """``(device ms per kernel name, calls per name, loop ranges' wall ms)`` of the layer loops.

    A kernel counts when a launch inside a loop range made it, or when no recorded launch made it
    (launched through a path the trace does not record) and it starts inside the device window of
    the loop's kernels. Kernels launched outside the ranges never count, nor does the device-side
    copy of the range itself (a profiler annotation, not a kernel)."""
    events = list(events)
    ranges = [(e.start_ns, e.end_ns) for e in events if e.name == LAYER_LOOP_RANGE and not e.on_device]
    inside = lambda e: any(a <= e.start_ns < b for a, b in ranges)  # noqa: E731
    launches = [e for e in events if _is_launch(e)]
    launched_in_loop = {e.correlation for e in launches if inside(e)}
    launched_elsewhere = {e.correlation for e in launches if not inside(e)}
    kernels = [e for e in events if e.on_device and e.name != LAYER_LOOP_RANGE]
    from_loop = [k for k in kernels if k.correlation in launched_in_loop]
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    if from_loop:
        start, end = min(k.start_ns for k in from_loop), max(k.end_ns for k in from_loop)
        for k in kernels:
            unlaunched = k.correlation not in launched_in_loop and k.correlation not in launched_elsewhere
            if k.correlation in launched_in_loop or (unlaunched and start <= k.start_ns < end):
                ms[k.name] += (k.end_ns - k.start_ns) / 1e6
                calls[k.name] += 1
    return dict(ms), dict(calls), sum(b - a for a, b in ranges) / 1e6


def one_rank_parser(description: str, level: int, rows: int, json_help: str, prog: str = PROG) -> ToolParser:
    """The arguments of the one-rank diagnostics (this script and ``memory_peak.py``): the preset, the
    phase level, one request ``--prefix + --extend``, rank ``--rank`` of ``--cp-size``, ``--layers``,
    the rows printed and a ``--json`` output."""
    parser = ToolParser(prog, description)
    parser.add_argument(
        "--preset", type=choice_arg(preset_names(), "preset"), default="deepseek-v3.2", help=", ".join(preset_names())
    )
    parser.add_argument("--level", type=int_arg(0, 8), default=level, help="phase level 0..8")
    parser.add_argument("--prefix", type=int_arg(0, MAX_BATCH_TOKENS), default=0, help="cached tokens of the request")
    parser.add_argument("--extend", type=int_arg(1, MAX_BATCH_TOKENS), default=131072, help="new tokens of the request")
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the rank this process plays, 0..C-1")
    parser.add_argument("--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=2, help="layers run")
    parser.add_argument("--rows", type=int_arg(1), default=rows, help="rows printed")
    parser.add_argument("--json", default=None, help=json_help)
    return parser


def one_rank_run(args: argparse.Namespace, device: str) -> RunConfig:
    """The run those arguments describe: one request, the level's phases, no oracle check."""
    return RunConfig(
        preset=args.preset,
        n_layers=args.layers,
        cp_size=args.cp_size,
        check=False,
        device=device,
        requests=(Request(args.prefix, args.extend),),
        phases=PhaseSet.level(args.level),
    )


def checked_run(args: argparse.Namespace, device: str) -> RunConfig:
    """:func:`one_rank_run`, after everything the run would refuse once started is refused naming its
    flag: the rank, the output file, the split, the device and (on a CPU) the memory."""
    from reference_impl.bench.layer import split_fits

    rank_of(args.rank, args.cp_size)
    if args.prefix + args.extend > MAX_BATCH_TOKENS:
        raise ConfigError(f"--prefix + --extend: {args.prefix + args.extend:,} tokens; at most {MAX_BATCH_TOKENS:,}")
    if args.json is not None:
        output_file(args.json, "--json")
    split_fits(args.extend, None, args.cp_size, f"--extend {args.extend}")
    try:
        run = one_rank_run(args, device)
    except ConfigError as exc:
        raise ConfigError(f"--preset {args.preset} / --layers {args.layers} / --level {args.level}: {exc}") from None
    require_cuda(device)
    rank_fits([run], args.rank, device, "--extend / --layers")
    return run


def kernel_kind(name: str) -> str:
    """The kind a profiled kernel or op belongs to: cuBLAS GEMMs by input type, each Triton kernel by
    its own name (they start with ``_``), device copies, and torch's other kernels in one group."""
    if "gemm" in name or name.startswith("nvjet"):
        return "GEMM, fp32 (cuBLAS)" if "f32f32" in name or "sgemm" in name else "GEMM, bf16 (cuBLAS)"
    if name.startswith("_"):
        return name
    if name.startswith("Memcpy"):
        return "device copies (memcpy)"
    return "torch elementwise, copy and reduction kernels"


def by_kind(ms: dict[str, float], calls: dict[str, int]) -> list[dict[str, Any]]:
    """``ms`` and ``calls`` summed by :func:`kernel_kind`, largest first, with each kind's share."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, value in ms.items():
        kind = kinds[kernel_kind(name)]
        kind[0] += value
        kind[1] += calls[name]
    total = sum(ms.values()) or 1.0
    return [
        {"kind": k, "ms": v[0], "count": int(v[1]), "share": v[0] / total}
        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])
    ]


@refusing_exit
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = one_rank_parser(
        __doc__.split("\n\n")[0], level=7, rows=30, json_help="also write every op's time and count here"
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    parser.add_argument(
        "--wire-gbps",
        type=float_arg(),
        default=None,
        help="model the interconnect, GB/s (CUDA only; default: none, no wire time)",
    )
    args = parser.parse_args(argv)
    run = checked_run(args, args.device)
    group = lambda: LoopbackGroup(args.rank, args.cp_size, args.device, args.wire_gbps)  # noqa: E731
    run_rank(group(), run)  # warm-up: compiles the kernels
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if args.device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:  # CPU ops too: their time ranges place the kernels
        result = run_rank(group(), run)
    if args.device == "cuda":
        ms, calls, loop_wall_ms = loop_kernels(trace_events(prof))
    else:
        ms, calls, loop_wall_ms = loop_ops(prof.events(), args.device)
    total = sum(ms.values())
    layer_ms = result.timings["layer_ms"]
    print(
        f"level {args.level}, {args.prefix}+{args.extend} tokens, "
        f"rank {args.rank} of C={args.cp_size} on {args.device}: "
        f"engine layer ms {[round(t, 2) for t in layer_ms]}; inside the layer loop the ops sum to "
        f"{total / args.layers:.2f} ms per layer ({'device' if args.device == 'cuda' else 'CPU'} self time)"
    )
    print(f"{'op':<70} {'calls':>7} {'ms':>9} {'share':>6}")
    for name, value in sorted(ms.items(), key=lambda kv: -kv[1])[: args.rows]:
        print(f"{name[:70]:<70} {calls[name]:>7} {value:>9.3f} {value / total:>6.1%}")
    key = "device_ms" if args.device == "cuda" else "cpu_ms"
    doc = {
        "args": vars(args),
        "layer_ms": layer_ms,
        "loop_wall_ms": loop_wall_ms,
        "loop_ops_ms_total": total,
        "ops": sorted(({"name": n, "count": calls[n], key: v} for n, v in ms.items()), key=lambda o: -o[key]),
        "by_kind": by_kind(ms, calls),
        "what": "what runs inside the engine's layer-loop ranges (weight init, inputs, prefix install and tail "
        "excluded): kernels' device time on CUDA, ops' self CPU time on a CPU; the second of two identical runs",
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
