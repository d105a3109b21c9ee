"""What bounds the phase-7 fused kernels: Nsight Compute's DRAM counters for each kernel and for a
copy kernel of the same bytes, on one GPU.

    PYTHONPATH=. python3 scripts/profile_fused_kernels.py --out docs/results/fused_kernels_ncu_h200.json \\
        [--tokens 32768,131072] [--ncu ncu]

The script runs itself under ``ncu`` in ``--worker`` mode. The worker builds the cases of
``python -m reference_impl.bench.kernels`` (:func:`reference_impl.bench.kernel_cases.build_cases`:
the same inputs, each kernel with its default launch config) and, for each token count, launches
each Triton kernel once and then a copy kernel of the same payload (``payload / 2`` bytes read
and as many written by torch's vectorized elementwise kernel, ``neg`` over fp32: a ``copy_`` is a
``cudaMemcpy``, which ncu does not profile). Each launch runs alone between
``cudaProfilerStart`` and ``cudaProfilerStop``, after a warm-up launch. ncu runs with
``--clock-control none`` (the card's clocks as found) and flushes the caches before each profiled
launch (its default), as ``do_bench`` does between repeats.

Per launch: the duration, DRAM bytes read and written (next to the payload the benchmark counts),
DRAM throughput as a share of its peak over the launch, achieved occupancy, grid size and waves.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reference_impl.config import MAX_BATCH_TOKENS
from reference_impl.errors import ConfigError
from reference_impl.tool_args import ToolParser, int_list, output_file, refusing

PROG = "python3 scripts/profile_fused_kernels.py"

METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__grid_size": "grid_size",
    "launch__waves_per_multiprocessor": "waves_per_sm",
}
KERNEL_OPS = ("store_mla_fp8", "store_mla_bf16", "store_index", "rerange_kv", "rerange_index", "materialize_fp8")


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu's ``--csv --page raw --print-units base`` output -> one dict per profiled kernel
    (``kernel`` and the :data:`METRICS` under their short names, numbers as floats). Lines that are
    not CSV (ncu's ``==PROF==`` messages, the program's own output) are skipped."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    header, body = rows[0], rows[1:]
    if body and not body[0][header.index("ID")].strip():  # the units row
        body = body[1:]
    out = []
    for row in body:
        cells = dict(zip(header, row))
        entry: dict[str, Any] = {"kernel": cells.get("Kernel Name", "")}
        for metric, name in METRICS.items():
            value = cells.get(metric, "").replace(",", "")
            entry[name] = float(value) if value not in ("", "n/a") else None
        out.append(entry)
    return out


def pair_rows(order: list[dict[str, Any]], kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker's launches (``order``) with ncu's kernels, one each, in launch order, plus what
    follows from the two: DRAM bytes over the counted payload and DRAM GB/s over the duration."""
    if len(order) != len(kernels):
        raise ValueError(f"{len(order)} profiled launches but {len(kernels)} kernels in ncu's output")
    rows = []
    for launch, kernel in zip(order, kernels):
        row = {**launch, **kernel}
        dram = (kernel["dram_read_bytes"] or 0) + (kernel["dram_write_bytes"] or 0)
        row["dram_bytes_over_payload"] = dram / launch["payload"]
        row["dram_gbps"] = dram / kernel["duration_ns"] if kernel["duration_ns"] else None
        rows.append(row)
    return rows


def worker(tokens: list[int], order_path: Path) -> None:
    """Launch every kernel and its same-size copy once each between profiler start/stop; write the order."""
    import torch

    from reference_impl.bench.kernel_cases import build_cases
    from reference_impl.kernels.fused_configs import default_config

    device = torch.device("cuda")
    args = argparse.Namespace(device="cuda", seed=0, preset="deepseek-v3.2", page_size=64, cp_size=8)

    def profiled(fn: Any) -> None:
        fn()  # warm-up: compiles
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()

    order: list[dict[str, Any]] = []
    for t in tokens:
        for case in build_cases(t, args):
            if case.op not in KERNEL_OPS:
                continue
            config = default_config(case.kernel, device)
            profiled(lambda case=case, config=config: case.run(config))
            order.append(
                {
                    "op": case.op,
                    "T": t,
                    "payload": case.payload,
                    "index_vector_bytes": case.index_bytes,
                    "config": config,
                }
            )
            n = case.payload // 8  # fp32 values: payload / 2 bytes read and as many written
            src = torch.randn(n, device=device)
            dst = torch.empty_like(src)
            profiled(lambda src=src, dst=dst: torch.neg(src, out=dst))
            order.append({"op": "copy", "T": t, "payload": 8 * n, "index_vector_bytes": 0, "same_size_as": case.op})
            del src, dst
        torch.cuda.empty_cache()
        print(f"T={t}: {len(order)} launches so far", file=sys.stderr, flush=True)
    order_path.write_text(json.dumps(order))


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write (required)")
    parser.add_argument("--tokens", default="32768,131072", help="token counts, comma separated")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--order", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens = int_list(args.tokens, "--tokens", 1, MAX_BATCH_TOKENS)
    if args.worker:
        worker(tokens, Path(args.order))
        return 0
    if not args.out:
        raise ConfigError("--out FILE: where to write the profile")
    out = output_file(args.out)
    if shutil.which(args.ncu) is None:
        raise ConfigError(f"--ncu {args.ncu!r}: no such command (Nsight Compute's ncu)")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("this profile needs a CUDA device and Nsight Compute")
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
            "raw",
            "--print-units",
            "base",
            "--metrics",
            ",".join(METRICS),
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--order",
            str(order_path),
            "--tokens",
            args.tokens,
        ]
        started = time.strftime("%Y-%m-%dT%H:%M:%S")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not order_path.exists():
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            return done.returncode or 1
        order = json.loads(order_path.read_text())
    version = subprocess.run([args.ncu, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    import triton

    result = {
        "command": "python3 scripts/profile_fused_kernels.py "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "ncu_command": " ".join(shlex.quote(c) for c in command[:14]) + " python3 <this script> --worker ...",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ncu": version.splitlines()[-1] if version else None,
        "started": started,
        "what": "one launch of each phase-7 kernel (default launch config) and of a copy kernel of the same "
        "payload (torch.neg over fp32), each alone under ncu with caches flushed before it and clocks as found",
        "rows": pair_rows(order, parse_ncu_csv(done.stdout)),
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"{'op':<16}{'T':>8}{'us':>8}{'DRAM/payload':>14}{'DRAM GB/s':>11}{'DRAM %peak':>11}{'occupancy':>10}")
    for r in result["rows"]:
        print(
            f"{r['op']:<16}{r['T']:>8}{r['duration_ns'] / 1e3:>8.1f}{r['dram_bytes_over_payload']:>14.2f}"
            f"{r['dram_gbps']:>11.0f}{r['dram_pct_of_peak']:>10.0f}%{r['achieved_occupancy_pct']:>9.0f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
