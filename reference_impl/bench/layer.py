"""End-to-end per-layer benchmark: one rank of ``C`` at every phase level, next to the planner.

Usage::

    python -m reference_impl.bench.layer --out FILE.json [--cp-size 8] [--rank 0] [--levels 0-8]
        [--workloads current-only:0+131072,prefix-heavy:65536+8192] [--layers 4] [--wire-gbps 450]
        [--split-modes in-seq,round-robin]
    python -m reference_impl.bench.layer --out dry.json --device cpu --preset tiny   # CPU dry run
    python -m reference_impl.bench.layer --replan docs/results/layer_bench.json     # re-check the planner

**How CP runs here.** One process plays rank ``--rank`` of ``--cp-size`` through
:class:`~reference_impl.cp.loopback.LoopbackGroup`: the rank launches exactly what it launches in
a real group (same collective sequence and byte counts, tested against gloo ranks), but each
all-gather is a local copy, plus, with ``--wire-gbps``, a stream-held delay of
``bytes received / wire_gbps`` that models the interconnect. Gathered values are copies of the
rank's own rows, so outputs are not checked (``check=False``); the timings and memory are the
rank's. The figures are those of one rank of a CP group **modeled on one GPU**.

Per workload (one request ``prefix + extend`` tokens, DeepSeek-V3.2 dims, ``--layers`` layers): a
warm-up round (:func:`warm_up`, every level once), then ``--level-repeats`` rounds, **interleaved**:
each round runs every level once, in an order rotated per round (``0..8``, ``1..8 0``, ...;
:mod:`reference_impl.bench.paired`), so no level always runs first and level ``a``'s round ``r`` ran
beside level ``b``'s, under the same clocks and temperature. Per level: the per-layer times (CUDA
events around each layer; ``layer_ms_median``, the median over the layers of every round; ``run_ms``,
per round, the median over its layers, with its median, min-max and quartiles), KV at rest per rank
(the pools' bytes), the engine's transient count and the measured peak of
``torch.cuda.max_memory_allocated`` during the prefill, the data-movement byte counts, and the
planner's prediction for the same rank, level and context (current-only workloads: the planner's
scenario) with the relative error. Per comparison the pages draw (each level against the one before,
each level against the first; :func:`level_pairs`): the paired difference of ``run_ms`` round by round
and the verdict of :data:`reference_impl.bench.paired.RULE` ("faster" only when every round agrees on
the sign over at least 5 rounds, else "within noise"). The model and the inputs are built once per
workload and shared by every timed run (a level changes neither); each run builds its own store,
since the prefill it times writes into it and its peak is measured above it.

Phase 8: for each workload with a prefix, levels 7 and 8 then run alternately ``--prefetch-repeats``
times more, and each level's layer time is the median over those runs' layers after the first (the
first layer of a run has no layer ahead of it to hide behind). The prefetch payload (one layer's
history MLA rows: all-gather + unpack into a view buffer,
:meth:`~reference_impl.cp.kv_sharded.ShardedKV.materialize_history_mla`) is timed alone on the
main stream, and ``hidden_fraction = (layer_ms[7] - layer_ms[8]) / payload_ms`` is the share of
the history materialization that the prefetch removed from the layer. A second, direct measure:
the main stream's stall at each consume (CUDA events on both sides of the wait,
:meth:`~reference_impl.cp.prefetch.MlaPrefetcher.exposed_wait_ms`), and
``hidden_fraction_direct = 1 - median stall / payload_ms``. The stall misses what the side stream
costs the main stream's kernels by sharing the GPU; the layer difference includes it, but carries
the run-to-run noise of two medians; ``hidden_fraction_paired`` takes the median over repeats of
each repeat's level 7 minus level 8 median layer (the two runs of a repeat are back to back), which
cancels drifts slower than a repeat.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench import paired
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import (
    MAX_BATCH_TOKENS,
    MAX_PLAN_CP,
    SPLIT_MODES,
    ConfigError,
    PhaseSet,
    Request,
    RunConfig,
    get_preset,
)
from reference_impl.cp.capacity import kv_bytes_per_rank
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank
from reference_impl.planner import layer_terms, load_rates
from reference_impl.planner.model import activation_bytes, local_queries, transient_bytes
from reference_impl.planner.plan import MAX_CONTEXT
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_LAYERS,
    MAX_REPEATS,
    OPTIONAL_NUMBER,
    OPTIONAL_POSITIVE,
    POSITIVE,
    ToolParser,
    choice_field,
    device_arg,
    dsa_preset_arg,
    float_arg,
    input_json,
    int_arg,
    int_field,
    int_list,
    output_file,
    rank_fits,
    rank_of,
    refusing,
    require_cuda,
    stored_fields,
)
from reference_impl.workload import build_inputs, build_model

PROG = "python -m reference_impl.bench.layer"
DEFAULT_ROUNDS = 5
"""Rounds of the command line: the fewest from which :mod:`reference_impl.bench.paired` calls a level faster
(chance agreement 6.25%). The default workloads then take about five minutes on an H200: each run of a
prefix-heavy workload first prefills its 131,072-token prefix on the device (about two seconds), and 2 x 9
levels x 6 runs (a warm-up and five rounds), plus the phase-8 alternation, are most of it."""


@dataclass(frozen=True)
class Workload:
    """One request of ``prefix`` cached and ``extend`` new tokens."""

    name: str
    prefix: int
    extend: int

    @classmethod
    def parse(cls, spec: str, flag: str = "--workloads") -> Workload:
        """``name:prefix+extend``, e.g. ``prefix-heavy:65536+8192``; the error names ``flag``."""
        try:
            name, sizes = spec.split(":")
            prefix, extend = (int(v) for v in sizes.split("+"))
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: expected name:prefix+extend, e.g. current-only:0+131072") from None
        if not name.strip() or prefix < 0 or extend < 1 or prefix + extend > MAX_BATCH_TOKENS:
            raise ConfigError(
                f"{flag} {spec!r}: need a name, prefix >= 0, extend >= 1 and prefix + extend at most "
                f"{MAX_BATCH_TOKENS:,} tokens"
            )
        return cls(name, prefix, extend)


def parse_workloads(spec: str, flag: str = "--workloads") -> list[Workload]:
    """Comma-separated ``name:prefix+extend`` workloads (at least one)."""
    return [Workload.parse(part.strip(), flag) for part in spec.split(",")]


def parse_levels(spec: str, flag: str = "--levels") -> list[int]:
    """``0-8`` or ``0,2,7,8`` -> sorted distinct levels within 0..8; the error names ``flag``."""
    if "-" in spec:
        lo, _, hi = spec.partition("-")
        bounds = int_list(f"{lo},{hi}", flag, 0, 8)
        if bounds[0] > bounds[1]:
            raise ConfigError(f"{flag} {spec!r}: the range runs downward")
        return list(range(bounds[0], bounds[1] + 1))
    return sorted(set(int_list(spec, flag, 0, 8)))


def layers_arg(preset: str, layers: int, flag: str = "--layers", preset_flag: str = "--preset") -> int:
    """``layers`` when a bench can run that many of ``preset``'s layers: a V4 preset's own count at
    most (each layer has its compress ratio); a DSA preset repeats its layer, up to :data:`MAX_LAYERS`."""
    repeats = preset in DSA_PRESETS  # a DSA preset's layers are alike; another family's each have their own type
    most = MAX_LAYERS if repeats else get_preset(preset).n_layers
    if layers > most:
        why = (
            f"{preset_flag} {preset} has {most} layers"
            if not repeats
            else f"at most {MAX_LAYERS} (more than any preset's)"
        )
        raise ConfigError(f"{flag} {layers}: {why}")
    return layers


def split_fits(extend: int, chunk: int | None, cp_size: int, what: str) -> None:
    """Refuse one request of ``extend`` new tokens, prefilled in chunks of ``chunk`` (``None``: one),
    whose smallest chunk leaves one of ``cp_size`` ranks without a token (either split needs a token
    per rank): what the engine refuses once it runs, said before anything starts."""
    step = chunk or extend
    smallest = extend % step or step
    if smallest < cp_size:
        which = "its last chunk holds" if smallest < extend else "it holds"
        raise ConfigError(
            f"{what}: {which} {smallest:,} new tokens, fewer than the {cp_size} ranks (--cp-size): every rank needs one"
        )


def _run(
    run: RunConfig,
    group: LoopbackGroup,
    keep_store: bool = False,
    empty_cache: bool = True,
    prebuilt: tuple[Any, list[torch.Tensor]] | None = None,
) -> Any:
    if empty_cache and group.device.type == "cuda":
        torch.cuda.empty_cache()
    return run_rank(group, run, keep_store=keep_store, prebuilt=prebuilt)


def payload_ms(store: ShardedKV, n_layers: int, device: torch.device) -> float | None:
    """Median ms of one layer's prefetch payload (history MLA rows), alone on the current stream."""
    if store.page_gather is None:
        return None
    times = []
    kv = store.new_view_kv()
    for layer in range(n_layers):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            store.materialize_history_mla(layer, kv)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            store.materialize_history_mla(layer, kv)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def warm_up(run: RunConfig, group: LoopbackGroup) -> None:
    """One untimed run of ``run``'s level before it is timed: each level runs kernels of its own
    (level 7 materializes the history in the layer, level 8 on a side stream), and a level timed
    without its own warm-up records its first layers with the compiler's time in them (721 ms
    beside 5.6 ms layers, once). At most two layers (enough for the prefetch's alternation); the
    allocator keeps the blocks for the timed run that follows."""
    _run(run.replace(n_layers=min(run.model.n_layers, 2)), group)


