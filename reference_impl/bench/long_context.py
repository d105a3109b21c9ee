"""Long context on one rank: a chunked prefill of up to 1,048,576 tokens, its time and its memory.

Usage::

    python -m reference_impl.bench.long_context --out docs/results/long_context_h200.json
        [--contexts 131072,524288,1048576] [--chunk 131072] [--levels 0,7,8] [--layers 2]
        [--cp-size 8] [--rank 0] [--preset deepseek-v3.2]
    python -m reference_impl.bench.long_context --out dry.json --device cpu --preset tiny \\
        --contexts 512,1024 --chunk 256 --cp-size 2 --layers 2      # CPU dry run (numbers mean nothing)

**What runs.** One request of ``context`` tokens, prefilled in chunks of ``--chunk`` tokens (the
chunk a CP group takes at once: ``chunk / C`` local queries per rank, 16,384 at the defaults), by
rank ``--rank`` of ``--cp-size`` alone in one process (:class:`~reference_impl.cp.loopback.LoopbackGroup`:
the rank launches what it launches in a real group; all-gathers are local copies, no wire time).
Chunk ``i`` sees ``(i + 1) x chunk`` keys, so one run records every context up to its own: its last
chunk is the layer at ``context`` tokens, and the sum over its chunks is what the whole prefill
costs per layer. Each level runs once untimed (:func:`~reference_impl.bench.layer.warm_up`: the
compiler's time stays out), then once timed.

Per context and level: each chunk's per-layer times (CUDA events), the last chunk's median,
the prefill's sum, the KV at rest (the pools, all chunks' tokens), ``measured_peak_bytes`` (the
peak above the allocation at the start of the layer loop, which holds the pools, the weights and
the inputs: the **transient** memory, peak minus KV at rest), the absolute peak, and the planner
beside each (``planner_error = planner / measured - 1``).

**By component** (the last chunk's shape, the compute-kernels page's method: each kernel alone,
``triton.testing.do_bench`` median, or 3 event-timed runs above ``--slow-ms``): the indexer's
logits and its top-k (the dispatch's selection over the same tiles), sparse MLA attention, the
per-token projection half of the layer (GEMMs and glue); per level, ``other_ms`` is the layer
minus those (CP data movement, the output half, launch gaps).

Before anything runs, the planner's estimate of the benchmark's device time is printed.
``--modeled`` writes the planner's figures alone in the same layout (no device; what the docs
render until a GPU run exists).
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

from reference_impl.bench.layer import parse_levels, phases_at, planner_point, split_fits, warm_up
from reference_impl.bench.record import run_record
from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, ConfigError, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank
from reference_impl.planner import rank_ranges, zigzag_blocks
from reference_impl.tool_args import (
    DSA_PRESETS,
    LIST,
    MAX_LAYERS,
    OBJECT,
    OPTIONAL_NUMBER,
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

PROG = "python -m reference_impl.bench.long_context"
DEFAULT_CONTEXTS = (131072, 524288, 1048576)
DEFAULT_CHUNK = 131072
# Chunks x levels, summed over the contexts: the planner walks each (a few ms apiece) for the estimate
# and the planner columns, and each is a run of the layers on the device.
MAX_CHUNK_POINTS = 4096


def chunk_contexts(context: int, chunk: int) -> list[int]:
    """Keys seen by each chunk of a ``context``-token prefill in chunks of ``chunk`` tokens."""
    return [min(c + chunk, context) for c in range(0, context, chunk)]


def local_positions(context: int, chunk: int, cp_size: int, page_size: int, level: int, rank: int) -> torch.Tensor:
    """Absolute positions of ``rank``'s queries in the last chunk of a ``context``-token prefill."""
    prefix = last_prefix(context, chunk)
    blocks = zigzag_blocks(context, cp_size, page_size, level >= 4, prefix)
    return torch.cat([torch.arange(prefix + a, prefix + b) for a, b in rank_ranges(blocks, rank)])


def last_prefix(context: int, chunk: int) -> int:
    """Tokens before the last chunk of a ``context``-token prefill in chunks of ``chunk``."""
    return (context - 1) // chunk * chunk


