"""DeepSeek-V4 per-layer benchmark: one rank of ``C`` at several phase levels, V3.2 beside.

Usage::

    python -m reference_impl.bench.v4 --out docs/results/v4_h200.json          # H200: ~3 minutes before --hit, --evict
    python -m reference_impl.bench.v4 --out dry.json --device cpu --preset tiny-v4 --layers 3 \\
        --workloads 128k:0+1021,1m:3000+301 --levels 0,2 \\
        --hit hit:3000+301 --hit-chunk-size 512 --evict evict:1500+301        # CPU dry run

**How CP runs here** (as :mod:`reference_impl.bench.layer`): one process plays rank ``--rank`` of
``--cp-size`` through :class:`~reference_impl.cp.loopback.LoopbackGroup`; every all-gather is a
local copy of the rank's own rows plus, with ``--wire-gbps``, a stream-held delay of
``bytes received / wire`` (a modeled interconnect, named in the JSON). Outputs are not checked.

**Workloads**: ``128k`` is one request of 131,072 tokens in one chunk (current only); ``1m`` is the
last 8,192-token chunk of a 1,048,576-token request: its 1,040,384-token prefix is installed as
random entries of the right shapes (:func:`~reference_impl.families.deepseek_v4.cp.store.install_synthetic_prefixes`;
computing it with the oracle would take hours, and no time or byte count depends on the values).

**A prefix hit** (``--hit name:P+E``, default a 1,048,576-token prefix and 8,192 new tokens): the
cold prefill of all ``P + E`` tokens from nothing, in chunks of ``--hit-chunk-size``, against a run of
two batches on one pool: request 0 holds the ``P`` cached tokens (random entries of the right shapes,
and the checkpoint at ``P`` a hit needs), request 1 = ``r0:P+E`` hits them in the second batch. Timed
per run (median, min and max over ``--repeats`` after a warm-up): the cold prefill from its start,
the hit's batch from its start (the hit's install, then its ``E`` tokens); ``saved_ms`` is their
difference run by run. Bytes: what the hit's batch moves, by collective tag (``v4_hit``: the prefix's
partial-page entries moving to their new owners).

**An evicting pool** (``--evict name:P+E``): three batches on a pool of one batch's pages
(``pool_pages``): request 0 = ``P + C`` cached, request 1 = another ``P + E`` (it evicts request 0),
request 2 = ``r0:P+E`` (a miss: request 0 was evicted, so it recomputes its prefix and evicts request 1).
Per batch: its time (its install, then its compute), bytes by collective tag and bytes at rest after
its install; the run's ``prefix_cache`` counts. A miss's prefix is installed as random entries here,
so its install time is not a recompute's: the cold prefill's time is.

All of it models rank ``--rank`` of ``C`` on one device (the other ranks' rows are local copies).

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
import time
from pathlib import Path
from typing import Any

import torch

from reference_impl import engine
from reference_impl.bench.layer import Workload, layers_arg, parse_levels, parse_workloads, split_fits
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import MAX_PLAN_CP, ConfigError, PhaseSet, Request, RunConfig, get_preset
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.families.deepseek_v4.config import V4_PRESETS
from reference_impl.families.deepseek_v4.cp.store import V4Store
from reference_impl.families.deepseek_v4.family import DeepSeekV4Family, synthetic_prefixes
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.families.deepseek_v4.planner import plan_v4
from reference_impl.schedule import Chunk
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BatchClock(DeepSeekV4Family):
    """The bench family (synthetic prefixes), marking where each batch starts: before its prefixes and hits
    are installed, with the collectives issued so far and, once installed, the store's bytes at rest."""

    def __init__(self) -> None:
        super().__init__(prefixes=synthetic_prefixes)
        self.marks: list[dict[str, Any]] = []

    def install_prefixes(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        inputs: list[torch.Tensor],
        store: V4Store,
        chunk: Chunk,
        shared_tokens: dict[int, int],
    ) -> None:
        _sync(store.group.device)
        mark: dict[str, Any] = {
            "batch": chunk.batch,
            "start": time.perf_counter(),
            "collectives": len(store.group.stats),
        }
        super().install_prefixes(run, model, inputs, store, chunk, shared_tokens)
        _sync(store.group.device)
        mark["installed"] = time.perf_counter()
        mark["bytes_at_rest"] = {"kv_bytes": store.kv_bytes, "index_bytes": store.index_bytes, **store.breakdown()}
        mark["requests_at_rest"] = sorted(store.locs)  # evicted requests' state is gone
        self.marks.append(mark)