def planner_point(
    run: RunConfig, rank: int, level: int, wire_gbps: float | None, prefix: int = 0, context: int | None = None
) -> dict[str, Any]:
    """The planner's per-layer terms and memory for this rank: its scenario (one request in one
    chunk, no prefix) by default; with ``prefix`` and ``context``, the chunk of ``context - prefix``
    tokens after ``prefix`` cached ones (a chunked prefill's later chunk)."""
    cfg = run.model
    rates = load_rates()
    if wire_gbps is not None:
        rates = rates.override({"interconnect_gbps": wire_gbps}, "bench --wire-gbps")
    context = run.requests[0].total if context is None else context
    terms = layer_terms(
        get_preset(run.preset),
        rates,
        run.cp_size,
        context,
        level,
        rank,
        run.kv_dtype,
        run.page_size,
        run.split_mode,
        prefix=prefix,
    )
    if wire_gbps is None:  # no modeled wire: the loopback copy is all that runs
        terms = {**terms, "allgather1": 0.0, "materialize_comm": 0.0}
    t_local = local_queries(context, run.cp_size, run.page_size, level, rank, run.split_mode, prefix)
    interleave = run.interleave if level >= 2 else None
    transient = transient_bytes(
        cfg, context, level, run.kv_dtype, run.page_size, cp_size=run.cp_size, interleave=interleave, prefix=prefix
    )
    return {
        "layer_ms": sum(terms.values()),
        "terms_ms": terms,
        "kv_bytes": kv_bytes_per_rank(
            cfg, context, run.cp_size, level >= 2, run.kv_dtype, run.page_size, rank, interleave
        ),
        "transient_bytes": transient,
        "peak_bytes": transient + activation_bytes(cfg, t_local, context),
    }