def estimate_seconds(
    preset: str, contexts: list[int], chunk: int, levels: list[int], cp_size: int, rank: int, n_layers: int
) -> float:
    """The planner's device time of the measured runs: every chunk's layer, each level run twice
    (warm-up and timed), plus the component timings (about eight calls of the last chunk's indexer)."""
    total_ms = 0.0
    for context in contexts:
        run = _run_config(preset, context, chunk, levels[0], cp_size, n_layers, "cpu")
        for level in levels:
            per_layer = sum(
                planner_point(run, rank, level, None, max(0, c - chunk), c)["layer_ms"]
                for c in chunk_contexts(context, chunk)
            )
            total_ms += 2 * per_layer * n_layers
        terms = planner_point(run, rank, max(levels), None, last_prefix(context, chunk), context)["terms_ms"]
        total_ms += 8 * (terms["indexer_logits"] + terms["indexer_topk"]) + 8 * terms["attention"]
    return total_ms / 1e3


def _run_config(
    preset: str, context: int, chunk: int, level: int, cp_size: int, n_layers: int, device: str
) -> RunConfig:
    return RunConfig(
        preset=preset,
        n_layers=n_layers,
        cp_size=cp_size,
        requests=(Request(0, context),),
        chunk_size=chunk if chunk < context else None,
        check=False,
        device=device,
        phases=phases_at(level, "in-seq"),
    )


def measure_level(run: RunConfig, level: int, rank: int, chunk: int) -> dict[str, Any]:
    """One level (``run``'s phases) of one context: a warm-up run, then the timed one -> JSON-ready dict."""
    dev = torch.device(run.device)
    group = lambda: LoopbackGroup(rank, run.cp_size, dev, None)  # noqa: E731
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    warm_up(run, group())
    result = run_rank(group(), run)
    context = run.requests[0].total
    n_layers = run.model.n_layers
    layer_ms = list(result.timings["layer_ms"])
    per_chunk = [layer_ms[i : i + n_layers] for i in range(0, len(layer_ms), n_layers)]
    stats = result.stats
    point: dict[str, Any] = {
        "level": level,
        "phases": str(run.phases),
        "chunk_contexts": chunk_contexts(context, chunk),
        "chunk_layer_ms": per_chunk,
        "last_chunk_layer_ms": statistics.median(per_chunk[-1]),
        "prefill_ms_per_layer": sum(statistics.median(c) for c in per_chunk),
        "store_path": result.store_path,
        "kv_bytes": stats["kv_bytes"] + stats["index_bytes"],
        "engine_transient_peak_bytes": stats["transient_peak_bytes"],
        "measured_peak_bytes": stats.get("measured_peak_bytes"),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    }
    _planner_fields(point, run, rank, chunk)
    return point


def _planner_fields(point: dict[str, Any], run: RunConfig, rank: int, chunk: int) -> None:
    """Put the planner's figures for ``point``'s level and their relative errors into ``point``."""
    point["planner"] = planned_level(run, point["level"], rank, chunk)
    point["planner_error"] = {
        "last_chunk_layer_ms": point["planner"]["last_chunk_layer_ms"] / point["last_chunk_layer_ms"] - 1,
        "prefill_ms_per_layer": point["planner"]["prefill_ms_per_layer"] / point["prefill_ms_per_layer"] - 1,
        "kv_bytes": point["planner"]["kv_bytes"] / point["kv_bytes"] - 1,
    }
    if point["measured_peak_bytes"]:
        point["planner_error"]["peak_bytes"] = point["planner"]["peak_bytes"] / point["measured_peak_bytes"] - 1


def replan(doc: dict[str, Any]) -> dict[str, Any]:
    """Re-evaluate the current planner against a stored run's measurements (arithmetic only, no
    device). The measured fields are untouched; ``planner`` / ``planner_error`` and the table are
    replaced and ``planner_replanned`` says so."""
    for entry in doc["runs"]:
        for point in entry["levels"]:
            run = _run_config(
                doc["preset"],
                entry["context"],
                doc["chunk_tokens"],
                point["level"],
                doc["cp_size"],
                doc["n_layers"],
                "cpu",
            )
            _planner_fields(point, run, doc["rank"], doc["chunk_tokens"])
    doc["table"] = measured_table(doc["runs"])
    doc["planner_replanned"] = (
        "planner fields recomputed by `python -m reference_impl.bench.long_context --replan` "
        "with the planner and rates of the working tree; measurements unchanged"
    )
    return doc


