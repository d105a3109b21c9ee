"""The competing KV designs measured the same way: one rank of ``C`` per design and workload.

Usage::

    python -m reference_impl.bench.designs --out docs/results/kv_designs_h200.json --wire-gbps 450
        [--cp-size 8] [--rank 0] [--layers 4] [--repeats 6]
        [--workloads current-only:0+32768,current-only:0+131072,prefix-heavy:24576+8192,prefix-heavy:122880+8192]
        [--designs phases,layer-split,rotated-shard,dcp-gather]
    python -m reference_impl.bench.designs --out dry.json --device cpu --preset tiny \\
        --workloads current-only:0+96,prefix-heavy:80+48 --cp-size 4 --layers 2    # CPU dry run

**How CP runs here**: as in :mod:`reference_impl.bench.layer` -- rank ``--rank`` of ``--cp-size``
alone in one process (:class:`~reference_impl.cp.loopback.LoopbackGroup`): the rank issues exactly
the collectives it issues in a real group, each a local copy (a broadcast: the receiver writes the
bytes) plus, with ``--wire-gbps``, a stream-held delay of ``bytes received / wire_gbps``. Values
gathered from the "other ranks" are copies, so nothing is checked against the oracle here (the CPU
and GPU test tiers do that); times and memory are the rank's.

Per workload (one request of ``prefix + extend`` tokens) and design (``phases`` at level 8; each
competing design beside phases 1 and 7, the fused kernels): a warm-up round, then ``--repeats``
rounds, **interleaved**: each round runs every design once, in an order rotated per round (``ABCD``,
``BCDA``, ...), so no design always runs first and a design's round ``r`` ran beside the others'
(:mod:`reference_impl.bench.paired`). From each design's last run, per layer: bytes at rest (the
pools, and scaled to the preset's whole model), bytes moved (received by the rank's collectives),
bytes materialized (read from gathered storage to build the views), collectives, host syncs in the
layer loop, the measured peak above the pools; from every round, the layer time (CUDA events; median
over the layers of every round; ``run_ms``: per round, the median over its layers). Per pair of
designs, the paired difference of their ``run_ms`` round by round (median, min-max, quartiles) and the
verdict of :data:`reference_impl.bench.paired.RULE` ("faster" only when every round agrees on the
sign, else "within noise"); ``ranking`` lists the designs by median with the verdict against the
next. The planner's prediction for the same rank sits beside each (:mod:`reference_impl.planner.designs`),
and the design that cannot run on one GPU (a shared CUDA VMM view) is the planner's row, marked modeled.
The estimated device time is printed before anything runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench import paired
from reference_impl.bench.layer import Workload, parse_workloads, split_fits
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig, get_preset
from reference_impl.cp.designs import layer_shard_range
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import RankResult, per_layer_tags, run_rank
from reference_impl.planner.designs import design_layer, kv_bytes_at_rest, one_rank_parser
from reference_impl.planner.rates import PlannerRates, load_rates
from reference_impl.tool_args import (
    MAX_REPEATS,
    device_arg,
    float_arg,
    int_arg,
    output_file,
    rank_fits,
    rank_of,
    refusing,
    require_cuda,
)

MEASURED_DESIGNS = ("phases", "layer-split", "rotated-shard", "dcp-gather")
DEFAULT_WORKLOADS = "current-only:0+32768,current-only:0+131072,prefix-heavy:24576+8192,prefix-heavy:122880+8192"
DESIGN_PHASES = PhaseSet(frozenset({1, 7}))  # beside a competing design: narrow output, fused kernels
DEFAULT_REPEATS = 6  # the paired rule calls a winner from 5 repeats (reference_impl.bench.paired)
SETUP_S = 2.0  # per run: weights, inputs, pools, allocator warm-up (an H200 estimate)


def run_config(preset: str, design: str, workload: Workload, cp_size: int, n_layers: int, device: str) -> RunConfig:
    """The run of ``design`` on ``workload``: level 8 for the phases, phases 1 and 7 beside a design."""
    return RunConfig(
        preset=preset,
        n_layers=n_layers,
        cp_size=cp_size,
        requests=(Request(workload.prefix, workload.extend),),
        check=False,
        device=device,
        kv_design=design,
        phases=PhaseSet.level(8) if design == "phases" else DESIGN_PHASES,
    )


def _rates(wire_gbps: float | None) -> PlannerRates:
    rates = load_rates()
    return rates.override({"interconnect_gbps": wire_gbps}, "bench --wire-gbps") if wire_gbps else rates


def estimate_s(
    preset: str,
    workloads: list[Workload],
    designs: list[str],
    cp_size: int,
    rank: int,
    n_layers: int,
    repeats: int,
    wire_gbps: float | None,
) -> float:
    """Seconds of device time the benchmark should take on an H200: per run, a setup, the prefix's
    installation (the single-device oracle over the prefix: one rank of C = 1) and the layers."""
    cfg = get_preset(preset).with_layers(n_layers)
    rates = _rates(wire_gbps)
    total = 0.0
    for w in workloads:
        install = design_layer(cfg, rates, "phases", 1, 0, w.prefix)["layer_ms"] * n_layers / 1e3 if w.prefix else 0.0
        for design in designs:
            layer = design_layer(cfg, rates, design, cp_size, w.prefix, w.extend, rank)["layer_ms"]
            total += (1 + repeats) * (SETUP_S + install + 2 * n_layers * layer / 1e3)  # 2x: launch overheads
    return total


def _per_layer_moved(group: LoopbackGroup, run: RunConfig, n_layers: int) -> tuple[float, float, float]:
    """``(bytes received, of them history / design gathers, collectives)`` per layer of one run."""
    layer = [s for s in group.stats if s.tag in per_layer_tags(run)]
    history = [s for s in layer if s.tag not in ("kv", "index_k")]
    return (
        sum(s.bytes_received for s in layer) / n_layers,
        sum(s.bytes_received for s in history) / n_layers,
        len(layer) / n_layers,
    )


def run_once(
    preset: str,
    design: str,
    workload: Workload,
    cp_size: int,
    rank: int,
    n_layers: int,
    device: str,
    wire_gbps: float | None,
) -> tuple[RankResult, LoopbackGroup]:
    """One run of ``design`` on ``workload`` by rank ``rank`` alone (a fresh loopback group)."""
    dev = torch.device(device)
    run = run_config(preset, design, workload, cp_size, n_layers, dev.type)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    group = LoopbackGroup(rank, cp_size, dev, wire_gbps)
    return run_rank(group, run), group


def design_row(
    preset: str,
    design: str,
    workload: Workload,
    cp_size: int,
    rank: int,
    n_layers: int,
    device: str,
    last: tuple[RankResult, LoopbackGroup],
    layer_ms: list[float],
    run_ms: list[float],
) -> dict[str, Any]:
    """One design's JSON row: counts from its ``last`` run; times from its timed runs (``layer_ms``: every
    layer of every run; ``run_ms``: per run, the median over its layers, in repeat order)."""
    result, group = last
    run = run_config(preset, design, workload, cp_size, n_layers, torch.device(device).type)
    stats = result.stats
    moved, history, collectives = _per_layer_moved(group, run, n_layers)
    pool = stats["kv_bytes"] + stats["index_bytes"]
    cfg = get_preset(preset)
    held, model_held = (  # layers whose KV this rank keeps: here, and in the preset's whole model
        (
            len(range(*layer_shard_range(rank, cp_size, n_layers))),
            len(range(*layer_shard_range(rank, cp_size, cfg.n_layers))),
        )
        if design == "layer-split"
        else (n_layers, cfg.n_layers)
    )
    samples = layer_ms or result.timings["layer_ms"]
    return {
        "design": design,
        "status": "measured",
        "phases": sorted(run.phases.enabled),
        "layer_ms": statistics.median(samples),
        "layer_ms_all": layer_ms,
        "run_ms": run_ms,
        "run_ms_spread": paired.spread(run_ms) if run_ms else None,
        "kv_bytes_pools": pool,
        "layers_held": held,
        # the pools scaled to the preset's whole model: bytes per layer held x the layers held there
        "kv_bytes_at_rest": pool // held * model_held
        if held
        else kv_bytes_at_rest(cfg, design, workload.prefix + workload.extend, cp_size, rank),
        "bytes_moved_per_layer": moved,
        "history_bytes_moved_per_layer": history,
        "bytes_materialized_per_layer": stats["materialized_bytes"] / n_layers,
        "collectives_per_layer": collectives,
        "host_syncs_per_layer": stats.get("host_syncs_in_layer_loop", 0) / n_layers,
        "host_sync_audit": result.host_sync_audit,
        "transient_bytes": stats["transient_peak_bytes"],
        "peak_bytes": stats.get("measured_peak_bytes"),
        "store_path": result.store_path,
        "tail_ms": result.timings["tail_ms"],
    }


def compare_designs(designs: list[str], run_ms: dict[str, list[float]]) -> dict[str, Any]:
    """Every pair of designs compared repeat by repeat (:func:`reference_impl.bench.paired.compare`), and
    the designs ranked by their median run time, each with the verdict against the next."""
    comparisons = [paired.compare(a, run_ms[a], b, run_ms[b]) for i, a in enumerate(designs) for b in designs[i + 1 :]]
    medians = {d: statistics.median(run_ms[d]) for d in designs if run_ms[d]}
    return {"comparisons": comparisons, "ranking": paired.ranking(medians, comparisons)}


def measure(
    preset: str,
    workloads: list[Workload],
    designs: list[str],
    cp_size: int,
    rank: int,
    n_layers: int,
    device: str,
    wire_gbps: float | None,
    repeats: int,
    out: Path | None = None,
    doc: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every design at every workload -> the results document (rewritten to ``out`` after each workload).

    Per workload: one untimed warm-up run of each design, then ``repeats`` rounds, each running every
    design once in an order rotated per round (:func:`reference_impl.bench.paired.rotations`), so a
    design's repeat ``r`` ran beside the others' repeat ``r``."""
    doc = doc if doc is not None else {}
    doc["workloads"] = []
    cfg = get_preset(preset).with_layers(n_layers)
    rates = _rates(wire_gbps)
    for w in workloads:
        print(f"{w.name} {w.prefix}+{w.extend}: {', '.join(designs)}", file=sys.stderr, flush=True)

        def once(design: str, w: Workload = w) -> tuple[RankResult, LoopbackGroup]:
            return run_once(preset, design, w, cp_size, rank, n_layers, device, wire_gbps)

        last = {design: once(design) for design in designs}  # the warm-up round
        layer_ms: dict[str, list[float]] = {d: [] for d in designs}
        run_ms: dict[str, list[float]] = {d: [] for d in designs}
        orders = paired.rotations(designs, repeats)
        for order in orders:
            for design in order:
                last[design] = once(design)
                times = last[design][0].timings["layer_ms"]
                layer_ms[design] += times
                run_ms[design].append(statistics.median(times))
        rows = []
        for design in designs:
            row = design_row(
                preset, design, w, cp_size, rank, n_layers, device, last[design], layer_ms[design], run_ms[design]
            )
            row["planner"] = design_layer(cfg, rates, design, cp_size, w.prefix, w.extend, rank)
            rows.append(row)
        rows.append(design_layer(cfg, rates, "shared-vmm", cp_size, w.prefix, w.extend, rank))  # modeled
        doc["workloads"].append(
            {
                "name": w.name,
                "prefix": w.prefix,
                "extend": w.extend,
                "designs": rows,
                "orders": orders,
                **compare_designs(designs, run_ms),
            }
        )
        if out is not None:
            out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