def _planner_fields(point: dict[str, Any], run: RunConfig, rank: int, wire_gbps: float | None) -> None:
    """Put the planner's prediction for ``point``'s level and its relative errors into ``point``."""
    predicted = planner_point(run, rank, point["level"], wire_gbps)
    point["planner"] = predicted
    point["planner_error"] = {
        "layer_ms": predicted["layer_ms"] / point["layer_ms_median"] - 1,
        "kv_bytes": predicted["kv_bytes"] / point["kv_bytes"] - 1,
        "transient_bytes": predicted["transient_bytes"] / point["transient_peak_bytes"] - 1,
    }
    if point.get("measured_peak_bytes"):
        point["planner_error"]["peak_bytes"] = predicted["peak_bytes"] / point["measured_peak_bytes"] - 1


def replan(doc: dict[str, Any]) -> dict[str, Any]:
    """Re-evaluate the current planner against a stored run's measurements (pure arithmetic: no
    device needed). The measured fields are untouched; ``planner`` / ``planner_error`` are replaced
    and ``planner_replanned`` records that they no longer come from the measuring run."""
    for w in doc["workloads"]:
        wl = w["workload"]
        if wl["prefix"]:
            continue  # the planner's scenario is current-only
        mode = w.get("split_mode", "in-seq")
        for point in w["levels"]:
            run = RunConfig(
                preset=doc["preset"],
                n_layers=doc["n_layers"],
                cp_size=doc["cp_size"],
                check=False,
                device="cpu",
                requests=(Request(0, wl["extend"]),),
                phases=phases_at(point["level"], mode),
                split_mode=mode,
            )
            _planner_fields(point, run, doc["rank"], doc["wire_gbps"])
    doc["planner_replanned"] = (
        "planner fields recomputed by `python -m reference_impl.bench.layer --replan` "
        "with the planner and rates of the working tree; measurements unchanged"
    )
    return doc


