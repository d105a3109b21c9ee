"""Where one rank's layer time goes: torch.profiler over the loopback harness of bench/layer.py.

    PYTHONPATH=. python3 scripts/profile_layer.py --level 7 --prefix 0 --extend 131072 [--cp-size 8] [--rows 30]

Prints the device-time table of the profiled run (the second of two identical runs; the first
compiles the kernels), top ``--rows`` ops by total CUDA time, and the sum per layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--extend", type=int, default=131072)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--wire-gbps", type=float, default=None)
    parser.add_argument("--json", default=None, help="also write every op's device time and count here")
    args = parser.parse_args()
    run = RunConfig(preset="deepseek-v3.2", n_layers=args.layers, cp_size=args.cp_size, check=False, device="cuda",
                    requests=(Request(args.prefix, args.extend),), phases=PhaseSet.level(args.level))
    run_rank(LoopbackGroup(args.rank, args.cp_size, "cuda", args.wire_gbps), run)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run_rank(LoopbackGroup(args.rank, args.cp_size, "cuda", args.wire_gbps), run)
    print(f"level {args.level}, {args.prefix}+{args.extend} tokens, rank {args.rank} of C={args.cp_size}: "
          f"layer ms {[round(t, 2) for t in result.timings['layer_ms']]} (includes prefix install outside the layers)")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90))
    if args.json:
        ops = [
            {"name": e.key, "count": e.count, "device_ms": e.device_time_total / 1e3}
            for e in averages if e.device_time_total > 0
        ]
        doc = {"args": vars(args), "layer_ms": result.timings["layer_ms"],
               "ops": sorted(ops, key=lambda o: -o["device_ms"])}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