PROG = "python -m reference_impl.bench.designs"


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = one_rank_parser(PROG, __doc__.split("\n\n")[0], 4, "layers run (the layer bench's slice)")
    parser.add_argument(
        "--repeats",
        type=int_arg(1, MAX_REPEATS),
        default=DEFAULT_REPEATS,
        help=f"timed rounds after a warm-up round, the designs interleaved (a verdict needs {paired.MIN_REPEATS}+)",
    )
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="name:prefix+extend, comma separated")
    parser.add_argument("--designs", default=",".join(MEASURED_DESIGNS), help="comma separated")
    parser.add_argument(
        "--wire-gbps",
        type=float_arg(),
        default=None,
        help="model the interconnect, GB/s (CUDA only; default: none, no wire time)",
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    args = parser.parse_args(argv)
    out = output_file(args.out)
    rank_of(args.rank, args.cp_size)
    workloads = parse_workloads(args.workloads)
    designs = [d.strip() for d in args.designs.split(",")]
    if any(d not in MEASURED_DESIGNS for d in designs) or len(set(designs)) < len(designs):
        raise ConfigError(f"--designs {args.designs!r}: measure from {', '.join(MEASURED_DESIGNS)}")
    runs = []
    for w in workloads:
        what = f"--workloads {w.name}:{w.prefix}+{w.extend}"
        split_fits(w.extend, None, args.cp_size, what)
        for design in designs:
            try:
                runs.append(run_config(args.preset, design, w, args.cp_size, args.layers, args.device))
            except ConfigError as exc:
                raise ConfigError(f"{what}, design {design}: {exc}") from None
    require_cuda(args.device)
    rank_fits(runs, args.rank, args.device, "--workloads / --layers")
    estimate = estimate_s(
        args.preset, workloads, designs, args.cp_size, args.rank, args.layers, args.repeats, args.wire_gbps
    )
    print(f"estimated device time on an H200: {estimate:.0f} s", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "kind": "measured",
        **run_record("designs", argv, args.device),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("DSACP_")},
        "how_cp_runs": loopback_cp(args.rank, args.cp_size, args.wire_gbps, "collectives"),
        "timing": (
            f"CUDA events per layer; {args.repeats} round(s) after a warm-up round, each running every design once "
            "in an order rotated per round; layer ms: the median over the layers of every round; run ms: per "
            "round, the median over its layers"
            if args.device == "cuda"
            else "perf_counter per layer (CPU dry run: the numbers mean nothing)"
        ),
        "protocol": "paired",
        "rule": paired.RULE,
        "preset": args.preset,
        "model_layers": get_preset(args.preset).n_layers,
        "n_layers": args.layers,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "wire_gbps": args.wire_gbps,
        "repeats": args.repeats,
        "estimated_s": estimate,
    }
    start = time.perf_counter()
    measure(
        args.preset,
        workloads,
        designs,
        args.cp_size,
        args.rank,
        args.layers,
        args.device,
        args.wire_gbps,
        args.repeats,
        out,
        doc,
    )
    doc["wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} in {doc['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