def phases_at(level: int, split_mode: str) -> PhaseSet:
    """Level ``level``'s phases for ``split_mode`` (round-robin drops the in-seq phases 4 and 5)."""
    return PhaseSet.level(level).for_split(split_mode)


def level_name(level: int) -> str:
    """A level as :func:`reference_impl.bench.paired.compare` names it: its verdict reads "level 7 faster"."""
    return f"level {level}"


def level_pairs(levels: list[int]) -> list[tuple[int, int]]:
    """The comparisons the pages draw, ``(a, b)`` read as "level a against level b": each level against the one
    before it (what a phase adds), and each later level against the first (what the phases add up to)."""
    pairs = [(b, a) for a, b in zip(levels, levels[1:])]
    return pairs + [(k, levels[0]) for k in levels[2:]]


def compare_levels(levels: list[int], run_ms: dict[int, list[float]]) -> list[dict[str, Any]]:
    """:func:`level_pairs`, each compared round by round (:func:`reference_impl.bench.paired.compare`)."""
    return [paired.compare(level_name(a), run_ms[a], level_name(b), run_ms[b]) for a, b in level_pairs(levels)]


def measure(
    preset: str,
    workload: Workload,
    levels: list[int],
    cp_size: int,
    rank: int,
    n_layers: int,
    device: str,
    wire_gbps: float | None,
    prefetch_repeats: int = 6,
    level_repeats: int = 1,
    on_level: Callable[[int], None] | None = None,
    split_mode: str = "in-seq",
) -> dict[str, Any]:
    """Every level of one workload on one rank -> JSON-ready dict.

    A warm-up round (:func:`warm_up`, every level once), then ``level_repeats`` rounds, **interleaved**:
    each round runs every level once, in an order rotated per round
    (:func:`reference_impl.bench.paired.rotations`: ``0..8``, ``1..8 0``, ...), so no level always runs
    first and level ``a``'s round ``r`` ran beside level ``b``'s. Per level: ``run_ms``, each round's
    median over its layers, in round order, and its spread; ``layer_ms_median``, the median over the
    layers of every round (short, launch-bound layers vary more between runs than within one). Per
    pair of :func:`level_pairs`, the paired difference of ``run_ms`` round by round and its verdict
    (``comparisons``). Memory and byte counts are the first round's (they repeat exactly). The model
    and the inputs are built once and shared by every timed run (the level changes neither); each run
    builds its own store, since the prefill it times writes into it. ``on_level(level)`` is called
    after each level's last round (progress).
    """
    dev = torch.device(device)
    group_of = lambda: LoopbackGroup(rank, cp_size, dev, wire_gbps)  # noqa: E731 (fresh stats per run)
    base = RunConfig(
        preset=preset,
        n_layers=n_layers,
        cp_size=cp_size,
        requests=(Request(workload.prefix, workload.extend),),
        check=False,
        device=dev.type,
        split_mode=split_mode,
    )
    runs = {level: base.replace(phases=phases_at(level, split_mode)) for level in levels}
    for level in levels:
        warm_up(runs[level], group_of())
    built = (build_model(base, dev), build_inputs(base, dev))
    orders = paired.rotations(levels, level_repeats)
    points: dict[int, dict[str, Any]] = {}
    run_ms: dict[int, list[float]] = {level: [] for level in levels}
    for r, order in enumerate(orders):
        for level in order:
            run = runs[level]
            # The caching allocator keeps its blocks between runs: a fresh cache makes the first layers of
            # every run pay for cudaMalloc, noise larger than what a phase changes in a short layer.
            result = _run(run, group_of(), keep_store=r == 0 and level == 8, empty_cache=False, prebuilt=built)
            times = list(result.timings["layer_ms"])
            run_ms[level].append(statistics.median(times))
            if r == 0:
                stats = result.stats
                points[level] = {
                    "level": level,
                    "phases": str(run.phases),
                    "layer_ms": [],
                    "tail_ms": result.timings["tail_ms"],
                    "tail_collective_ms": result.timings["tail_collective_ms"],
                    "store_path": result.store_path,
                    "kv_bytes": stats["kv_bytes"] + stats["index_bytes"],
                    **{
                        k: stats[k]
                        for k in ("transient_peak_bytes", "gather_bytes", "materialized_bytes", "collectives")
                    },
                    "measured_peak_bytes": stats.get("measured_peak_bytes"),
                }
                if level == 8 and isinstance(result.store, ShardedKV):
                    points[level]["prefetch_payload_ms"] = payload_ms(result.store, n_layers, dev)
            points[level]["layer_ms"] += times
            del result
            if r == len(orders) - 1 and on_level is not None:
                on_level(level)
    for level, point in points.items():
        point["layer_ms_median"] = statistics.median(point["layer_ms"])
        point["run_ms"] = run_ms[level]
        point["run_ms_spread"] = paired.spread(run_ms[level])
        if workload.prefix == 0:  # the planner's scenario: one request, no prefix
            _planner_fields(point, runs[level], rank, wire_gbps)
    points_list = [points[level] for level in levels]
    out: dict[str, Any] = {
        "workload": workload.__dict__,
        "split_mode": split_mode,
        "levels": points_list,
        "rounds": level_repeats,
        "orders": orders,
        "comparisons": compare_levels(levels, run_ms),
    }
    by_level = points
    payload = by_level.get(8, {}).get("prefetch_payload_ms")
    if workload.prefix and payload and 7 in by_level:  # levels 7 and 8 alone, alternately: the prefetch
        layers: dict[int, list[float]] = {7: [], 8: []}
        stalls: list[float] = []
        saved_per_repeat: list[float] = []  # per repeat: level 7's median layer minus level 8's, same moment
        for _ in range(prefetch_repeats):
            repeat_ms = {}
            for level in (7, 8):
                # The caching allocator keeps its blocks between these runs: a fresh cache makes
                # the first layers of every run pay for cudaMalloc, noise larger than the payload.
                timings = _run(runs[level], group_of(), empty_cache=False, prebuilt=built).timings
                layers[level] += timings["layer_ms"][1:]
                stalls += timings["prefetch_wait_ms"][1:]  # layer 0's prefetch has nothing to hide behind
                repeat_ms[level] = statistics.median(timings["layer_ms"][1:] or timings["layer_ms"])
            saved_per_repeat.append(repeat_ms[7] - repeat_ms[8])
        ms = {level: statistics.median(t) if t else by_level[level]["layer_ms_median"] for level, t in layers.items()}
        saved = ms[7] - ms[8]
        stall = statistics.median(stalls) if stalls else None
        out["prefetch"] = {
            "payload_ms": payload,
            "level7_ms": ms[7],
            "level8_ms": ms[8],
            "saved_ms": saved,
            "hidden_fraction": saved / payload,
            "repeats": prefetch_repeats,
            "samples_per_level": len(layers[7]),
            "level7_layer_ms": layers[7],
            "level8_layer_ms": layers[8],
            "exposed_wait_ms": stalls,
            "exposed_wait_ms_median": stall,
            "hidden_fraction_direct": None if stall is None else 1 - stall / payload,
            "paired_saved_ms": saved_per_repeat,
            "hidden_fraction_paired": statistics.median(saved_per_repeat) / payload,
        }
    return out


