"""Memory-bound CP kernels (phase 7) against their torch paths, and the phase-6 remap, on one GPU.

Usage::

    python -m reference_impl.bench.kernels --out FILE.json [--tokens 32768,131072] [--cp-size 8] [--sweep]
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
are divided by the measured device copy bandwidth (a 1 GiB device-to-device copy, read + write).
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

Timing: median of ``triton.testing.do_bench`` (warm-up 25 ms, rep 100 ms) on CUDA; on ``--device cpu``
the median of ``--cpu-repeats`` wall-clock runs under ``TRITON_INTERPRET=1`` (a dry run of the
harness: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reference_impl.kernels.fused_configs import LaunchConfig

COPY_BYTES_GPU = 1 << 30
BAR_FRACTION = 0.8
BAR_MIN_TOKENS = 32768
WARMUP_MS, REP_MS = 25, 100


def _timer(
    device: torch.device, cpu_repeats: int, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS
) -> Callable[[Callable[[], object]], float]:
    def time_ms(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        fn()
        times = []
        for _ in range(cpu_repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return time_ms


def copy_bandwidth(device: torch.device, time_ms: Callable[[Callable[[], object]], float]) -> dict[str, Any]:
    """A large device-to-device copy: GB/s counting bytes read + written."""
    n = COPY_BYTES_GPU if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * n, "ms": ms, "gbps": 2 * n / ms / 1e6}


def _bytes_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


@dataclass
class Case:
    """One benchmark row: a Triton kernel (``run(config)``, ``config`` its launch keywords) against
    its torch path (``reference()``), both writing the tensors ``outputs()`` returns."""

    op: str
    kernel: str  # the launch-config name (reference_impl.kernels.fused_configs) the row runs with
    rows: int
    payload: int
    index_bytes: int
    run: Callable[[LaunchConfig], object]
    reference: Callable[[], object]
    outputs: Callable[[], list[torch.Tensor]]

    def reference_bytes(self) -> list[torch.Tensor]:
        """Run the torch path; a copy of its outputs."""
        self.reference()
        return [t.clone() for t in self.outputs()]

    def kernel_bytes(self, config: LaunchConfig, want: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """Zero the outputs, run the kernel with ``config``: (bytes differing from ``want``, a copy of the outputs)."""
        for t in self.outputs():  # the kernel must write every byte the check compares
            t.view(torch.uint8).zero_()
        self.run(config)
        got = [t.clone() for t in self.outputs()]
        return sum(_bytes_diff(a, b) for a, b in zip(got, want)), got


def _row(
    case: Case,
    config: LaunchConfig,
    tokens: int,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
) -> dict[str, Any]:
    """Check the kernel's bytes against the torch path, then time both."""
    differing, _ = case.kernel_bytes(config, case.reference_bytes())
    row: dict[str, Any] = {
        "op": case.op,
        "T": tokens,
        "rows": case.rows,
        "bytes": case.payload,
        "index_vector_bytes": case.index_bytes,
        "config": config,
    }
    row["check"] = {"differing_bytes": differing, "bytes_equal": differing == 0}
    for name, fn in (("triton", lambda: case.run(config)), ("torch", case.reference)):
        ms = time_ms(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = case.payload / ms / 1e6
        row[f"{name}_fraction_of_copy"] = case.payload / ms / 1e6 / copy_gbps
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def build_cases(tokens: int, args: argparse.Namespace) -> list[Case]:
    """Every benchmark row at ``tokens`` tokens, inputs allocated once (the rows share them)."""
    from reference_impl.config import get_preset
    from reference_impl.cp.split import build_split, rerange_tensor
    from reference_impl.kernels import fused_torch
    from reference_impl.kernels.fused_materialize import materialize_rows_triton
    from reference_impl.kernels.fused_rerange import rerange_padded_triton
    from reference_impl.kernels.fused_store import store_index_triton, store_mla_triton
    from reference_impl.kvcache.layout import KVLayout

    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed + tokens)
    cfg = get_preset(args.preset)
    page = args.page_size
    n_pages = -(-tokens // page)
    on_gpu = device.type == "cuda"
    cases: list[Case] = []

    # Store: all T rows to page-shuffled slots (an allocator's pages, slots in order).
    kv = torch.randn(tokens, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, cfg.index_head_dim, device=device, generator=gen).to(torch.bfloat16)
    pages = torch.randperm(n_pages, device=device, generator=gen)
    locs = (pages[:, None] * page + torch.arange(page, device=device)).flatten()[:tokens].contiguous()
    for kv_dtype in ("fp8", "bf16"):
        layout = KVLayout.from_config(cfg, kv_dtype, page)
        pool = torch.zeros(n_pages * page, layout.mla_bytes, dtype=torch.uint8, device=device)
        store_bytes = tokens * (kv.shape[1] * 2 + layout.mla_bytes)

        def store_mla(config: LaunchConfig, layout: KVLayout = layout, pool: torch.Tensor = pool, **kw: Any) -> None:
            store_mla_triton(kv, None, locs, pool, layout, **config, **kw)

        def store_mla_ref(layout: KVLayout = layout, pool: torch.Tensor = pool) -> None:
            fused_torch.store_mla_torch(kv, None, locs, pool, layout)

        def pool_out(pool: torch.Tensor = pool) -> list[torch.Tensor]:
            return [pool]

        name = f"store_mla_{kv_dtype}"
        cases.append(Case(name, name, tokens, store_bytes, tokens * 8, store_mla, store_mla_ref, pool_out))
        if kv_dtype == "fp8" and on_gpu:  # the software fp8/bf16 conversion, timed on the GPU too
            soft = functools.partial(store_mla, soft=True)
            cases.append(
                Case(f"{name}_soft_convert", name, tokens, store_bytes, tokens * 8, soft, store_mla_ref, pool_out)
            )
    layout = KVLayout.from_config(cfg, "fp8", page)
    index_pool = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8, device=device)
    index_store_bytes = tokens * (k.shape[1] * 2 + layout.index_bytes)

    def store_index(config: LaunchConfig, **kw: Any) -> None:
        store_index_triton(k, None, locs, index_pool, layout, **config, **kw)

    def store_index_ref() -> None:
        fused_torch.store_index_torch(k, None, locs, index_pool, layout)

    cases.append(
        Case(
            "store_index",
            "store_index",
            tokens,
            index_store_bytes,
            tokens * 8,
            store_index,
            store_index_ref,
            lambda: [index_pool],
        )
    )
    if on_gpu:
        soft_index = functools.partial(store_index, soft=True)
        cases.append(
            Case(
                "store_index_soft_convert",
                "store_index",
                tokens,
                index_store_bytes,
                tokens * 8,
                soft_index,
                store_index_ref,
                lambda: [index_pool],
            )
        )

    # Rerange: the padded all-gather buffer of the in-seq split of one request.
    meta = build_split("in-seq", args.cp_size, [tokens], [0], page)
    padded_index, rerange_index = rerange_tensor(meta, device, padded=True), rerange_tensor(meta, device)
    for name, width in (("kv", kv.shape[1]), ("index", k.shape[1])):
        raw = torch.randn(args.cp_size, meta.max_rank_len, width, device=device, generator=gen).to(torch.bfloat16)
        holder: list[torch.Tensor] = []  # each path allocates its result, as the engine would
        rerange_bytes = tokens * width * 2 * 2

        def rerange(config: LaunchConfig, raw: torch.Tensor = raw, holder: list[torch.Tensor] = holder) -> None:
            holder[:] = [rerange_padded_triton(raw, padded_index, **config)]

        def rerange_ref(raw: torch.Tensor = raw, holder: list[torch.Tensor] = holder) -> None:
            holder[:] = [fused_torch.rerange_padded_torch(raw, meta.rank_lengths, rerange_index)]

        def held(holder: list[torch.Tensor] = holder) -> list[torch.Tensor]:
            return holder

        op = f"rerange_{name}"
        cases.append(Case(op, op, tokens, rerange_bytes, tokens * 8, rerange, rerange_ref, held))
        if name == "kv":
            flat = raw.view(-1, width)

            def padded_gather(flat: torch.Tensor = flat, holder: list[torch.Tensor] = holder) -> None:
                holder[:] = [flat.index_select(0, padded_index)]

            cases.append(
                Case(
                    "rerange_kv_torch_padded_gather",
                    op,
                    tokens,
                    rerange_bytes,
                    tokens * 8,
                    rerange,
                    padded_gather,
                    held,
                )
            )

    # Materialize: every page gathered (MLA half and index half of one packed buffer, no copy).
    split = page * layout.mla_bytes
    gathered = torch.empty(n_pages, split + layout.index_page_bytes, dtype=torch.uint8, device=device)
    mla_rows = torch.zeros(n_pages * page, layout.mla_bytes, dtype=torch.uint8, device=device)
    fused_torch.store_mla_torch(kv, None, torch.arange(tokens, device=device), mla_rows, layout)
    gathered[:, :split].copy_(mla_rows.view(n_pages, split))
    del mla_rows
    fused_torch.store_index_torch(k, None, torch.arange(tokens, device=device), gathered[:, split:], layout)
    row_source = locs  # gathered page order is arbitrary: reuse the shuffled page order
    view_rows = torch.arange(tokens, device=device)
    view = torch.empty(tokens, kv.shape[1], dtype=torch.bfloat16, device=device)
    index_fp8 = torch.empty(tokens, k.shape[1], dtype=torch.float8_e4m3fn, device=device)
    index_scale = torch.empty(tokens, dtype=torch.float32, device=device)
    margs = (gathered[:, :split], gathered[:, split:], row_source, view_rows, view, index_fp8, index_scale, layout)
    cases.append(
        Case(
            "materialize_fp8",
            "materialize_fp8",
            tokens,
            tokens * (layout.mla_bytes + layout.index_bytes + kv.shape[1] * 2 + layout.index_bytes),
            tokens * 16,
            lambda config: materialize_rows_triton(*margs, **config),
            lambda: fused_torch.materialize_rows_torch(*margs),
            lambda: [view, index_fp8, index_scale],
        )
    )
    return cases


