"""GPU benchmark of the two compute cores of a DSA layer: the GPU kernels against the torch references.

Usage::

    python -m reference_impl.bench.compute --out results.json [--tokens 8192,32768,131072]
        [--heads 128 --topk 2048] [--index-heads 64 --index-dim 128] [--sweep]

For each query count ``T`` the full view holds ``S = T`` keys (one request, causal): query ``t``
sees keys ``[0, t]``. Sparse attention gets, per query, ``topk`` indices drawn uniformly from its
visible rows (``-1`` beyond ``t + 1`` when fewer are visible). FLOPs of sparse attention are
counted as ``2 * T * topk * H * (576 + 512)`` (every slot, as the kernel computes every slot);
FlashMLA's published sparse prefill rate, 640 TFLOPS, is the reference. The indexer computes
``Hi x D`` logits over each query's visible keys, then top-k; its FLOPs are
``2 * Hi * D * sum(visible keys)``. One more row, "one rank at C=8, 128K tokens", runs rank 0 of
the zigzag split: ``T_local = 16384`` queries (blocks 0 and 15 of 16) against ``S = 131072`` keys.

Sparse attention rows time the Triton kernel and, on sm_90, both Gluon kernels
(:mod:`reference_impl.kernels.sparse_mla_gluon` and the warp-specialized
:mod:`reference_impl.kernels.sparse_mla_gluon_ws`); ``engine_ms`` / ``engine_tflops`` are those of the
kernel the dispatch runs (what the capacity planner reads).

Before timing, each size checks each kernel's result against the torch reference on a slice of rows
(first, random and last). Times are medians of ``triton.testing.do_bench``; a call slower than
``--slow-ms`` is timed instead as the median of 3 runs with CUDA events (recorded per row). The
torch references run only up to ``--torch-max-tokens`` query rows: beyond that they take seconds
per call (the indexer reference materializes ``[rows, Hi, keys]`` fp32 logits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from reference_impl.bench.compute_cases import (
    D_QK,
    D_V,
    FLASHMLA_TFLOPS,
    bench_attention,
    bench_indexer,
    dispatch_smoke,
    measure_matmul_tflops,
    zigzag_rank0_positions,
)
from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, MAX_SEED, ConfigError
from reference_impl.tool_args import (
    ToolParser,
    device_arg,
    float_arg,
    int_arg,
    int_list,
    output_file,
    refusing,
    require_cuda,
)

# ---- driver -----------------------------------------------------------------------------------


PROG = "python -m reference_impl.bench.compute"
MAX_WIDTH = 1 << 12  # heads, index heads and head widths: past any model's (128 heads, 128-wide index keys)


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default="8192,32768,131072", help="query counts T (S = T), comma separated")
    parser.add_argument("--heads", type=int_arg(1, MAX_WIDTH), default=128, help="attention heads H")
    parser.add_argument("--topk", type=int_arg(1, MAX_BATCH_TOKENS), default=2048, help="keys each query attends to")
    parser.add_argument("--index-heads", type=int_arg(1, MAX_WIDTH), default=64, help="indexer heads Hi")
    parser.add_argument("--index-dim", type=int_arg(1, MAX_WIDTH), default=128, help="indexer key width D")
    parser.add_argument(
        "--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="the per-rank row: C of the zigzag split"
    )
    parser.add_argument(
        "--cp-context",
        type=int_arg(1, MAX_BATCH_TOKENS),
        default=131072,
        help="the per-rank row: tokens of the request",
    )
    parser.add_argument(
        "--torch-max-tokens", type=int_arg(0), default=16384, help="time the torch references up to this T"
    )
    parser.add_argument("--check-rows", type=int_arg(1), default=48, help="rows checked against the torch reference")
    parser.add_argument("--slow-ms", type=float_arg(), default=250.0, help="above this, time with 3 event-timed runs")
    parser.add_argument("--sweep", action="store_true", help="sweep launch configs at the per-rank shape first")
    parser.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0, help="inputs' random seed")
    parser.add_argument("--device", type=device_arg, default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_path = output_file(args.out)
    tokens = int_list(args.tokens, "--tokens", 1, MAX_BATCH_TOKENS)
    if args.cp_context < 2 * args.cp_size:
        raise ConfigError(
            f"--cp-context {args.cp_context}: the zigzag split of C={args.cp_size} ranks (--cp-size) "
            f"needs at least {2 * args.cp_size} tokens"
        )
    require_cuda(args.device)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # dry run of the script's logic at toy sizes
    import triton

    from reference_impl.bench import compute_sweep
    from reference_impl.kernels import dispatch, indexer_triton, sparse_mla_triton

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    on_gpu = args.device == "cuda"
    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.compute " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("DSACP_")},
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter dry run)",
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "seed": args.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "flops_attention": "2 * T * topk * H * (576 + 512)",
        "flops_indexer": "2 * Hi * D * sum over queries of visible keys",
        "flashmla_reference_tflops": FLASHMLA_TFLOPS,
        "attention_output_dtype": "bf16 (timed); the dispatch path returns fp32",
        "shapes": {
            "tokens": args.tokens,
            "heads": args.heads,
            "topk": args.topk,
            "d_qk": D_QK,
            "d_v": D_V,
            "index_heads": args.index_heads,
            "index_dim": args.index_dim,
        },
        "timing": "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms); calls slower than "
        f"{args.slow_ms} ms: median of 3 CUDA-event-timed runs after one warm-up run",
        "torch_reference_limit": f"torch references timed only for T <= {args.torch_max_tokens} query rows",
    }

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2))

    result["bf16_matmul_8192_tflops"] = measure_matmul_tflops(args.device)
    try:
        result["dispatch_smoke"] = dispatch_smoke(args.device)
    except Exception as exc:  # recorded, not fatal: the kernels are timed directly below
        result["dispatch_smoke"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    save()
    attn_cfg = compute_sweep.attention_config(sparse_mla_triton.GPU_DEFAULT_CONFIG)
    idx_cfg = compute_sweep.indexer_config(indexer_triton.GPU_DEFAULT_CONFIG)
    gluon_default: tuple[Any, ...] | None = None
    if on_gpu and dispatch.gluon_available():
        from reference_impl.kernels import sparse_mla_gluon

        gluon_default = sparse_mla_gluon.GPU_DEFAULT_CONFIG
    gluon_cfg = None if gluon_default is None else compute_sweep.gluon_config(gluon_default)

    if args.sweep:
        # At the per-rank shape, the one the engine runs: rank 0's zigzag queries against the whole request.
        pos = zigzag_rank0_positions(args.cp_context, args.cp_size)
        t0 = args.cp_context
        no_torch = argparse.Namespace(**{**vars(args), "torch_max_tokens": 0})
        sweep_a, sweep_i, sweep_g = compute_sweep.run_sweep(
            lambda config: bench_attention(pos, t0, no_torch, config, gen),
            lambda config: bench_indexer(pos, t0, no_torch, config, gen),
            None if gluon_cfg is None else lambda config: bench_attention(pos, t0, no_torch, None, gen, config),
        )
        result["sweep"] = {
            "T": int(pos.numel()),
            "S": t0,
            "what": f"rank 0 of C={args.cp_size} over {t0} keys (the per-rank shape)",
            "attention": sweep_a,
            "indexer": sweep_i,
            "gluon": sweep_g,
        }
        # The rows below run the configs the engine will (scripts/apply_sweep.py applies the same pick).
        attn_cfg = compute_sweep.attention_config(
            compute_sweep.pick_attention(sweep_a, sparse_mla_triton.GPU_DEFAULT_CONFIG)
        )
        idx_cfg = compute_sweep.indexer_config(compute_sweep.pick_indexer(sweep_i, indexer_triton.GPU_DEFAULT_CONFIG))
        if gluon_default is not None:
            gluon_cfg = compute_sweep.gluon_config(compute_sweep.pick_gluon(sweep_g, gluon_default))
        save()

    def guarded(fn: Callable[..., dict[str, Any]], *fn_args: Any) -> dict[str, Any]:
        try:
            return fn(*fn_args)
        except Exception as exc:  # recorded in the JSON; the other sizes still run
            return {"T": fn_args[0].numel(), "S": fn_args[1], "error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            if on_gpu:
                torch.cuda.empty_cache()  # the section's inputs died with its frame: hand their memory back

    result["attention"], result["indexer"] = [], []
    for t in tokens:
        pos = torch.arange(t)
        result["attention"].append(guarded(bench_attention, pos, t, args, attn_cfg, gen, gluon_cfg, True))
        save()
        result["indexer"].append(guarded(bench_indexer, pos, t, args, idx_cfg, gen))
        save()
        print(f"T={t} done", flush=True)

    pos = zigzag_rank0_positions(args.cp_context, args.cp_size)
    result["per_rank"] = {
        "cp_size": args.cp_size,
        "what": f"rank 0 of C={args.cp_size}, in-seq split of one {args.cp_context}-token request: "
        f"{pos.numel()} local queries against {args.cp_context} keys",
        "attention": guarded(bench_attention, pos, args.cp_context, args, attn_cfg, gen, gluon_cfg, True),
        "indexer": guarded(bench_indexer, pos, args.cp_context, args, idx_cfg, gen),
    }
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    print(format_table(result))
    return 0


def _fmt(x: float | None, spec: str) -> str:
    if x is None or math.isnan(x):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 0))
    return format(x, spec)


def _status(row: dict[str, Any]) -> str:
    ok = row["check"]["ok"] and all(row.get(k, {}).get("check", {}).get("ok", True) for k in ("gluon", "gluon_ws"))
    return f"{_fmt(row.get('torch_ms'), '>11.2f')}{_fmt(row.get('speedup'), '>8.1f')}x  {'ok' if ok else 'FAIL'}"


def format_table(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    attn_title = f"sparse MLA attention (H={shapes['heads']}, topk={shapes['topk']})"
    idx_title = f"indexer top-k (Hi={shapes['index_heads']}, D={shapes['index_dim']})"
    lines = [
        f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
        f"bf16 matmul {result['bf16_matmul_8192_tflops']:.0f} TFLOPS",
        (
            f"{attn_title:<44}triton ms  TFLOPS  /640  gluon ms  TFLOPS  /640  ws-gluon ms  TFLOPS  /640"
            "   torch ms  speedup  check"
        ),
    ]
    rows = [(f"T=S={r['T']}", r) for r in result["attention"]]
    rank = result["per_rank"]
    rows.append((f"rank0 C={rank['cp_size']} T={rank['attention']['T']} S={rank['attention']['S']}", rank["attention"]))
    for name, r in rows:
        if "error" in r:
            lines.append(f"  {name:<42}ERROR {r['error'][:70]}")
            continue
        g, w = r.get("gluon", {}), r.get("gluon_ws", {})
        lines.append(
            f"  {name:<42}{r['triton_ms']:>9.2f}{r['triton_tflops']:>8.0f}{r['fraction_of_flashmla_640']:>6.0%}"
            f"{_fmt(g.get('ms'), '>10.2f')}{_fmt(g.get('tflops'), '>8.0f')}"
            f"{_fmt(g.get('fraction_of_flashmla_640'), '>6.0%')}"
            f"{_fmt(w.get('ms'), '>13.2f')}{_fmt(w.get('tflops'), '>8.0f')}"
            f"{_fmt(w.get('fraction_of_flashmla_640'), '>6.0%')}" + _status(r)
        )
    lines.append(f"{idx_title:<44}triton ms  logits ms  TFLOPS  topk ms  kernel topk   torch ms  speedup  check")
    rows = [(f"T=S={r['T']}", r) for r in result["indexer"]]
    rows.append((f"rank0 C={rank['cp_size']} T={rank['indexer']['T']} S={rank['indexer']['S']}", rank["indexer"]))
    for name, r in rows:
        if "error" in r:
            lines.append(f"  {name:<42}ERROR {r['error'][:70]}")
            continue
        lines.append(
            f"  {name:<42}{r['triton_ms']:>9.2f}{r['triton_logits_ms']:>11.2f}{r['logits_tflops']:>8.0f}"
            f"{r['topk_ms']:>9.2f}{_fmt(r.get('select_kernel_topk_ms'), '>13.2f')}" + _status(r)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