def run_batches(run: RunConfig, rank: int, wire_gbps: float | None) -> tuple[list[dict[str, Any]], engine.RankResult]:
    """One run of several batches -> per batch: its wall time (install, then compute up to the next batch's
    start or the run's end), bytes by collective tag, bytes at rest after its install; and the rank's result."""
    device = torch.device(run.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    family = BatchClock()
    result = engine.run_rank(LoopbackGroup(rank, run.cp_size, device, wire_gbps), run, family=family)
    _sync(device)
    end, marks = time.perf_counter(), family.marks
    batches = []
    for i, mark in enumerate(marks):
        stop = marks[i + 1]["start"] if i + 1 < len(marks) else end
        last = marks[i + 1]["collectives"] if i + 1 < len(marks) else len(result.collectives)
        batches.append(
            {
                "batch": mark["batch"],
                "ms": (stop - mark["start"]) * 1e3,
                "install_ms": (mark["installed"] - mark["start"]) * 1e3,
                "bytes_by_tag": tag_bytes(result.collectives[mark["collectives"] : last], run.cp_size),
                "bytes_at_rest": mark["bytes_at_rest"],
                "requests_at_rest": mark["requests_at_rest"],
            }
        )
    return batches, result


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements, and the runs themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def carried_rows(cfg: Any, prefix: int) -> dict[str, Any]:
    """What a hit at ``prefix`` reuses and carries, per layer type: complete entries, the compressor rows
    carried into the first new entry (``prefix - state_start``), the window tail's raw rows."""
    out: dict[str, Any] = {"mod_4": prefix % 4, "mod_8": prefix % 8, "mod_128": prefix % 128}
    for kind, m in (("csa", 4), ("hca", 128)):
        out[kind] = {"entries": prefix // m, "carried_rows": prefix - state_start(prefix, m)}
    out["window_rows"] = min(prefix, cfg.window_size - 1)
    return out


def hit_runs(base: RunConfig, w: Workload, chunk_size: int) -> tuple[RunConfig, RunConfig]:
    """The cold prefill of ``w`` (all of it, chunked) and the two-batch run whose second batch hits ``w.prefix``."""
    cold = base.replace(requests=(Request(0, w.prefix + w.extend),), chunk_size=chunk_size)
    source = Request(w.prefix, base.cp_size)  # its prefix cached; a token per rank computed
    requests = (source, Request(w.prefix, w.extend, shares=0))
    room = sum(-(-r.total // base.page_size) for r in requests) + lane_slack(base)  # nothing evicted: a hit
    return cold, base.replace(requests=requests, batch_sizes=(1, 1), pool_pages=room)


def lane_slack(run: RunConfig) -> int:
    """The pages a one-request batch needs beyond its own under phase 5's lanes (:class:`RunConfig`'s rule)."""
    return 2 * run.cp_size * 2 if run.phases.compute_owner else 0


def measure_hit(base: RunConfig, w: Workload, chunk_size: int, rank: int, wire: float | None, repeats: int) -> dict:
    """A prefix hit against a cold prefill (see the module docstring)."""
    cold_run, hit_run = hit_runs(base, w, chunk_size)
    run_batches(cold_run, rank, wire)  # warm-up: compiles
    run_batches(hit_run, rank, wire)
    cold_ms, hit_ms = [], []
    for _ in range(repeats):
        cold, _ = run_batches(cold_run, rank, wire)
        hit, result = run_batches(hit_run, rank, wire)
        cold_ms.append(cold[0]["ms"])
        hit_ms.append(hit[1]["ms"])
    return {
        "workload": w.__dict__,
        "level": base.phases.max_level,
        "phases": str(base.phases),
        "cold_chunk_size": chunk_size,
        "cold_ms": spread(cold_ms),
        "hit_ms": spread(hit_ms),
        "saved_ms": spread([c - h for c, h in zip(cold_ms, hit_ms)]),
        "hit_install_ms": hit[1]["install_ms"],
        "hit_bytes_by_tag": hit[1]["bytes_by_tag"],
        "cold_bytes_by_tag": cold[0]["bytes_by_tag"],
        "hit_bytes_at_rest": hit[1]["bytes_at_rest"],
        "prefix_cache": result.prefix_cache,
        "carried": carried_rows(base.model, w.prefix),
    }


def evict_run(base: RunConfig, w: Workload) -> RunConfig:
    """Three batches on a pool of one batch's pages: a cached request, another that evicts it, a miss."""
    requests = (Request(w.prefix, base.cp_size), Request(w.prefix, w.extend), Request(w.prefix, w.extend, shares=0))
    pages = -(-(w.prefix + w.extend) // base.page_size)
    return base.replace(requests=requests, batch_sizes=(1, 1, 1), pool_pages=pages + lane_slack(base))


def measure_evict(base: RunConfig, w: Workload, rank: int, wire: float | None, repeats: int) -> dict[str, Any]:
    """An evicting pool (see the module docstring): per batch, time and bytes; the prefix-cache counts."""
    run = evict_run(base, w)
    run_batches(run, rank, wire)  # warm-up
    runs = [run_batches(run, rank, wire) for _ in range(repeats)]
    batches, result = runs[-1]
    for i, batch in enumerate(batches):
        batch["ms"] = spread([r[0][i]["ms"] for r in runs])
        batch["install_ms"] = spread([r[0][i]["install_ms"] for r in runs])
    return {
        "workload": w.__dict__,
        "level": base.phases.max_level,
        "phases": str(base.phases),
        "pool_pages": run.pool_pages,
        "requests": [
            f"{r.prefix}+{r.extend}" if r.shares is None else f"r{r.shares}:{r.prefix}+{r.extend}" for r in run.requests
        ],
        "batches": batches,
        "prefix_cache": result.prefix_cache,
        "pool_occupancy": result.pool_occupancy,
        "miss_install": "random entries of the right shapes: a recompute costs what the hit workload's cold_ms says",
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
    parser.add_argument(
        "--hit", default="hit:1048576+8192", help="a prefix hit name:P+E against its cold prefill, or none"
    )
    parser.add_argument(
        "--hit-chunk-size", type=int_arg(1), default=8192, help="the cold prefill's chunk, tokens per request"
    )
    parser.add_argument("--evict", default="evict:1048576+8192", help="an evicting pool of requests name:P+E, or none")
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
    top = PhaseSet.level(max(levels))
    pool_runs = pool_workloads(args, top)
    require_cuda(args.device)
    runs = [base.replace(phases=PhaseSet.level(level)) for _, base in bases for level in levels]
    rank_fits(runs, args.rank, args.device, "--workloads / --layers")
    if pool_runs:
        rank_fits([r for _, _, rs in pool_runs for r in rs], args.rank, args.device, "--hit / --evict / --layers")
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
    for key, w, (first, *_) in pool_runs:
        print(f"{key} {w.prefix}+{w.extend}: level {top.max_level}", file=sys.stderr, flush=True)
        if key == "prefix_hit":
            doc[key] = measure_hit(first, w, args.hit_chunk_size, args.rank, args.wire_gbps, args.repeats)
        else:
            doc[key] = measure_evict(first, w, args.rank, args.wire_gbps, args.repeats)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def pool_workloads(args: Any, phases: PhaseSet) -> list[tuple[str, Workload, list[RunConfig]]]:
    """``--hit`` and ``--evict`` (unless ``none``): ``(JSON key, workload, [base run, the runs it makes])``,
    every run built (so refused, naming the flag) before anything runs."""
    out = []
    for key, flag, spec in (("prefix_hit", "--hit", args.hit), ("eviction", "--evict", args.evict)):
        if spec.strip() == "none":
            continue
        (w,) = parse_workloads(spec, flag)
        if w.prefix < 1:
            raise ConfigError(f"{flag} {spec!r}: a hit needs a cached prefix (P >= 1)")
        what = f"{flag} {spec}"
        split_fits(w.extend, None, args.cp_size, what)
        base = workload_run(args.preset, w, args.layers, args.cp_size, args.device).replace(phases=phases)
        try:
            if key == "prefix_hit":
                split_fits(w.prefix + w.extend, args.hit_chunk_size, args.cp_size, f"{what} (--hit-chunk-size)")
                made = list(hit_runs(base, w, args.hit_chunk_size))
            else:
                made = [evict_run(base, w)]
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        out.append((key, w, [base, *made]))
    return out


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
