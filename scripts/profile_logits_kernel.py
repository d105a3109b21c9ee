"""Where the indexer's logits kernel waits: Nsight Compute's warp-state and pipe sections for one
launch at one rank's 128K shape, per launch config, on one GPU.

    PYTHONPATH=. python3 scripts/profile_logits_kernel.py --out docs/results/logits_kernel_ncu_h200.json [--ncu ncu]

The script runs itself under ``ncu`` in ``--worker`` mode. The worker builds the indexer inputs the
limits benchmark uses (:func:`reference_impl.bench.compute_cases.indexer_inputs`: rank 0 of
``C = 8`` at 131,072 tokens, 64 heads of 128) and launches the logits kernel on the last chunk of
rows the streamed top-k computes (the second zigzag block's end) against its first key tile once per
variant: the default config and 8 warps, with and without block pointers. Each launch runs alone
between ``cudaProfilerStart`` and ``cudaProfilerStop`` after a warm-up launch; ncu runs with
``--clock-control none`` (the card's clocks as found).

Per launch, every metric of ncu's SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats,
SchedulerStats and Occupancy sections, as ncu names them (its ``--page details`` CSV), and beside
them (:data:`METRICS`) each warp stall reason per issued instruction and the pipes' busy shares.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from reference_impl.errors import ConfigError
from reference_impl.tool_args import ToolParser, output_file, refusing

PROG = "python3 scripts/profile_logits_kernel.py"

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "Occupancy")
#: Beside the sections: each stall reason per issued instruction, and the tensor pipes' busy share.
METRICS = (
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
    r"regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active",
    r"regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active",
)
VARIANTS = ((4, False), (4, True), (8, False), (8, True))


def parse_details_csv(text: str) -> list[dict[str, Any]]:
    """ncu's ``--csv --page details`` output -> one ``{"kernel", "metrics": {section: {name: value}}}`` per
    profiled launch, in order (lines that are not CSV rows of a kernel are skipped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    launches: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(lines):
        if not row.get("Metric Name"):
            continue  # a section's rule row, no metric
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"], "metrics": {}})
        value: Any = row["Metric Value"].replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        unit = row.get("Metric Unit") or ""
        name = row["Metric Name"] + (f" ({unit})" if unit else "")
        launch["metrics"].setdefault(row["Section Name"], {})[name] = value
    return [launches[k] for k in sorted(launches, key=int)]


def worker(order_path: Path) -> None:
    import torch

    from reference_impl.bench.compute_cases import indexer_inputs, zigzag_rank0_positions
    from reference_impl.kernels import indexer_triton

    pos = zigzag_rank0_positions(131072, 8)
    iq = indexer_inputs(pos, 131072, 64, 128, torch.device("cuda"))
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = iq
    rows_per_chunk, cols = indexer_triton.logits_tile_shape(int(k_fp8.shape[0]), 2048)
    # The last chunk of rows (the second zigzag block's end: every key visible) and its first key tile.
    r0 = max(0, q_fp8.shape[0] - rows_per_chunk)
    r1 = q_fp8.shape[0]
    lo, hi = indexer_triton.chunk_key_range(key_start, key_end, r0, r1, None)
    t0, t1 = next(iter(indexer_triton.key_tiles(lo, hi, indexer_triton.KEY_TILE)))
    block_t, block_s, _, stages, dot = indexer_triton.GPU_DEFAULT_CONFIG
    rows = (q_fp8[r0:r1], weights[r0:r1], k_fp8, k_scale, key_start[r0:r1], key_end[r0:r1])
    out = torch.empty(r1 - r0, t1 - t0, dtype=torch.float32, device="cuda")
    order = []
    for warps, block_pointers in VARIANTS:
        launch = dict(
            block_t=block_t,
            block_s=block_s,
            num_stages=stages,
            dot_dtype=dot,
            num_warps=warps,
            block_pointers=block_pointers,
        )
        indexer_triton.indexer_logits_triton(*rows, t0, t1, out=out, **launch)  # compile, warm up
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        indexer_triton.indexer_logits_triton(*rows, t0, t1, out=out, **launch)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        visible = float(((key_end[r0:r1].clamp(max=t1) - key_start[r0:r1].clamp(min=t0)).clamp(min=0)).sum())
        order.append(
            {
                "num_warps": warps,
                "block_pointers": block_pointers,
                "rows": [r0, r1],
                "keys": [t0, t1],
                "flops": 2.0 * 64 * 128 * visible,
            }
        )
    order_path.write_text(json.dumps(order))


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write (required)")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line")
    parser.add_argument("--worker", metavar="ORDER_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    if not args.out:
        raise ConfigError("--out FILE: where to write the profile")
    out = output_file(args.out)
    if shutil.which(args.ncu) is None:
        raise ConfigError(f"--ncu {args.ncu!r}: no such command (Nsight Compute's ncu)")
    with tempfile.TemporaryDirectory() as tmp:
        order_path = Path(tmp) / "order.json"
        command = [
            args.ncu,
            "--clock-control",
            "none",
            "--profile-from-start",
            "off",
            "--csv",
            "--page",
            "details",
            "--print-units",
            "base",
        ]
        for section in SECTIONS:
            command += ["--section", section]
        command += ["--metrics", ",".join(METRICS)]
        command += [sys.executable, __file__, "--worker", str(order_path)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not order_path.exists():
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
            print(f"error: ncu exited {done.returncode}", file=sys.stderr)
            return 1
        order = json.loads(order_path.read_text())
    launches = parse_details_csv(done.stdout)
    if len(launches) != len(order):
        print(done.stdout[-3000:], file=sys.stderr)
        print(f"error: {len(order)} profiled launches but {len(launches)} in ncu's output", file=sys.stderr)
        return 1
    import torch

    version = subprocess.run([args.ncu, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    doc = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "ncu": version.splitlines()[-1] if version else None,
        "command": "python3 scripts/profile_logits_kernel.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "what": "the indexer logits kernel on the last row chunk's first key tile of rank 0 of C=8 "
        "at 131,072 tokens (64 heads x 128), "
        "one launch per variant under ncu, clocks as found, caches flushed before it (ncu's default)",
        "launches": [dict(o, **launch) for o, launch in zip(order, launches)],
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
