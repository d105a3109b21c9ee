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

Sparse attention rows time the Triton kernel and, on sm_90, the Gluon kernel
(:mod:`reference_impl.kernels.sparse_mla_gluon`); ``engine_ms`` / ``engine_tflops`` are those of the
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
from pathlib import Path
from typing import Any, Callable

import torch

from reference_impl.model import sparse_attention as ref

FLASHMLA_TFLOPS = 640.0
D_QK, D_V = 576, 512



def _time(fn: Callable[[], object], slow_ms: float) -> tuple[float, str]:
    """Median milliseconds of ``fn`` and the method used."""
    import triton.testing

    if not torch.cuda.is_available():  # --device cpu dry run under the interpreter
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, "cpu wall clock, one run (dry run)"

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()  # also the warm-up (compilation, autotuning caches)
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    if first > slow_ms:
        times = []
        for _ in range(3):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[1], "cuda events, median of 3"
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")), "do_bench median"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _check_rows(n_rows: int, n_check: int, gen: torch.Generator) -> torch.Tensor:
    third = max(1, n_check // 3)
    head = torch.arange(min(third, n_rows))
    tail = torch.arange(max(0, n_rows - third), n_rows)
    rand = torch.randint(0, n_rows, (n_check - 2 * third,), generator=gen)
    return torch.unique(torch.cat([head, rand, tail]))


# ---- inputs -----------------------------------------------------------------------------------


def attention_inputs(
    positions: torch.Tensor, n_kv: int, n_heads: int, topk: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, 576] bf16, kv [S, 576] bf16, indices [T, topk] int32 drawn from rows [0, pos]."""
    n_tokens = positions.numel()
    q = torch.randn(n_tokens, n_heads, D_QK, device=device, dtype=torch.bfloat16)
    kv = torch.randn(n_kv, D_QK, device=device, dtype=torch.bfloat16)
    pos = positions.to(device)
    visible = pos + 1
    draw = torch.rand(n_tokens, topk, device=device)
    indices = (draw * visible[:, None]).long().clamp_(max=(visible - 1)[:, None])
    slot = torch.arange(topk, device=device)
    indices = torch.where(slot[None, :] < visible[:, None], indices, -1).to(torch.int32)
    return q, kv, indices


def indexer_inputs(
    positions: torch.Tensor, n_kv: int, n_heads: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """q_fp8 [T, Hi, D], weights [T, Hi] f32, k_fp8 [S, D], k_scale [S] f32, key_start/key_end [T]."""
    n_tokens = positions.numel()
    q_fp8 = torch.randn(n_tokens, n_heads, dim, device=device).mul_(64).to(torch.float8_e4m3fn)
    weights = torch.randn(n_tokens, n_heads, device=device) * (n_heads * dim) ** -0.5 / 64
    k_fp8 = torch.randn(n_kv, dim, device=device).mul_(64).to(torch.float8_e4m3fn)
    k_scale = torch.rand(n_kv, device=device) / 64 + 1 / 256
    key_start = torch.zeros(n_tokens, dtype=torch.int64, device=device)
    key_end = positions.to(device) + 1
    return q_fp8, weights, k_fp8, k_scale, key_start, key_end


# ---- sections ---------------------------------------------------------------------------------


def _attention_check(
    kernel: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, scale: float,
) -> dict[str, Any]:
    """A kernel's fp32 result on ``rows`` against the torch reference."""
    out, lse = kernel(q[rows], indices[rows])
    ref_out, ref_lse = ref.sparse_mla_attention(q[rows], kv, indices[rows], scale, D_V)
    finite = torch.isfinite(ref_lse)
    check = {
        "rows": int(rows.numel()),
        "out_rel_err": _rel(out, ref_out),
        "lse_max_abs_err": float((lse[finite] - ref_lse[finite]).abs().max()),
        "lse_inf_match": bool(torch.equal(finite, torch.isfinite(lse))),
    }
    check["ok"] = check["out_rel_err"] < 1e-2 and check["lse_max_abs_err"] < 1e-2 and check["lse_inf_match"]
    return check


def bench_attention(
    positions: torch.Tensor,
    n_kv: int,
    args: argparse.Namespace,
    config: dict[str, Any] | None,
    gen: torch.Generator,
    gluon_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One attention row: the Triton kernel with ``config`` (skipped if ``None``) and, where it runs
    (sm_90), the Gluon kernel with ``gluon_config`` (skipped if ``None``), each checked then timed;
    ``engine_*`` repeat the numbers of the kernel the dispatch runs for these inputs."""
    from reference_impl.kernels import dispatch
    from reference_impl.kernels.sparse_mla_triton import sparse_mla_attention_triton

    device = torch.device(args.device)
    n_tokens, scale = positions.numel(), 192**-0.5
    q, kv, indices = attention_inputs(positions, n_kv, args.heads, args.topk, gen, device)
    rows = _check_rows(n_tokens, args.check_rows, gen).to(device)
    flops = 2.0 * n_tokens * args.topk * args.heads * (D_QK + D_V)
    row: dict[str, Any] = {
        "T": n_tokens,
        "S": n_kv,
        "H": args.heads,
        "topk": args.topk,
        "valid_slot_fraction": float((indices >= 0).float().mean()),
        "engine_kernel": dispatch.sparse_mla_kernel(q, kv, D_V),
    }
    if config is not None:
        row["config"] = config
        row["check"] = _attention_check(
            lambda qs, ix: sparse_mla_attention_triton(qs, kv, ix, scale, D_V, **config), q, kv, indices, rows, scale
        )
        ms, timer = _time(
            lambda: sparse_mla_attention_triton(q, kv, indices, scale, D_V, out_dtype=torch.bfloat16, **config),
            args.slow_ms,
        )
        tflops = flops / ms / 1e9
        row.update(
            triton_ms=ms, triton_tflops=tflops, fraction_of_flashmla_640=tflops / FLASHMLA_TFLOPS, triton_timer=timer
        )
    if gluon_config is not None and dispatch.gluon_available():
        from reference_impl.kernels.sparse_mla_gluon import gluon_supported, sparse_mla_attention_gluon

        if gluon_supported(q, kv, D_V):
            def gluon(qs: torch.Tensor, ix: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> Any:
                return sparse_mla_attention_gluon(qs, kv, ix, scale, D_V, out_dtype=out_dtype, **gluon_config)

            check = _attention_check(gluon, q, kv, indices, rows, scale)
            ms, timer = _time(lambda: gluon(q, indices, torch.bfloat16), args.slow_ms)
            tflops = flops / ms / 1e9
            row["gluon"] = {"config": gluon_config, "check": check, "ms": ms, "tflops": tflops,
                            "fraction_of_flashmla_640": tflops / FLASHMLA_TFLOPS, "timer": timer}
    engine = row["gluon"] if row["engine_kernel"] == "gluon" and "gluon" in row else None
    if engine is not None:
        row.update(engine_ms=engine["ms"], engine_tflops=engine["tflops"])
    elif "triton_ms" in row:
        row.update(engine_ms=row["triton_ms"], engine_tflops=row["triton_tflops"])
    if config is None:  # a Gluon sweep row: no torch timing
        return row
    if n_tokens <= args.torch_max_tokens:
        torch_ms, torch_timer = _time(lambda: ref.sparse_mla_attention(q, kv, indices, scale, D_V), args.slow_ms)
        row.update(
            torch_ms=torch_ms, torch_tflops=flops / torch_ms / 1e9, torch_timer=torch_timer,
            speedup=torch_ms / row["engine_ms"],
        )
    else:
        row["torch_ms"] = None
        row["torch_skipped"] = f"T > --torch-max-tokens {args.torch_max_tokens}"
    return row  # the inputs are freed with this frame; the caller empties the CUDA cache


def bench_indexer(
    positions: torch.Tensor, n_kv: int, args: argparse.Namespace, config: dict[str, Any], gen: torch.Generator
) -> dict[str, Any]:
    from reference_impl.kernels.indexer_triton import indexer_logits_triton, indexer_topk_triton

    device = torch.device(args.device)
    n_tokens = positions.numel()
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = indexer_inputs(
        positions, n_kv, args.index_heads, args.index_dim, device
    )
    rows = _check_rows(n_tokens, args.check_rows, gen).to(device)
    lo, hi = 0, int(key_end[rows].max())
    sub = (q_fp8[rows], weights[rows], k_fp8, k_scale, key_start[rows], key_end[rows])
    logits = indexer_logits_triton(*sub, lo, hi, **config)
    ref_scores = ref.indexer_scores(q_fp8[rows], weights[rows], k_fp8[lo:hi], k_scale[lo:hi])
    cols = torch.arange(lo, hi, device=device)
    visible = (cols >= key_start[rows, None]) & (cols < key_end[rows, None])
    got = indexer_topk_triton(*sub, args.topk, **config)
    want = ref.indexer_topk(*sub, args.topk)
    overlaps, worst_gap = [], 0.0
    masked = ref_scores.masked_fill(~visible, float("-inf"))
    for i in range(rows.numel()):
        g, w = set(got[i][got[i] >= 0].tolist()), set(want[i][want[i] >= 0].tolist())
        overlaps.append(len(g & w) / max(1, len(w)))
        if g != w:
            kth = masked[i, [c - lo for c in w]].min()
            diff = torch.tensor([c - lo for c in g ^ w], device=device)
            worst_gap = max(worst_gap, float(((masked[i, diff] - kth).abs() / kth.abs().clamp(min=1e-30)).max()))
    check = {
        "rows": int(rows.numel()),
        "logits_rel_err": _rel(logits[visible], ref_scores[visible]),
        "masked_all_neg_inf": bool(torch.isneginf(logits[~visible]).all()),
        "valid_counts_equal": bool(torch.equal((got >= 0).sum(1), (want >= 0).sum(1))),
        "topk_set_overlap_min": min(overlaps),
        "topk_set_overlap_mean": sum(overlaps) / len(overlaps),
        "swapped_max_rel_score_gap_to_kth": worst_gap,
    }
    check["ok"] = (
        check["logits_rel_err"] < 1e-3 and check["masked_all_neg_inf"] and check["valid_counts_equal"]
        and check["topk_set_overlap_min"] > 0.99
    )
    del logits, ref_scores, got, want, masked

    visible_keys = float((key_end - key_start).sum())
    flops = 2.0 * args.index_heads * args.index_dim * visible_keys

    def logits_only() -> None:
        chunk = max(1, (1 << 30) // (n_kv * 4))
        for r0 in range(0, n_tokens, chunk):
            r1 = min(n_tokens, r0 + chunk)
            indexer_logits_triton(
                q_fp8[r0:r1], weights[r0:r1], k_fp8, k_scale, key_start[r0:r1], key_end[r0:r1],
                int(key_start[r0:r1].min()), int(key_end[r0:r1].max()), **config,
            )

    full = (q_fp8, weights, k_fp8, k_scale, key_start, key_end)
    ms, timer = _time(lambda: indexer_topk_triton(*full, args.topk, **config), args.slow_ms)
    logits_ms, _ = _time(logits_only, args.slow_ms)
    row: dict[str, Any] = {
        "T": n_tokens,
        "S": n_kv,
        "Hi": args.index_heads,
        "D": args.index_dim,
        "topk": args.topk,
        "config": config,
        "check": check,
        "triton_ms": ms,
        "triton_logits_ms": logits_ms,
        "topk_ms": ms - logits_ms,
        "logits_tflops": flops / logits_ms / 1e9,
        "triton_timer": timer,
    }
    if n_tokens <= args.torch_max_tokens:
        torch_ms, torch_timer = _time(
            lambda: ref.indexer_topk(q_fp8, weights, k_fp8, k_scale, key_start, key_end, args.topk), args.slow_ms
        )
        row.update(torch_ms=torch_ms, torch_timer=torch_timer, speedup=torch_ms / ms)
    else:
        row["torch_ms"] = None
        row["torch_skipped"] = f"T > --torch-max-tokens {args.torch_max_tokens}"
    return row  # the inputs are freed with this frame; the caller empties the CUDA cache


def measure_matmul_tflops(device: str) -> float:
    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms, _ = _time(lambda: a @ b, slow_ms=1e9)
    return 2 * n**3 / ms / 1e9


def dispatch_smoke(device: str) -> dict[str, Any]:
    """Both dispatch functions on a small input: Triton path taken (no fallback warning), result checked."""
    import logging

    from reference_impl.kernels import dispatch

    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep(level=logging.WARNING)
    logging.getLogger(dispatch.__name__).addHandler(handler)
    try:
        gen = torch.Generator().manual_seed(1)
        pos = torch.arange(300)
        q, kv, indices = attention_inputs(pos, 300, 16, 64, gen, torch.device(device))
        out, lse = dispatch.sparse_mla_attention(q, kv, indices, 192**-0.5, D_V)
        ref_out, _ = ref.sparse_mla_attention(q, kv, indices, 192**-0.5, D_V)
        iq = indexer_inputs(pos, 300, 8, 128, torch.device(device))
        top = dispatch.indexer_topk(*iq, 64)
        want = ref.indexer_topk(*iq, 64)
    finally:
        logging.getLogger(dispatch.__name__).removeHandler(handler)
    return {
        "triton_available": dispatch.triton_available(),
        "fallback_warnings": [r.getMessage() for r in records],
        "attention_out_dtype": str(out.dtype),
        "attention_rel_err": _rel(out, ref_out),
        "indexer_valid_counts_equal": bool(torch.equal((top >= 0).sum(1), (want >= 0).sum(1))),
    }


def zigzag_rank0_positions(context: int, cp_size: int) -> torch.Tensor:
    """Sequence positions of rank 0 under the in-seq split of one request: blocks 0 and 2C-1."""
    blocks = torch.arange(context).tensor_split(2 * cp_size)
    return torch.cat([blocks[0], blocks[-1]])


# ---- driver -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default="8192,32768,131072", help="query counts T (S = T), comma separated")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--cp-size", type=int, default=8, help="the per-rank row: C of the zigzag split")
    parser.add_argument("--cp-context", type=int, default=131072, help="the per-rank row: tokens of the request")
    parser.add_argument("--torch-max-tokens", type=int, default=16384, help="time the torch references up to this T")
    parser.add_argument("--check-rows", type=int, default=48, help="rows checked against the torch reference")
    parser.add_argument("--slow-ms", type=float, default=250.0, help="above this, time with 3 event-timed runs")
    parser.add_argument("--sweep", action="store_true", help="sweep launch configs at the per-rank shape first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu: dry run
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # dry run of the script's logic at toy sizes
    import triton

    from reference_impl.bench import compute_sweep
    from reference_impl.kernels import dispatch, indexer_triton, sparse_mla_triton

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    on_gpu = args.device == "cuda"
    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.compute " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
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
            "tokens": args.tokens, "heads": args.heads, "topk": args.topk, "d_qk": D_QK, "d_v": D_V,
            "index_heads": args.index_heads, "index_dim": args.index_dim,
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
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
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
            "T": int(pos.numel()), "S": t0, "what": f"rank 0 of C={args.cp_size} over {t0} keys (the per-rank shape)",
            "attention": sweep_a, "indexer": sweep_i, "gluon": sweep_g,
        }
        # The rows below run the configs the engine will (scripts/apply_sweep.py applies the same pick).
        attn_cfg = compute_sweep.attention_config(compute_sweep.pick_attention(sweep_a, sparse_mla_triton.GPU_DEFAULT_CONFIG))
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
        result["attention"].append(guarded(bench_attention, pos, t, args, attn_cfg, gen, gluon_cfg))
        save()
        result["indexer"].append(guarded(bench_indexer, pos, t, args, idx_cfg, gen))
        save()
        print(f"T={t} done", flush=True)

    pos = zigzag_rank0_positions(args.cp_context, args.cp_size)
    result["per_rank"] = {
        "cp_size": args.cp_size,
        "what": f"rank 0 of C={args.cp_size}, in-seq split of one {args.cp_context}-token request: "
        f"{pos.numel()} local queries against {args.cp_context} keys",
        "attention": guarded(bench_attention, pos, args.cp_context, args, attn_cfg, gen, gluon_cfg),
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
    ok = row["check"]["ok"] and row.get("gluon", {}).get("check", {}).get("ok", True)
    return f"{_fmt(row.get('torch_ms'), '>11.2f')}{_fmt(row.get('speedup'), '>8.1f')}x  {'ok' if ok else 'FAIL'}"


def format_table(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    attn_title = f"sparse MLA attention (H={shapes['heads']}, topk={shapes['topk']})"
    idx_title = f"indexer top-k (Hi={shapes['index_heads']}, D={shapes['index_dim']})"
    lines = [
        f"{result['device']}  torch {result['torch']}  triton {result['triton']}  "
        f"bf16 matmul {result['bf16_matmul_8192_tflops']:.0f} TFLOPS",
        f"{attn_title:<44}triton ms  TFLOPS  /640  gluon ms  TFLOPS  /640   torch ms  speedup  check",
    ]
    rows = [(f"T=S={r['T']}", r) for r in result["attention"]]
    rank = result["per_rank"]
    rows.append((f"rank0 C={rank['cp_size']} T={rank['attention']['T']} S={rank['attention']['S']}", rank["attention"]))
    for name, r in rows:
        if "error" in r:
            lines.append(f"  {name:<42}ERROR {r['error'][:70]}")
            continue
        g = r.get("gluon", {})
        lines.append(
            f"  {name:<42}{r['triton_ms']:>9.2f}{r['triton_tflops']:>8.0f}{r['fraction_of_flashmla_640']:>6.0%}"
            f"{_fmt(g.get('ms'), '>10.2f')}{_fmt(g.get('tflops'), '>8.0f')}"
            f"{_fmt(g.get('fraction_of_flashmla_640'), '>6.0%')}"
            + _status(r)
        )
    lines.append(
        f"{idx_title:<44}triton ms  logits ms  TFLOPS  topk ms   torch ms  speedup  check"
    )
    rows = [(f"T=S={r['T']}", r) for r in result["indexer"]]
    rows.append((f"rank0 C={rank['cp_size']} T={rank['indexer']['T']} S={rank['indexer']['S']}", rank["indexer"]))
    for name, r in rows:
        if "error" in r:
            lines.append(f"  {name:<42}ERROR {r['error'][:70]}")
            continue
        lines.append(
            f"  {name:<42}{r['triton_ms']:>9.2f}{r['triton_logits_ms']:>11.2f}{r['logits_tflops']:>8.0f}"
            f"{r['topk_ms']:>9.2f}" + _status(r)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