def planned_level(run: RunConfig, level: int, rank: int, chunk: int) -> dict[str, Any]:
    """The planner's figures for what :func:`measure_level` measures: the last chunk's layer and its
    terms, the sum over the chunks, KV at rest, the last chunk's transient and the largest peak
    (transient + activations) over the chunks."""
    context = run.requests[0].total
    planned = [planner_point(run, rank, level, None, max(0, c - chunk), c) for c in chunk_contexts(context, chunk)]
    return {
        "last_chunk_layer_ms": planned[-1]["layer_ms"],
        "terms_ms": planned[-1]["terms_ms"],
        "prefill_ms_per_layer": sum(p["layer_ms"] for p in planned),
        "kv_bytes": planned[-1]["kv_bytes"],
        "transient_bytes": planned[-1]["transient_bytes"],
        "peak_bytes": max(p["peak_bytes"] for p in planned),
    }


def modeled_doc(
    preset: str, contexts: list[int], chunk: int, levels: list[int], cp_size: int, rank: int, n_layers: int
) -> dict[str, Any]:
    """The benchmark's document with the planner's figures only (``"modeled": true``, no measured
    field): what the docs render until a GPU run replaces it. No device is used."""
    runs = []
    for context in contexts:
        entry: dict[str, Any] = {"context": context, "prefix_of_last_chunk": last_prefix(context, chunk), "levels": []}
        for level in levels:
            run = _run_config(preset, context, chunk, level, cp_size, n_layers, "cpu")
            entry["levels"].append(
                {
                    "level": level,
                    "phases": str(run.phases),
                    "chunk_contexts": chunk_contexts(context, chunk),
                    "planner": planned_level(run, level, rank, chunk),
                }
            )
        runs.append(entry)
    peaks = {
        str(level): [next(p for p in r["levels"] if p["level"] == level)["planner"]["peak_bytes"] for r in runs]
        for level in levels
    }
    table = [  # one row per context, for the docs: the last chunk's layer per level, the prefill, the peak
        {
            "context": r["context"],
            "chunks": len(chunk_contexts(r["context"], chunk)),
            **{f"level_{p['level']}_ms": p["planner"]["last_chunk_layer_ms"] for p in r["levels"]},
            "prefill_ms_per_layer": r["levels"][-1]["planner"]["prefill_ms_per_layer"],
            "peak_gib": r["levels"][-1]["planner"]["peak_bytes"] / 2**30,
        }
        for r in runs
    ]
    return {
        "modeled": True,
        "what": "the planner's prediction (no measurement): rates measured on an H200 (docs/results), loopback "
        "(no wire time), one request prefilled in chunks",
        "command": "python -m reference_impl.bench.long_context --modeled "
        "--out docs/results/long_context_modeled.json "
        f"--contexts {','.join(map(str, contexts))} --chunk {chunk} --levels {','.join(map(str, levels))} "
        f"--layers {n_layers} --cp-size {cp_size} --rank {rank} --preset {preset}",
        "preset": preset,
        "cp_size": cp_size,
        "rank": rank,
        "n_layers": n_layers,
        "chunk_tokens": chunk,
        "local_queries_per_chunk": chunk // cp_size,
        "levels": levels,
        "contexts": contexts,
        "runs": runs,
        "table": table,
        "table_level": levels[-1],
        "planner_peak_ratio_longest_over_shortest": {k: v[-1] / v[0] for k, v in peaks.items()},
        "planner_current_only_ms": {  # the whole context in one chunk, for comparison
            str(context): planner_point(
                _run_config(preset, context, context, max(levels), cp_size, n_layers, "cpu"), rank, max(levels), None
            )["layer_ms"]
            for context in contexts
        },
    }