# What --replan reads from a stored run (measured fields the planner's errors divide by included).
REPLAN_FIELDS = {
    "preset": choice_field(DSA_PRESETS),
    "n_layers": int_field(1, MAX_LAYERS),
    "cp_size": int_field(1, MAX_PLAN_CP),
    "rank": int_field(0),
    "wire_gbps": OPTIONAL_POSITIVE,
    "workloads": [
        {
            "workload": {"prefix": int_field(0, MAX_CONTEXT), "extend": int_field(1, MAX_CONTEXT)},
            "split_mode?": choice_field(SPLIT_MODES),
            "levels": [
                {
                    "level": int_field(0, 8),
                    "layer_ms_median": POSITIVE,
                    "kv_bytes": POSITIVE,
                    "transient_peak_bytes": POSITIVE,
                    "measured_peak_bytes?": OPTIONAL_NUMBER,
                }
            ],
        }
    ],
}


def stored_run(path: str) -> dict[str, Any]:
    """The stored run ``--replan`` names, with every field :func:`replan` reads (or one error naming it)."""
    doc = input_json(path, "--replan")
    where = f"--replan {path!r}"
    stored_fields(doc, REPLAN_FIELDS, where)
    rank_of(doc["rank"], doc["cp_size"], f"{where}: field rank", "cp_size")
    layers_arg(doc["preset"], doc["n_layers"], f"{where}: field n_layers", "preset")
    return doc


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write (with --replan: default the file replanned)")
    parser.add_argument("--replan", metavar="FILE", help="recompute the planner columns of a stored run (no device)")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the rank this process plays, 0..C-1")
    parser.add_argument("--levels", default="0-8", help="phase levels: a range 0-8 or a list 0,7,8")
    parser.add_argument(
        "--workloads",
        default="current-only:0+32768,current-only:0+131072,prefix-heavy:131072+8192,prefix-heavy:131072+2048",
        help="name:prefix+extend, comma separated",
    )
    parser.add_argument(
        "--layers", type=int_arg(None, MAX_LAYERS, "more than any preset's"), default=4, help="layers run"
    )
    parser.add_argument(
        "--wire-gbps",
        type=float_arg(),
        default=None,
        help="model the interconnect, GB/s (CUDA only; default: none, no wire time)",
    )
    parser.add_argument(
        "--prefetch-repeats", type=int_arg(None, MAX_REPEATS), default=6, help="extra alternating level 7 / 8 runs"
    )
    parser.add_argument(
        "--level-repeats",
        type=int_arg(None, MAX_REPEATS),
        default=DEFAULT_ROUNDS,
        help=f"timed rounds after a warm-up round, the levels interleaved (a verdict needs {paired.MIN_REPEATS}+)",
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    parser.add_argument(
        "--split-modes",
        default="in-seq",
        help="comma-separated: in-seq, round-robin (round-robin levels drop phases 4 and 5)",
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (
        ("--prefetch-repeats", args.prefetch_repeats),
        ("--level-repeats", args.level_repeats),
        ("--layers", args.layers),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.replan:
        stored = stored_run(args.replan)
        out = output_file(args.out or args.replan)
        out.write_text(json.dumps(replan(stored), indent=1))
        print(f"wrote {out}", file=sys.stderr)
        return 0
    if not args.out:
        raise ConfigError("--out FILE: where to write the results (or --replan FILE)")
    output_file(args.out)
    rank_of(args.rank, args.cp_size)
    workloads = parse_workloads(args.workloads)
    levels = parse_levels(args.levels)
    split_modes = [m.strip() for m in args.split_modes.split(",")]
    if any(m not in SPLIT_MODES for m in split_modes) or len(set(split_modes)) < len(split_modes):
        raise ConfigError(f"--split-modes {args.split_modes!r}: use in-seq, round-robin or both")
    require_cuda(args.device)
    runs = [
        bench_run(args.preset, w, args.cp_size, args.layers, args.device, mode, level, "--workloads")
        for w in workloads
        for mode in split_modes
        for level in levels
    ]
    rank_fits(runs, args.rank, args.device, "--workloads / --layers")
    results: list[dict[str, Any]] = []
    doc = {
        **run_record("layer", argv, args.device),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("DSACP_")},
        "how_cp_runs": loopback_cp(args.rank, args.cp_size, args.wire_gbps),
        "timing": (
            f"CUDA events per layer; {args.level_repeats} round(s) after a warm-up round, each running every level "
            "once in an order rotated per round; layer ms: the median over the layers of every round; run ms: per "
            "round, the median over its layers"
        )
        if args.device == "cuda"
        else "perf_counter per layer (CPU dry run: the numbers mean nothing)",
        "level_repeats": args.level_repeats,
        "protocol": "paired",
        "rule": paired.RULE,
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "n_layers": args.layers,
        "wire_gbps": args.wire_gbps,
        "workloads": results,
    }
    for w in workloads:  # the file is rewritten after each workload: a run cut short keeps what finished
        for mode in split_modes:
            print(f"{w.name} {w.prefix}+{w.extend} {mode}: levels {levels}", file=sys.stderr, flush=True)
            results.append(
                measure(
                    args.preset,
                    w,
                    levels,
                    args.cp_size,
                    args.rank,
                    args.layers,
                    args.device,
                    args.wire_gbps,
                    args.prefetch_repeats,
                    args.level_repeats,
                    split_mode=mode,
                )
            )
            Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def bench_run(
    preset: str, workload: Workload, cp_size: int, n_layers: int, device: str, split_mode: str, level: int, flag: str
) -> RunConfig:
    """The run :func:`measure` makes of one workload at one level, built before anything runs: what
    :class:`RunConfig` refuses (ranks without a token, say) is refused up front, naming ``flag``."""
    what = f"{flag} {workload.name}:{workload.prefix}+{workload.extend}"
    split_fits(workload.extend, None, cp_size, what)
    try:
        return RunConfig(
            preset=preset,
            n_layers=n_layers,
            cp_size=cp_size,
            check=False,
            device=device,
            requests=(Request(workload.prefix, workload.extend),),
            phases=phases_at(level, split_mode),
            split_mode=split_mode,
        )
    except ConfigError as exc:
        raise ConfigError(f"{what} at level {level} ({split_mode}): {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
