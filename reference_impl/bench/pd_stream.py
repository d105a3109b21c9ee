"""The layer-wise PD send against the prefill it rides on: one rank of ``C``, with and without it.

Usage::

    python -m reference_impl.bench.pd_stream --out FILE.json [--cp-size 8] [--rank 0] [--level 8]
        [--workloads 32k:0+32768,128k:0+131072,prefix-heavy:131072+2048] [--layers 4] [--repeats 3]
        [--wire-gbps 450]
    python -m reference_impl.bench.pd_stream --out dry.json --device cpu --preset tiny   # CPU dry run

One process plays rank ``--rank`` of ``--cp-size`` (:class:`~reference_impl.cp.loopback.LoopbackGroup`,
the CP all-gathers modeled at ``--wire-gbps``, as in :mod:`reference_impl.bench.layer`). Per
workload (one request), runs alternate ``--repeats`` times between the plain prefill and the
prefill with a :class:`~reference_impl.pd.stream.LayerStreamer` over an
:class:`~reference_impl.pd.transport.InProcessTransport` (the decode side is this process).

**The wire measured is the send's device leg**: the pool read and the copy into pinned host
memory on a side stream, through the H200's real PCIe link, which is what a NIC reading host
memory (or Mooncake / NIXL registering it) starts from. The network leg after it runs on the
host and is not modeled. Reported per workload: the layer time without and with the send (median
over the layers after the first of every run; ``paired``: the median over repeats of each pair's
difference), the staging time per layer, how much of it ran before the layer loop ended (CUDA
events on both streams), how long the last block landed after it, the completion wait, the bytes
per layer, and whether every received block equals the rows the rank holds at rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from reference_impl.bench.layer import Workload, parse_workloads, split_fits
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import MAX_PLAN_CP, PhaseSet, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import request_locs, run_rank
from reference_impl.pd.stream import LayerStreamer
from reference_impl.pd.transport import InProcessTransport
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_LAYERS,
    MAX_REPEATS,
    ToolParser,
    device_arg,
    dsa_preset_arg,
    float_arg,
    int_arg,
    output_file,
    rank_fits,
    rank_of,
    refusing,
    require_cuda,
)

PROG = "python -m reference_impl.bench.pd_stream"

DECODE_RANK = -1  # the in-process decode's mailbox key


def streamed_prefill(
    run: RunConfig, group: LoopbackGroup
) -> tuple[Any, LayerStreamer, InProcessTransport, list[float]]:
    transport = InProcessTransport(sender_rank=group.rank)
    streamer = LayerStreamer(transport, DECODE_RANK)
    result = run_rank(group, run, keep_store=True, on_layer_stored=streamer)
    waits = streamer.wait_all()
    return result, streamer, transport, waits


def _received_equal_rows_at_rest(run: RunConfig, result: Any, transport: InProcessTransport, rank: int) -> bool:
    locs = request_locs(run)
    for layer in range(run.model.n_layers):
        for req in range(len(run.requests)):
            got = transport.recv(rank, DECODE_RANK)
            expect = result.store.stored_rows(layer, [locs[req].to(result.store.pool.device)])[0]
            parts = (got.positions, got.mla, got.index, got.scale)
            if (got.layer, got.request) != (layer, req) or not all(
                torch.equal(a.cpu(), b.cpu()) for a, b in zip(parts, expect)
            ):
                return False
    return True


def measure(
    preset: str,
    workload: Workload,
    cp_size: int,
    rank: int,
    level: int,
    n_layers: int,
    device: str,
    wire_gbps: float | None,
    repeats: int,
) -> dict[str, Any]:
    """Alternate plain and streamed prefills of one workload on one rank -> JSON-ready dict."""
    run = RunConfig(
        preset=preset,
        n_layers=n_layers,
        cp_size=cp_size,
        requests=(Request(workload.prefix, workload.extend),),
        check=False,
        device=device,
        phases=PhaseSet.level(level),
    )
    group_of = lambda: LoopbackGroup(rank, cp_size, device, wire_gbps)  # noqa: E731 (fresh stats per run)
    streamed_prefill(run, group_of())  # warm-up: kernels compiled, pinned host blocks cached
    plain: list[float] = []
    streamed: list[float] = []
    paired: list[float] = []
    staging, hidden, exposed, waits = [], [], [], []
    rows_equal = True
    bytes_per_layer = 0
    for repeat in range(repeats):
        base = run_rank(group_of(), run).timings["layer_ms"][1:]
        result, streamer, transport, wait = streamed_prefill(run, group_of())
        with_send = result.timings["layer_ms"][1:]
        plain += base
        streamed += with_send
        paired.append(statistics.median(with_send) - statistics.median(base))
        waits.append(sum(wait))
        bytes_per_layer = streamer.bytes_sent // n_layers
        if streamer.overlap is not None:
            staging.append(streamer.overlap.staging_ms / n_layers)
            hidden.append(streamer.overlap.hidden_fraction)
            exposed.append(streamer.overlap.exposed_after_loop_ms)
        if repeat == 0:
            rows_equal = _received_equal_rows_at_rest(run, result, transport, rank)
        del result
    med = statistics.median
    return {
        "workload": workload.__dict__,
        "level": level,
        "layer_ms_plain": med(plain),
        "layer_ms_streamed": med(streamed),
        "layer_ms_added_paired": med(paired),
        "paired_added_ms": paired,
        "bytes_sent_per_layer": bytes_per_layer,
        "staging_ms_per_layer": med(staging) if staging else None,
        "staging_gbps": bytes_per_layer / med(staging) / 1e6 if staging else None,
        "hidden_fraction": med(hidden) if hidden else None,
        "hidden_fractions": hidden,
        "exposed_after_loop_ms": med(exposed) if exposed else None,
        "completion_wait_ms": med(waits),
        "received_equal_rows_at_rest": rows_equal,
        "samples_per_variant": len(plain),
    }


def stream_parser(prog: str, description: str) -> ToolParser:
    """The arguments of a layer-wise send benchmark (this one and :mod:`reference_impl.bench.pd_mooncake`)."""
    parser = ToolParser(prog, description)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the prefill rank this process plays, 0..C-1")
    parser.add_argument("--level", type=int_arg(0, 8), default=8, help="a phase level with KV sharded at rest (2-8)")
    parser.add_argument(
        "--workloads",
        default="32k:0+32768,128k:0+131072,prefix-heavy:131072+2048",
        help="name:prefix+extend, comma separated",
    )
    parser.add_argument(
        "--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=4, help="layers run (at least 2)"
    )
    parser.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=3, help="runs per variant")
    parser.add_argument(
        "--wire-gbps",
        type=float_arg(),
        default=None,
        help="model the CP all-gathers' interconnect, GB/s (CUDA only; default: none, no wire time)",
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    return parser


def parse_stream_args(parser: ToolParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse and check everything before anything runs: a level with KV sharded at rest, at least 2
    layers, the rank among the ranks, the workloads (each split over every rank, their runs in
    ``args.runs``), the output file and the device. The memory: :func:`runs_fit`."""
    args = parser.parse_args(argv)
    if args.level < 2:
        parser.error(f"--level {args.level}: the layer-wise send needs KV sharded at rest, levels 2-8")
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: at least 2 (each run's first layer is left out of the medians)")
    args.out = output_file(args.out)
    rank_of(args.rank, args.cp_size)
    args.workloads = parse_workloads(args.workloads)
    runs = []
    for w in args.workloads:
        split_fits(w.extend, None, args.cp_size, f"--workloads {w.name}:{w.prefix}+{w.extend}")
        runs.append(
            RunConfig(
                preset=args.preset,
                n_layers=args.layers,
                cp_size=args.cp_size,
                check=False,
                requests=(Request(w.prefix, w.extend),),
                device=args.device,
                phases=PhaseSet.level(args.level),
            )
        )
    require_cuda(args.device)
    args.runs = runs
    return args


def runs_fit(args: argparse.Namespace) -> None:
    """Refuse the runs of :func:`parse_stream_args` when the largest cannot fit (on a CPU)."""
    rank_fits(args.runs, args.rank, args.device, "--workloads / --layers")


@refusing
def main(argv: list[str] | None = None) -> int:
    args = parse_stream_args(stream_parser(PROG, __doc__.split("\n\n")[0]), argv)
    runs_fit(args)
    results: list[dict[str, Any]] = []
    on_cuda = args.device == "cuda"
    doc = {
        **run_record("pd_stream", argv, args.device),
        "how_cp_runs": loopback_cp(args.rank, args.cp_size, args.wire_gbps),
        "wire": (
            "the send's device leg, measured: pool read + copy to pinned host memory on a side stream over the "
            "GPU's PCIe link; the network leg after it is not modeled"
        )
        if on_cuda
        else "none (CPU dry run)",
        "timing": (
            f"CUDA events per layer; median over the layers after the first of {args.repeats} runs per variant, "
            "plain and streamed runs alternating"
        )
        if on_cuda
        else "perf_counter (CPU dry run: the numbers mean nothing)",
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "n_layers": args.layers,
        "wire_gbps": args.wire_gbps,
        "repeats": args.repeats,
        "workloads": results,
    }
    for w in args.workloads:
        print(f"{w.name} {w.prefix}+{w.extend}", file=sys.stderr, flush=True)
        results.append(
            measure(
                args.preset,
                w,
                args.cp_size,
                args.rank,
                args.level,
                args.layers,
                args.device,
                args.wire_gbps,
                args.repeats,
            )
        )
        args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