def components(cfg: Any, positions: torch.Tensor, context: int, device: torch.device, slow_ms: float) -> dict[str, Any]:
    """The last chunk's compute, each part alone at its shape: ``positions`` (the rank's queries)
    against ``context`` keys (random inputs of the model's widths)."""
    from reference_impl.bench.compute_cases import _time, attention_inputs, indexer_inputs
    from reference_impl.kernels import dispatch
    from reference_impl.kernels.indexer_triton import indexer_logits_pass
    from reference_impl.model.attention import DSAAttention

    gen = torch.Generator().manual_seed(0)
    iq = indexer_inputs(positions, context, cfg.index_n_heads, cfg.index_head_dim, device)
    bounds = ([0] * positions.numel(), (positions + 1).tolist())  # host key ranges, as phase 6 gives them
    topk_total, timer = _time(lambda iq=iq: dispatch.indexer_topk(*iq, cfg.index_topk, host_bounds=bounds), slow_ms)
    logits_ms, _ = _time(lambda iq=iq: indexer_logits_pass(*iq, topk=cfg.index_topk), slow_ms)
    visible = float((positions + 1).sum())
    del iq
    q, kv, idx = attention_inputs(positions, context, cfg.n_heads, cfg.index_topk, gen, device)
    attention_ms, _ = _time(
        lambda q=q, kv=kv, idx=idx: dispatch.sparse_mla_attention(
            q, kv, idx, cfg.softmax_scale, cfg.kv_lora_rank, out_dtype=torch.bfloat16
        ),
        slow_ms,
    )
    del q, kv, idx
    with torch.device(device):  # built where it runs (a CPU init of 0.2e9 parameters takes seconds)
        attn = DSAAttention(cfg, torch.bfloat16, dispatch.KERNEL_OPS)
    x = torch.randn(positions.numel(), cfg.dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    pos = positions.to(device)
    with torch.no_grad():
        project_ms, _ = _time(lambda: attn.project(x, pos), slow_ms)
    logits_flops = 2.0 * cfg.index_n_heads * cfg.index_head_dim * visible
    attention_flops = (
        2.0 * positions.numel() * min(cfg.index_topk, context) * cfg.n_heads * (cfg.kv_width + cfg.kv_lora_rank)
    )
    return {
        "T_local": int(positions.numel()),
        "S": context,
        "timer": timer,
        "indexer_logits_ms": logits_ms,
        "indexer_topk_ms": topk_total - logits_ms,
        "attention_ms": attention_ms,
        "project_ms": project_ms,
        "indexer_logits_tflops": logits_flops / logits_ms / 1e9,
        "attention_tflops": attention_flops / attention_ms / 1e9,
    }


def measured_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per context, the keys of the modeled document's ``table`` (measured: the last chunk's
    layer per level, the prefill per layer and the transient at the highest level) plus the
    planner's figures beside them (``planner_`` prefix) and the components at the last chunk."""
    table = []
    for r in runs:
        top = r["levels"][-1]
        row = {
            "context": r["context"],
            "chunks": len(top["chunk_contexts"]),
            **{f"level_{p['level']}_ms": p["last_chunk_layer_ms"] for p in r["levels"]},
            **{f"planner_level_{p['level']}_ms": p["planner"]["last_chunk_layer_ms"] for p in r["levels"]},
            "prefill_ms_per_layer": top["prefill_ms_per_layer"],
            "planner_prefill_ms_per_layer": top["planner"]["prefill_ms_per_layer"],
            "peak_gib": (top["measured_peak_bytes"] or 0) / 2**30,
            "planner_peak_gib": top["planner"]["peak_bytes"] / 2**30,
            "kv_gib": top["kv_bytes"] / 2**30,
        }
        row.update({k: v for k, v in r.get("components", {}).items() if k.endswith("_ms")})
        table.append(row)
    return table


def transient_ratio(runs: list[dict[str, Any]], level: int) -> float | None:
    """``measured_peak_bytes`` of the longest context over that of the shortest, at ``level``."""
    peaks = [next(p["measured_peak_bytes"] for p in r["levels"] if p["level"] == level) for r in runs]
    return peaks[-1] / peaks[0] if len(peaks) > 1 and all(peaks) else None


