"""The compute benchmark's pieces: inputs at the benchmarked shapes, the timing rule, and one
function per section (sparse MLA attention, indexer top-k, the matmul ceiling, the dispatch smoke
test). :mod:`reference_impl.bench.compute` drives them and writes the JSON."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

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
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
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


def _gluon_rows(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    flops: float,
    slow_ms: float,
    gluon_config: dict[str, Any] | None,
    warp_specialized: bool,
) -> dict[str, dict[str, Any]]:
    """``{"gluon": ..., "gluon_ws": ...}``: each Gluon kernel asked for (the first with
    ``gluon_config``, the warp-specialized one if ``warp_specialized``) that supports these inputs,
    checked against the reference on ``rows``, then timed with a bf16 output."""
    from reference_impl.kernels import sparse_mla_gluon, sparse_mla_gluon_ws

    wanted: list[tuple[str, Any, Any, dict[str, Any]]] = []
    if gluon_config is not None:
        wanted.append(
            ("gluon", sparse_mla_gluon.gluon_supported, sparse_mla_gluon.sparse_mla_attention_gluon, gluon_config)
        )
    if warp_specialized:
        wanted.append(
            ("gluon_ws", sparse_mla_gluon_ws.ws_supported, sparse_mla_gluon_ws.sparse_mla_attention_gluon_ws, {})
        )
    out: dict[str, dict[str, Any]] = {}
    for name, supported, attention, config in wanted:
        if not supported(q, kv, D_V):
            continue

        def kernel(
            qs: torch.Tensor,
            ix: torch.Tensor,
            out_dtype: torch.dtype = torch.float32,
            f: Any = attention,
            c: dict[str, Any] = config,
        ) -> Any:
            return f(qs, kv, ix, scale, D_V, out_dtype=out_dtype, **c)

        check = _attention_check(kernel, q, kv, indices, rows, scale)
        ms, timer = _time(lambda k=kernel: k(q, indices, torch.bfloat16), slow_ms)
        out[name] = {
            **({"config": config} if config else {}),
            "check": check,
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "fraction_of_flashmla_640": flops / ms / 1e9 / FLASHMLA_TFLOPS,
            "timer": timer,
        }
    return out


def bench_attention(
    positions: torch.Tensor,
    n_kv: int,
    args: argparse.Namespace,
    config: dict[str, Any] | None,
    gen: torch.Generator,
    gluon_config: dict[str, Any] | None = None,
    warp_specialized: bool = False,
) -> dict[str, Any]:
    """One attention row: the Triton kernel with ``config`` (skipped if ``None``) and, where they run
    (sm_90), the Gluon kernel with ``gluon_config`` (skipped if ``None``) and the warp-specialized
    Gluon kernel (if ``warp_specialized``), each checked then timed; ``engine_*`` repeat the numbers
    of the kernel the dispatch runs for these inputs."""
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
    if dispatch.gluon_available():
        row.update(_gluon_rows(q, kv, indices, rows, scale, flops, args.slow_ms, gluon_config, warp_specialized))
    engine = row.get(row["engine_kernel"]) if row["engine_kernel"] in ("gluon", "gluon_ws") else None
    if engine is not None:
        row.update(engine_ms=engine["ms"], engine_tflops=engine["tflops"])
    elif "triton_ms" in row:
        row.update(engine_ms=row["triton_ms"], engine_tflops=row["triton_tflops"])
    if config is None:  # a Gluon sweep row: no torch timing
        return row
    if n_tokens <= args.torch_max_tokens:
        torch_ms, torch_timer = _time(lambda: ref.sparse_mla_attention(q, kv, indices, scale, D_V), args.slow_ms)
        row.update(
            torch_ms=torch_ms,
            torch_tflops=flops / torch_ms / 1e9,
            torch_timer=torch_timer,
            speedup=torch_ms / row["engine_ms"],
        )
    else:
        row["torch_ms"] = None
        row["torch_skipped"] = f"T > --torch-max-tokens {args.torch_max_tokens}"
    return row  # the inputs are freed with this frame; the caller empties the CUDA cache


def bench_indexer(
    positions: torch.Tensor, n_kv: int, args: argparse.Namespace, config: dict[str, Any], gen: torch.Generator
) -> dict[str, Any]:
    from reference_impl.kernels.dispatch import topk_selector
    from reference_impl.kernels.indexer_triton import indexer_logits_pass, indexer_logits_triton, indexer_topk_triton
    from reference_impl.kernels.topk_select import selected_scores

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
    picks = {
        selector: indexer_topk_triton(*sub, args.topk, selector=selector, **config) for selector in ("torch", "triton")
    }
    got = picks[topk_selector()]
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
        # The selection kernel and torch.topk over the same logits: the same scores per row (ties aside).
        "selectors_pick_equal_scores": bool(  # lo = 0: keys are columns of the logits
            torch.equal(picks["torch"] < 0, picks["triton"] < 0)
            and torch.equal(selected_scores(logits, picks["torch"]), selected_scores(logits, picks["triton"]))
        ),
    }
    check["ok"] = (
        check["logits_rel_err"] < 1e-3
        and check["masked_all_neg_inf"]
        and check["valid_counts_equal"]
        # Sets that differ only by exact ties at the k-th score agree (each selector breaks ties its own way).
        and (check["topk_set_overlap_min"] > 0.99 or worst_gap <= 1e-6)
        and check["selectors_pick_equal_scores"]
    )
    del logits, ref_scores, got, want, masked, picks

    visible_keys = float((key_end - key_start).sum())
    flops = 2.0 * args.index_heads * args.index_dim * visible_keys

    full = (q_fp8, weights, k_fp8, k_scale, key_start, key_end)

    def logits_only() -> None:  # the same row chunks and key tiles as the top-k call
        indexer_logits_pass(*full, topk=args.topk, **config)

    ms_by_selector = {
        selector: _time(lambda s=selector: indexer_topk_triton(*full, args.topk, selector=s, **config), args.slow_ms)
        for selector in ("torch", "triton")
    }
    ms, timer = ms_by_selector[topk_selector()]
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
        "topk_selector": topk_selector(),
        "torch_topk_ms": ms_by_selector["torch"][0] - logits_ms,
        "select_kernel_topk_ms": ms_by_selector["triton"][0] - logits_ms,
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

    from reference_impl.kernels import dispatch, fallback

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
        "triton_available": fallback.triton_available(),
        "attention_kernel": dispatch.sparse_mla_kernel(q, kv, D_V),
        "fallback_warnings": [r.getMessage() for r in records],
        "attention_out_dtype": str(out.dtype),
        "attention_rel_err": _rel(out, ref_out),
        "indexer_valid_counts_equal": bool(torch.equal((top >= 0).sum(1), (want >= 0).sum(1))),
    }


def zigzag_rank0_positions(context: int, cp_size: int) -> torch.Tensor:
    """Sequence positions of rank 0 under the in-seq split of one request: blocks 0 and 2C-1."""
    blocks = torch.arange(context).tensor_split(2 * cp_size)
    return torch.cat([blocks[0], blocks[-1]])
