"""What is alive at one rank's measured memory peak: the CUDA caching allocator's trace of one
prefill, replayed.

    PYTHONPATH=. python3 scripts/memory_peak.py --level 8 --extend 131072 [--cp-size 8] [--layers 2] [--json FILE]

Runs the loopback harness of ``bench/layer.py`` twice (the first compiles the kernels), the second
under ``torch.cuda.memory._record_memory_history`` (Python stacks). The engine resets the peak
statistic once the store is built and the prefixes installed (``measured_peak_bytes`` counts from
there); the script marks that moment in the trace with one allocation of :data:`MARKER_BYTES`.
Replaying the trace's allocations and frees from the mark gives the bytes above the mark at each
step, counted as the engine's statistic counts them (frees of older tensors lower it); the layer
clock's marks (one more allocation size) say which layer each step falls in. At the largest: the
tensors allocated after the mark and still alive, grouped by the innermost ``reference_impl`` frame
that allocated them (the call chain of up to three such frames beside it) and by the layer that
made them. The script prints the trace's peak next to the engine's measured one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reference_impl.errors import ConfigError
from reference_impl.tool_args import refusing_exit

MARKER_BYTES = 3 * (1 << 20) + 512  # sizes no tensor of the run has: where the engine resets the peak,
LAYER_MARKER_BYTES = 3 * (1 << 20) + 1024  # and each mark of its layer clock (before and after each layer)


def _site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(innermost ``reference_impl`` frame, the chain of up to three such frames, innermost first)."""
    ours = [f for f in frames if "reference_impl" in f.get("filename", "")]
    if not ours:
        top = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
        return f"{Path(top['filename']).name}:{top['line']} {top['name']}", ""

    def short(f: dict[str, Any]) -> str:
        path = f["filename"][f["filename"].rfind("reference_impl") :]
        return f"{path}:{f['line']} {f['name']}"

    return short(ours[0]), " <- ".join(short(f) for f in ours[:3])


def live_at_peak(
    trace: Iterable[dict[str, Any]], marker_bytes: int = MARKER_BYTES, layer_marker_bytes: int = LAYER_MARKER_BYTES
) -> dict[str, Any]:
    """Replay one device's allocator trace (``alloc`` / ``free_requested`` events with ``addr``,
    ``size``, ``frames``) from the first allocation of ``marker_bytes``, as the engine's
    ``max_memory_allocated() - base`` counts: allocations after the mark add, their frees and the
    frees of tensors allocated before it subtract. Allocations of ``layer_marker_bytes`` are the
    layer clock's marks: the first starts layer 0, each next one the next layer (after the last
    layer: ``n_layers``, the tail); ``-1`` is the chunk before its first layer.

    Returns ``peak_bytes``, the ``peak_layer`` it falls in, and the allocations made after the
    mark and alive at the peak grouped by site and by the layer that made them, largest first
    (``sites``: ``site``, ``chain``, ``layer``, ``bytes``, ``count``)."""
    before: dict[int, int] = {}  # alive at the mark, allocated before it: addr -> bytes
    live: dict[int, tuple[dict[str, Any], int]] = {}  # allocated after the mark: addr -> (event, layer)
    marked, layer, running, peak, peak_layer = False, -1, 0, 0, -1
    at_peak: dict[int, tuple[dict[str, Any], int]] = {}
    for event in trace:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            if not marked:
                if event["size"] == marker_bytes:
                    marked = True
                else:
                    before[addr] = event["size"]
            elif event["size"] == layer_marker_bytes:
                layer += 1
            else:
                live[addr] = (event, layer)
                running += event["size"]
                if running > peak:
                    peak, peak_layer, at_peak = running, layer, dict(live)
        elif action == "free_requested":
            if addr in live:
                running -= live.pop(addr)[0]["size"]
            elif addr in before:
                size = before.pop(addr)
                running -= size if marked else 0
    if not marked:
        raise ValueError(f"no allocation of {marker_bytes} bytes (the mark) in the trace")
    sites: dict[tuple[str, str, int], list[int]] = defaultdict(lambda: [0, 0])
    for event, made_in in at_peak.values():
        entry = sites[(*_site(event.get("frames", [])), made_in)]
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": peak,
        "peak_layer": peak_layer,
        "sites": [{"site": s, "chain": c, "layer": m, "bytes": b, "count": n} for (s, c, m), (b, n) in ranked],
    }


@refusing_exit
def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from profile_layer import checked_run, one_rank_parser  # scripts/, on the path when run as a script
    from reference_impl import engine
    from reference_impl.cp.loopback import LoopbackGroup
    from reference_impl.engine import run_rank

    parser = one_rank_parser(
        __doc__.split("\n\n")[0],
        level=8,
        rows=12,
        json_help="also write the peak and every site here",
        prog="python3 scripts/memory_peak.py",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ConfigError("the allocator trace needs a CUDA device")
    run = checked_run(args, "cuda")
    run_rank(LoopbackGroup(args.rank, args.cp_size, "cuda"), run)  # warm-up: compiles the kernels
    reset = torch.cuda.reset_peak_memory_stats

    def reset_and_mark(device: Any = None) -> None:
        reset(device)
        torch.empty(MARKER_BYTES, dtype=torch.uint8, device=device)

    clock_mark = engine._LayerClock.mark

    def mark_layer(clock: Any) -> None:
        clock_mark(clock)
        torch.empty(LAYER_MARKER_BYTES, dtype=torch.uint8, device="cuda")

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.cuda.reset_peak_memory_stats = reset_and_mark  # the engine's call, looked up when made
    engine._LayerClock.mark = mark_layer
    try:
        result = run_rank(LoopbackGroup(args.rank, args.cp_size, "cuda"), run)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.reset_peak_memory_stats = reset
        engine._LayerClock.mark = clock_mark
        torch.cuda.memory._record_memory_history(enabled=None)
    found = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
    engine_peak = result.stats["measured_peak_bytes"]
    mib = 1 << 20
    print(
        f"level {args.level}, {args.prefix}+{args.extend} tokens, rank {args.rank} of C={args.cp_size}: "
        f"engine measured peak {engine_peak / mib:,.0f} MiB; trace peak {found['peak_bytes'] / mib:,.0f} MiB "
        f"in layer {found['peak_layer']} of {args.layers}"
    )
    print(f"{'MiB':>9} {'count':>6} {'layer':>6}  site (call chain)")
    for site in found["sites"][: args.rows]:
        print(f"{site['bytes'] / mib:>9,.1f} {site['count']:>6} {site['layer']:>6}  {site['chain'] or site['site']}")
    doc = {
        "args": vars(args),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "engine_measured_peak_bytes": engine_peak,
        **found,
        "what": "tensors allocated after the engine's peak reset and alive at the largest sum of such bytes, "
        "grouped by the innermost reference_impl frame; the second of two identical runs",
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