# What --replan reads from a stored run (measured fields the planner's errors divide by included).
REPLAN_FIELDS = {
    "preset": choice_field(DSA_PRESETS),
    "cp_size": int_field(1, MAX_PLAN_CP),
    "rank": int_field(0),
    "n_layers": int_field(1, MAX_LAYERS),
    "chunk_tokens": int_field(1, MAX_BATCH_TOKENS),
    "runs": [
        {
            "context": int_field(1, MAX_BATCH_TOKENS),
            "components?": OBJECT,
            "levels": [
                {
                    "level": int_field(0, 8),
                    "chunk_contexts": LIST,
                    "last_chunk_layer_ms": POSITIVE,
                    "prefill_ms_per_layer": POSITIVE,
                    "kv_bytes": POSITIVE,
                    "measured_peak_bytes": OPTIONAL_NUMBER,
                }
            ],
        }
    ],
}


def walk_fits(contexts: list[int], chunk: int, levels: list[int], cp_size: int, what: str) -> None:
    """Refuse a benchmark (or its stored run, ``what``) whose chunks x levels exceed :data:`MAX_CHUNK_POINTS`,
    or whose last chunk of a context leaves a rank without a token."""
    points = sum(-(-context // chunk) for context in contexts) * len(levels)
    if points > MAX_CHUNK_POINTS:
        raise ConfigError(
            f"{what}: {points:,} chunks x levels; at most {MAX_CHUNK_POINTS:,} (each is planned, and "
            "run, one by one): use a larger chunk, fewer contexts or levels"
        )
    for context in contexts:
        split_fits(context, chunk, cp_size, f"{what}: context {context:,} in chunks of {chunk:,}")


def stored_run(path: str) -> dict[str, Any]:
    """The stored run ``--replan`` names, with every field :func:`replan` reads (or one error naming it)."""
    doc = input_json(path, "--replan")
    where = f"--replan {path!r}"
    stored_fields(doc, REPLAN_FIELDS, where)
    rank_of(doc["rank"], doc["cp_size"], f"{where}: field rank", "cp_size")
    levels = [0] * max(len(r["levels"]) for r in doc["runs"])  # the most levels a context ran
    walk_fits([r["context"] for r in doc["runs"]], doc["chunk_tokens"], levels, doc["cp_size"], where)
    return doc


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", help="JSON file to write (rewritten after each context; with --replan: default the file replanned)"
    )
    parser.add_argument("--replan", metavar="FILE", help="recompute the planner fields of a stored run (no device)")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument(
        "--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS), help="tokens of the request, comma separated"
    )
    parser.add_argument(
        "--chunk",
        type=int_arg(1, MAX_BATCH_TOKENS),
        default=DEFAULT_CHUNK,
        help="tokens per chunk of the prefill (CP group)",
    )
    parser.add_argument("--levels", default="0,7,8", help="phase levels: a list 0,7,8 or a range 0-8")
    parser.add_argument("--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=2, help="layers run")
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the rank this process plays, 0..C-1")
    parser.add_argument("--slow-ms", type=float_arg(), default=250.0, help="components above this: 3 event-timed runs")
    parser.add_argument("--no-components", action="store_true", help="skip the per-component timings")
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    parser.add_argument("--modeled", action="store_true", help="write the planner's figures only (no device)")
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replan:
        stored = stored_run(args.replan)
        out = output_file(args.out or args.replan)
        out.write_text(json.dumps(replan(stored), indent=1) + "\n")
        print(f"wrote {out} (replanned)", file=sys.stderr)
        return 0
    if args.out is None:
        raise ConfigError("--out FILE: where to write the results (or --replan FILE)")
    output_file(args.out)
    contexts = sorted(set(int_list(args.contexts, "--contexts", 1, MAX_BATCH_TOKENS)))
    levels = parse_levels(args.levels)
    rank_of(args.rank, args.cp_size)
    walk_fits(contexts, args.chunk, levels, args.cp_size, "--contexts / --chunk / --levels")
    if args.modeled:
        doc = modeled_doc(args.preset, contexts, args.chunk, levels, args.cp_size, args.rank, args.layers)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out} (modeled)", file=sys.stderr)
        return 0
    require_cuda(args.device)
    rank_fits(
        (
            _run_config(args.preset, context, args.chunk, level, args.cp_size, args.layers, args.device)
            for context in contexts
            for level in levels
        ),
        args.rank,
        args.device,
        "--contexts / --chunk / --layers",
    )
    from reference_impl.bench.timing import ready_for

    ready_for(args.device)  # a CPU dry run: Triton's interpreter on, before the kernels import it
    estimate = estimate_seconds(args.preset, contexts, args.chunk, levels, args.cp_size, args.rank, args.layers)
    print(
        f"planner estimate of the measured device time: {estimate:.0f} s (plus compilation and host work)",
        file=sys.stderr,
        flush=True,
    )
    on_gpu = args.device == "cuda"
    runs: list[dict[str, Any]] = []
    doc: dict[str, Any] = {
        **run_record("long_context", argv, args.device),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("DSACP_")},
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "n_layers": args.layers,
        "chunk_tokens": args.chunk,
        "local_queries_per_chunk": args.chunk // args.cp_size,
        "levels": levels,
        "contexts": contexts,
        "how_cp_runs": f"rank {args.rank} of C={args.cp_size} alone in one process (LoopbackGroup): all-gathers are "
        "local copies (no wire time); one request prefilled in chunks",
        "timing": "CUDA events per layer of one run after a warm-up run of the same level and context; components: "
        "median of triton.testing.do_bench, or of 3 event-timed runs above --slow-ms"
        if on_gpu
        else "perf_counter (CPU dry run: the numbers mean nothing)",
        "planner_estimate_s": estimate,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": runs,
    }
    out = Path(args.out)
    for context in contexts:
        print(
            f"context {context}: {len(chunk_contexts(context, args.chunk))} chunks, levels {levels}",
            file=sys.stderr,
            flush=True,
        )
        entry: dict[str, Any] = {
            "context": context,
            "prefix_of_last_chunk": last_prefix(context, args.chunk),
            "levels": [],
        }
        runs.append(entry)
        for level in levels:
            run = _run_config(args.preset, context, args.chunk, level, args.cp_size, args.layers, args.device)
            entry["levels"].append(measure_level(run, level, args.rank, args.chunk))
            out.write_text(json.dumps(doc, indent=1))
        if not args.no_components:
            cfg = run.model
            positions = local_positions(context, args.chunk, args.cp_size, run.page_size, max(levels), args.rank)
            entry["components"] = components(cfg, positions, context, torch.device(args.device), args.slow_ms)
            parts = sum(
                entry["components"][k] for k in ("indexer_logits_ms", "indexer_topk_ms", "attention_ms", "project_ms")
            )
            for point in entry["levels"]:
                point["other_ms"] = point["last_chunk_layer_ms"] - parts
        out.write_text(json.dumps(doc, indent=1))
    doc["transient_ratio_longest_over_shortest"] = {str(level): transient_ratio(runs, level) for level in levels}
    doc["table"], doc["table_level"] = measured_table(runs), levels[-1]
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out.write_text(json.dumps(doc, indent=1))
    print(format_table(doc))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def format_table(doc: dict[str, Any]) -> str:
    """One line per context and level: last chunk's layer ms, prefill ms per layer, memory, planner."""
    gib = 2**30
    lines = [
        f"{'context':>9} {'lvl':>3} {'layer ms':>9} {'planner':>8} {'prefill ms/layer':>17} {'KV GiB':>7} "
        f"{'transient GiB':>14} {'planner':>8}"
    ]
    for r in doc["runs"]:
        for p in r["levels"]:
            peak = p["measured_peak_bytes"]
            lines.append(
                f"{r['context']:>9} {p['level']:>3} {p['last_chunk_layer_ms']:>9.1f} "
                f"{p['planner']['last_chunk_layer_ms']:>8.1f} "
                f"{p['prefill_ms_per_layer']:>17.1f} {p['kv_bytes'] / gib:>7.2f} "
                f"{(peak or 0) / gib:>14.2f} {p['planner']['peak_bytes'] / gib:>8.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