def bench_tokens(
    tokens: int,
    args: argparse.Namespace,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
    configs: dict[str, LaunchConfig],
) -> list[dict[str, Any]]:
    """Every row at ``tokens``, each kernel with its config from ``configs`` (by launch-config name)."""
    rows_out: list[dict[str, Any]] = []
    for case in build_cases(tokens, args):
        row = _row(case, configs[case.kernel], tokens, time_ms, copy_gbps)
        rows_out.append(row)
        print(
            f"  {case.op:<34}{row['triton_ms']:>9.3f} ms{row['torch_ms']:>9.3f} ms  check "
            f"{'ok' if row['check']['bytes_equal'] else 'DIFF'}",
            flush=True,
        )
    return rows_out


def bench_remap(
    tokens: int, args: argparse.Namespace, time_ms: Callable[[Callable[[], object]], float]
) -> dict[str, Any]:
    from reference_impl.config import get_preset
    from reference_impl.cp.remap import owned_slot_table, page_inverse_remap, sorted_remap

    device = torch.device(args.device)
    page, cp, rank = args.page_size, args.cp_size, 0
    n_pages = -(-tokens // page)
    locs = torch.arange(tokens, device=device)
    table = owned_slot_table(page, cp, rank, n_pages, device)
    fast = page_inverse_remap(locs, page, cp, rank)
    slow = sorted_remap(locs, page, cp, rank, n_pages, slot_table=table)
    sorted_ms = time_ms(lambda: sorted_remap(locs, page, cp, rank, n_pages, slot_table=table))
    page_ms = time_ms(lambda: page_inverse_remap(locs, page, cp, rank))
    layers = get_preset(args.preset).n_layers
    return {
        "T": tokens,
        "cp_size": cp,
        "page_size": page,
        "equal": bool(torch.equal(fast, slow)),
        "sorted_ms": sorted_ms,
        "page_inverse_ms": page_ms,
        "per_call_ratio": sorted_ms / page_ms,
        "per_layer_ratio": 2 * sorted_ms / page_ms,  # baseline per layer (MLA + index) vs page inverse once per forward
        "per_forward_ratio": 2 * layers * sorted_ms / page_ms,
        "layers": layers,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
        f"copy {result['copy']['gbps']:.0f} GB/s (read + write)",
        f"{'op':<34}{'T':>8}{'triton ms':>11}{'GB/s':>8}{'/copy':>7}{'torch ms':>10}{'GB/s':>8}{'/copy':>7}"
        f"{'speedup':>9}  check",
    ]
    for r in result["kernels"]:
        if "error" in r:
            lines.append(f"{r['op']:<34}{r['T']:>8}  ERROR {r['error'][:80]}")
            continue
        lines.append(
            f"{r['op']:<34}{r['T']:>8}{r['triton_ms']:>11.3f}{r['triton_gbps']:>8.0f}{r['triton_fraction_of_copy']:>7.0%}"
            f"{r['torch_ms']:>10.3f}{r['torch_gbps']:>8.0f}{r['torch_fraction_of_copy']:>7.0%}{r['speedup']:>8.1f}x  "
            + ("ok" if r["check"]["bytes_equal"] else f"DIFF {r['check']['differing_bytes']} B")
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


def _token_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default=None, help="token counts, comma separated (default 32768,131072; cpu: 64)")
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-repeats", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: interpreter dry run")
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
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules import triton
    import triton

    from reference_impl.bench import kernel_sweep
    from reference_impl.kernels.fused_configs import KERNELS, default_config

    on_gpu = args.device == "cuda"
    tokens = _token_list(args.tokens or ("32768,131072" if on_gpu else "64"))
    sweep_tokens = _token_list(args.sweep_tokens) if args.sweep_tokens else [max(tokens)]
    device = torch.device(args.device)
    time_ms = _timer(device, args.cpu_repeats)
    configs = {kernel: default_config(kernel, device) for kernel in KERNELS}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
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
        "timing": f"triton.testing.do_bench median (warmup {WARMUP_MS} ms, rep {REP_MS} ms)"
        if on_gpu
        else f"cpu wall clock, median of {args.cpu_repeats} after one warm-up (dry run, meaningless)",
        "bytes": "payload read + written once per byte; int64 row/loc vectors in index_vector_bytes",
        "bar": f">= {BAR_FRACTION:.0%} of copy bandwidth at >= {BAR_MIN_TOKENS} tokens and faster than torch",
    }
    result["copy"] = copy_bandwidth(device, time_ms)
    if args.sweep:
        sweep_timer = _timer(device, args.cpu_repeats, kernel_sweep.SWEEP_WARMUP_MS, kernel_sweep.SWEEP_REP_MS)
        result["sweep_settings"] = {
            "tokens": sweep_tokens,
            "timing": f"triton.testing.do_bench median (warmup {kernel_sweep.SWEEP_WARMUP_MS} ms, "
            f"rep {kernel_sweep.SWEEP_REP_MS} ms)"
            if on_gpu
            else result["timing"],
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
