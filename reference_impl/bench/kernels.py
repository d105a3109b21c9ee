"""Memory-bound CP kernels (phase 7) against their torch paths, and the phase-6 remap, on one GPU.

Usage::

    python -m reference_impl.bench.kernels --out FILE.json [--tokens 32768,131072] [--cp-size 8] [--sweep] [--repeats N]
    python -m reference_impl.bench.kernels --out dry.json --device cpu [--sweep]  # interpreter dry run, toy sizes

For each token count ``T`` (one request of ``T`` current tokens, DeepSeek-V3.2 widths):

* ``store_mla_fp8`` / ``store_mla_bf16``: ``T`` rows ``[T, 576]`` bf16 packed and scattered to
  page-shuffled slots; ``store_index``: ``[T, 128]`` bf16 quantized (ue8m0) into index pages;
* ``rerange_kv`` / ``rerange_index``: the padded all-gather buffer ``[C, max_len, W]`` bf16 of the
  in-seq split of the request over ``--cp-size`` ranks -> ``[T, W]``; the extra row
  ``rerange_kv_torch_padded_gather`` is torch's one-pass alternative (``index_select`` on the
  padded buffer), for reference;
* ``materialize_fp8``: all ``T / P`` pages gathered (the packed gather buffer, MLA and index halves
  side by side) -> the ``[T, 576]`` bf16 view, index fp8 bytes and scales;
* on GPU, ``*_soft_convert`` rows: the store kernels with the software fp8 / bf16 rounding
  (``soft=True``, what the CPU interpreter runs) instead of the hardware conversions.

Bytes moved count each byte read and written once, payload only: e.g. store FP8 reads ``T * 576 * 2``
and writes ``T * 656``; the int64 row / loc vectors (8-16 B per row) are reported separately. GB/s
are divided by the measured device copy bandwidth (a 1 GiB device-to-device copy, read + write);
``same_size_copy_ms`` is a copy of the row's own payload (``payload / 2`` bytes read and written),
and ``triton_fraction_of_same_size_copy`` its time over the kernel's: what a transfer of that size
reaches, launch, ramp-up and the grid's tail included, against the kernel.
Before timing, each kernel's output bytes are compared with the torch path's (on GPU the kernels
use the hardware fp8 / bf16 conversions).

Launch configs: each row runs its kernel with one config (``"config"`` in the row; all of them
under ``"configs"``, keyed by :mod:`reference_impl.kernels.fused_configs` names). Without
``--sweep`` these are the defaults. With ``--sweep`` the harness of
:mod:`reference_impl.bench.kernel_sweep` first checks and times candidate configs per kernel at the
largest ``--tokens`` value (or ``--sweep-tokens``) and records them under ``"sweep"``:
``{kernel: {default, candidates: [{config, ms, gbps, fraction_of_copy, bytes_equal, ...}], best,
best_basis, ...}}``; the rows then run with each kernel's best (``"config_source"`` says which).

Phase 6: ``remap``: ``torch.sort`` + ``torch.searchsorted`` (:func:`reference_impl.cp.remap.sorted_remap`)
vs page arithmetic (:func:`~reference_impl.cp.remap.page_inverse_remap`) on ``T`` logical locs. The
baseline runs per layer per write (MLA and indexer K); the page inverse once per forward.

Timing on CUDA: the device time of a call, median of 200, each after an L2 flush and with its
launch queued behind a GPU sleep (:func:`reference_impl.bench.timing.queued_median_ms`: a kernel of
a few microseconds is timed without the host's launch work, which ``triton.testing.do_bench``
counts whenever it outlasts the flush, from run to run differently). ``--repeats N``
times each row's kernel and torch path ``N`` times, interleaved, and keeps the median of the ``N``
medians (all of them under ``*_ms_repeats``): the spread between calls is the noise. On ``--device cpu``
the median of ``--cpu-repeats`` wall-clock runs under ``TRITON_INTERPRET=1`` (a dry run of the
harness: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from typing import Any

import torch

from reference_impl.bench.kernel_cases import (
    BAR_FRACTION,
    BAR_MIN_TOKENS,
    REPS,
    bench_remap,
    bench_tokens,
    build_cases,
    copy_bandwidth,
    make_timer,
)
from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, MAX_SEED, ConfigError, validate_page_size
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_REPEATS,
    ToolParser,
    device_arg,
    dsa_preset_arg,
    int_arg,
    int_list,
    output_file,
    refusing,
    require_cuda,
)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
        f"copy {result['copy']['gbps']:.0f} GB/s (read + write)",
        f"{'op':<34}{'T':>8}{'triton ms':>11}{'GB/s':>8}{'/copy':>7}{'torch ms':>10}{'GB/s':>8}{'/copy':>7}"
        f"{'speedup':>9}  check  {'/same-size copy':>15}",
    ]
    for r in result["kernels"]:
        if "error" in r:
            lines.append(f"{r['op']:<34}{r['T']:>8}  ERROR {r['error'][:80]}")
            continue
        lines.append(
            f"{r['op']:<34}{r['T']:>8}{r['triton_ms']:>11.3f}{r['triton_gbps']:>8.0f}{r['triton_fraction_of_copy']:>7.0%}"
            f"{r['torch_ms']:>10.3f}{r['torch_gbps']:>8.0f}{r['torch_fraction_of_copy']:>7.0%}{r['speedup']:>8.1f}x  "
            + ("ok" if r["check"]["bytes_equal"] else f"DIFF {r['check']['differing_bytes']} B")
            + f"  {r['triton_fraction_of_same_size_copy']:>15.0%}"
        )
    lines.append(
        f"{'remap (phase 6)':<34}{'T':>8}{'sort ms':>11}{'page ms':>10}{'per call':>10}{'per layer':>11}{'per fwd':>10}"
    )
    for r in result["remap"]:
        lines.append(
            f"{'':<34}{r['T']:>8}{r['sorted_ms']:>11.4f}{r['page_inverse_ms']:>10.4f}{r['per_call_ratio']:>9.1f}x"
            f"{r['per_layer_ratio']:>10.1f}x{r['per_forward_ratio']:>9.0f}x  {'equal' if r['equal'] else 'DIFFER'}"
        )
    if "sweep" in result:
        from reference_impl.bench.kernel_sweep import format_sweep

        lines.append(format_sweep(result["sweep"]))
    return "\n".join(lines)


PROG = "python -m reference_impl.bench.kernels"


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default=None, help="token counts, comma separated (default 32768,131072; cpu: 64)")
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--page-size", type=int_arg(1), default=64, help="tokens per KV page (a power of two, 4..4096)")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0, help="inputs' random seed")
    parser.add_argument("--cpu-repeats", type=int_arg(1, MAX_REPEATS), default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=1, help="timings per row (median kept)")
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: interpreter dry run")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time candidate launch configs per kernel first; the rows then run with the best",
    )
    parser.add_argument(
        "--sweep-tokens",
        default=None,
        help="token counts of the sweep, comma separated (default: the largest --tokens value)",
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_path = output_file(args.out)
    on_gpu = args.device == "cuda"
    tokens = int_list(args.tokens or ("32768,131072" if on_gpu else "64"), "--tokens", 1, MAX_BATCH_TOKENS)
    sweep_tokens = (
        int_list(args.sweep_tokens, "--sweep-tokens", 1, MAX_BATCH_TOKENS) if args.sweep_tokens else [max(tokens)]
    )
    try:
        validate_page_size(args.page_size)
    except ConfigError as exc:
        raise ConfigError(f"--page-size: {exc}") from None
    require_cuda(args.device)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules import triton
    import triton

    from reference_impl.bench import kernel_sweep
    from reference_impl.kernels.fused_configs import KERNELS, default_config

    device = torch.device(args.device)
    time_ms = make_timer(device, args.cpu_repeats)
    configs = {kernel: default_config(kernel, device) for kernel in KERNELS}
    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.kernels "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "seed": args.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "shapes": {"tokens": tokens, "cp_size": args.cp_size, "page_size": args.page_size, "preset": args.preset},
        "configs": configs,
        "config_source": "defaults (reference_impl.kernels.fused_configs)",
        "timing": f"device time, median of {REPS} calls, L2 flushed and the launch queued behind a GPU sleep "
        "before each (bench.timing.queued_median_ms)"
        if on_gpu
        else f"cpu wall clock, median of {args.cpu_repeats} after one warm-up (dry run, meaningless)",
        "bytes": "payload read + written once per byte; int64 row/loc vectors in index_vector_bytes",
        "bar": f">= {BAR_FRACTION:.0%} of copy bandwidth at >= {BAR_MIN_TOKENS} tokens and faster than torch",
        "repeats": args.repeats,
        "same_size_copy": "Tensor.copy_ of payload / 2 bytes (read + write = the row's payload), same timer",
    }
    result["copy"] = copy_bandwidth(device, time_ms)
    if args.sweep:
        sweep_timer = make_timer(device, args.cpu_repeats, kernel_sweep.SWEEP_REPS)
        result["sweep_settings"] = {
            "tokens": sweep_tokens,
            "timing": f"as the rows', median of {kernel_sweep.SWEEP_REPS} calls" if on_gpu else result["timing"],
            "best": "highest fraction of copy bandwidth (mean over the sweep tokens) among candidates whose "
            "bytes equal torch's (else the default config's: best_basis)",
        }

        def save_partial(partial: dict[str, dict[str, Any]]) -> None:
            out_path.write_text(json.dumps(result | {"sweep": partial}, indent=2))

        try:
            result["sweep"] = kernel_sweep.sweep(
                lambda t: build_cases(t, args), sweep_tokens, device, sweep_timer, result["copy"]["gbps"], save_partial
            )
        except Exception as exc:  # noqa: BLE001  # recorded; the rows still run, with the defaults
            result["sweep_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"sweep failed: {result['sweep_error']}", file=sys.stderr, flush=True)
        else:
            for kernel, swept in result["sweep"].items():
                if swept["best"] is not None:
                    configs[kernel] = dict(swept["best"])
            result["config_source"] = "sweep best per swept kernel, defaults for the others"
            print(kernel_sweep.format_sweep(result["sweep"]), flush=True)
        out_path.write_text(json.dumps(result, indent=2))
    result["kernels"], result["remap"] = [], []
    for t in tokens:
        print(f"T={t}", flush=True)
        try:
            result["kernels"].extend(bench_tokens(t, args, time_ms, result["copy"]["gbps"], configs))
        except Exception as exc:  # recorded in the JSON; the other sizes still run
            result["kernels"].append({"op": "all", "T": t, "error": f"{type(exc).__name__}: {exc}"[:500]})
        result["remap"].append(bench_remap(t, args, time_ms))
        if on_gpu:
            torch.cuda.empty_cache()
        out_path.write_text(json.dumps(result, indent=2))
    for r in result["kernels"]:
        if "error" not in r:
            r["meets_bar"] = bool(
                r["T"] >= BAR_MIN_TOKENS and r["triton_fraction_of_copy"] >= BAR_FRACTION and r["speedup"] > 1
            )
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out_path.write_text(json.dumps(result, indent=2))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
