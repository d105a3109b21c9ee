"""Toward the hardware's limits at 128K: the compute kernels, FP8 projections and one rank's layer, in one run.

Usage (an H200, about three minutes)::

    python -m reference_impl.bench.limits --out docs/results/compute_bench.json
    python -m reference_impl.bench.limits --out dry.json --device cpu      # CPU dry run at toy sizes

One process, four sections, each timed the way the compute-kernels page times kernels (the median of
``triton.testing.do_bench``, or of 3 CUDA-event runs for calls above ``--slow-ms``; every kernel
checked against its reference before it is timed):

1. **The compute benchmark** (:mod:`reference_impl.bench.compute` with ``--sweep``): sparse MLA
   attention and the indexer at 8K, 32K, 128K and at the per-rank shape (rank 0 of ``C = 8``,
   128K tokens), the bf16 matmul ceiling. The output is a superset of ``compute_bench.json``:
   every key that file has, the planner and the pages read it unchanged.
2. **``logits_variants``**: the indexer's logits at the per-rank shape with the q and key tiles
   loaded through per-element addresses or block pointers, at 4 and 8 warps (the default config
   spills at 255 registers on sm_90, ``scripts/inspect_logits_kernel.py``), each checked bit for bit
   against the default kernel's logits.
3. **``fp8_projections``**: each projection of a DeepSeek-V3.2 attention layer at ``M = 16384``
   tokens: bf16 (the reference) against FP8 with 128-block scales through ``torch._scaled_mm``
   (cuBLAS) and through the Triton kernel (:mod:`reference_impl.kernels.fp8_gemm`): ms, TFLOPS,
   the activation quantization's ms, the error against the torch emulation of the same FP8 math
   and against bf16. A few Triton configs are tried at the largest shape first.
4. **``layer_128k``**: one rank of ``C = 8``, one 131,072-token request, level 8, with the
   planner's rates' wire (``--wire-gbps``), ``--layers`` layers x ``--level-repeats`` runs after a
   warm-up run (:func:`reference_impl.bench.layer.measure`), for the default kernels, FP8
   projections (``DSACP_FP8_PROJECTIONS=1``), block-pointer logits, and both.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from reference_impl.tool_args import (
    MAX_LAYERS,
    MAX_REPEATS,
    ToolParser,
    device_arg,
    float_arg,
    int_arg,
    output_file,
    refusing,
    require_cuda,
)

DEEPSEEK_PROJECTIONS = {  # (in_features, out_features) of DeepSeek-V3.2's attention projections
    "wq_a": (7168, 1536),
    "wq_b": (1536, 24576),
    "wkv_a": (7168, 576),
    "wo": (16384, 7168),
    "indexer.wq_b": (1536, 8192),
    "indexer.wk": (7168, 128),
}
TRITON_FP8_CONFIGS = [(128, 4, 8), (128, 3, 8), (64, 4, 4), (128, 5, 8)]  # (BLOCK_M, stages, warps)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A section's result, or its error (recorded; the other sections still run)."""
    try:
        return fn()
    except Exception as exc:  # a kernel path the device or torch does not take, an OOM: recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def logits_variants(device: str, cp_context: int, cp_size: int, slow_ms: float) -> dict[str, Any]:
    """The logits pass at the per-rank shape per load variant, checked against the default's logits."""
    from reference_impl.bench.compute_cases import _time, indexer_inputs, zigzag_rank0_positions
    from reference_impl.kernels import indexer_triton

    on_gpu = device == "cuda"
    context = cp_context if on_gpu else 512
    pos = zigzag_rank0_positions(context, cp_size)
    iq = indexer_inputs(pos, context, 64, 128, torch.device(device))
    block_t, block_s, warps, stages, dot = (
        indexer_triton.GPU_DEFAULT_CONFIG if on_gpu else indexer_triton.CPU_DEFAULT_CONFIG
    )
    rows = slice(0, min(256, pos.numel()))
    check_args = tuple(t[rows] if t.shape[0] == pos.numel() else t for t in iq)
    lo, hi = 0, int(iq[5][rows].max())
    base = dict(block_t=block_t, block_s=block_s, num_stages=stages, dot_dtype=dot)
    reference = indexer_triton.indexer_logits_triton(*check_args, lo, hi, num_warps=warps, block_pointers=False, **base)
    flops = 2.0 * 64 * 128 * float((pos + 1).sum())
    out: dict[str, Any] = {"T": int(pos.numel()), "S": context, "config": base, "rows": []}
    for n_warps in sorted({warps, 8}):
        for block_pointers in (False, True):
            launch = dict(base, num_warps=n_warps, block_pointers=block_pointers)
            logits = indexer_triton.indexer_logits_triton(*check_args, lo, hi, **launch)
            ms, timer = _time(
                lambda launch=launch: indexer_triton.indexer_logits_pass(*iq, topk=2048, **launch), slow_ms
            )
            out["rows"].append(
                {
                    "num_warps": n_warps,
                    "block_pointers": block_pointers,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "timer": timer,
                    "bitwise_equal_to_default": bool(torch.equal(logits, reference)),
                }
            )
    best = max(out["rows"], key=lambda r: r["tflops"] if r["bitwise_equal_to_default"] else 0)
    out["best"] = {k: best[k] for k in ("num_warps", "block_pointers", "tflops")}
    return out


def fp8_projections(device: str, tokens: int, slow_ms: float) -> dict[str, Any]:
    """bf16 against block-scaled FP8 (cuBLAS and Triton) for each projection at ``tokens`` rows."""
    from reference_impl.bench.compute_cases import _time
    from reference_impl.fp8 import act_quant
    from reference_impl.kernels import fp8_gemm
    from reference_impl.model.fp8_linear import emulated_block_fp8_gemm, quantize_weight

    on_gpu = device == "cuda"
    dev = torch.device(device)
    m = tokens if on_gpu else 32
    shapes = DEEPSEEK_PROJECTIONS if on_gpu else {"toy": (256, 384)}
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {
        "tokens": m,
        "scale_fmt": "ue8m0 (activations), float32 (weights)",
        "flops": "2 * M * N * K (N unpadded)",
        "projections": {},
    }

    def inputs(k: int, n: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
        x_fp8, x_scale = act_quant(x, 128, "ue8m0")
        w_fp8, w_scale = quantize_weight(w)
        return x, w, x_fp8, x_scale, w_fp8, w_scale

    # The Triton kernel's config: the fastest of a few at the largest shape (each checked first).
    k, n = max(shapes.values(), key=lambda s: s[0] * s[1])
    x, w, x_fp8, x_scale, w_fp8, w_scale = inputs(k, n)
    want = emulated_block_fp8_gemm(x_fp8[:64], x_scale[:64], w_fp8, w_scale, torch.float32)
    sweep = []
    for config in TRITON_FP8_CONFIGS if on_gpu else [fp8_gemm.CPU_CONFIG]:
        try:
            err = _rel(
                fp8_gemm.block_fp8_gemm_triton(x_fp8[:64], x_scale[:64], w_fp8, w_scale, torch.float32, config=config),
                want,
            )
            ms, _ = _time(
                lambda c=config, xq=x_fp8, xs=x_scale, wq=w_fp8, ws=w_scale: fp8_gemm.block_fp8_gemm_triton(
                    xq, xs, wq, ws, config=c
                ),
                slow_ms,
            )
            sweep.append({"config": config, "ms": ms, "rel_err_vs_emulation": err})
        except Exception as exc:  # a config that does not build: recorded, never picked
            sweep.append({"config": config, "error": f"{type(exc).__name__}: {exc}"[:300]})
    ok = [r for r in sweep if "ms" in r and r["rel_err_vs_emulation"] < 1e-2]
    triton_config = tuple(min(ok, key=lambda r: r["ms"])["config"]) if ok else fp8_gemm.GPU_CONFIG
    out["triton_config_sweep"] = sweep
    out["triton_config"] = triton_config
    del x, w, x_fp8, x_scale, w_fp8, w_scale
    for name, (k, n) in shapes.items():
        x, w, x_fp8, x_scale, w_fp8, w_scale = inputs(k, n)
        flops = 2.0 * m * n * k
        bf16 = x.float()[:64] @ w.float().t()
        emulated = emulated_block_fp8_gemm(x_fp8[:64], x_scale[:64], w_fp8, w_scale, torch.float32)[:, :n]
        bf16_ms, _ = _time(lambda x=x, w=w: torch.nn.functional.linear(x, w), slow_ms)
        quant_ms, _ = _time(lambda x=x: act_quant(x, 128, "ue8m0"), slow_ms)
        row: dict[str, Any] = {
            "K": k,
            "N": n,
            "bf16_ms": bf16_ms,
            "bf16_tflops": flops / bf16_ms / 1e9,
            "act_quant_ms": quant_ms,
            "fp8_rel_err_vs_bf16": _rel(emulated, bf16),
        }
        paths = {
            "scaled_mm": fp8_gemm.scaled_mm_block_fp8,
            "triton": lambda *a: fp8_gemm.block_fp8_gemm_triton(*a, config=triton_config),
        }
        for path, gemm in paths.items():
            try:
                got = gemm(x_fp8[:64], x_scale[:64], w_fp8, w_scale, torch.float32)[:, :n]
                ms, timer = _time(
                    lambda g=gemm, xq=x_fp8, xs=x_scale, wq=w_fp8, ws=w_scale: g(xq, xs, wq, ws, torch.bfloat16),
                    slow_ms,
                )
                row[path] = {
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "timer": timer,
                    "rel_err_vs_emulation": _rel(got, emulated),
                    "with_act_quant_ms": ms + quant_ms,
                }
            except Exception as exc:  # the path does not run here (torch, CUDA or device): recorded
                row[path] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        out["projections"][name] = row
        del x, w, x_fp8, x_scale, w_fp8, w_scale
    totals = {"bf16_ms": sum(r["bf16_ms"] for r in out["projections"].values())}
    for path in ("scaled_mm", "triton"):
        if all("ms" in r[path] for r in out["projections"].values()):
            totals[f"{path}_with_act_quant_ms"] = sum(r[path]["with_act_quant_ms"] for r in out["projections"].values())
    out["totals"] = totals
    return out


def emulated_errors(rows: int = 64, seed: int = 0) -> dict[str, Any]:
    """The FP8 projections' error against bf16 at DeepSeek-V3.2's widths, from the torch emulation of
    the FP8 math on a CPU (no device: the GPU GEMMs differ from it only in the order of fp32 sums,
    which section 3 measures): ``rows`` unit-normal activations, ``N(0, 1/K)`` weights, both bf16."""
    from reference_impl.model.fp8_linear import Fp8BlockLinear

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {
        "rows": rows,
        "seed": seed,
        "what": "relative Frobenius error of the FP8 projection "
        "(1x128 ue8m0 activation scales, 128x128 float32 weight scales) against the float32 product "
        "of the same bf16 operands; and of bf16 output rounding alone",
        "projections": {},
    }
    for name, (k, n) in DEEPSEEK_PROJECTIONS.items():
        linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            want = x.float() @ linear.weight.float().t()
            fp8 = Fp8BlockLinear(linear, "ue8m0")(x)
        out["projections"][name] = {
            "K": k,
            "N": n,
            "fp8_rel_err": _rel(fp8, want),
            "bf16_rounding_rel_err": _rel(want.bfloat16(), want),
        }
    errs = [v["fp8_rel_err"] for v in out["projections"].values()]
    out["fp8_rel_err_range"] = [min(errs), max(errs)]
    return out


def layer_128k(device: str, layers: int, level_repeats: int, wire_gbps: float | None) -> dict[str, Any]:
    """One rank's level-8 layer at 128K current-only, per variant of the kernels."""
    from reference_impl.bench.layer import Workload, measure
    from reference_impl.kernels import indexer_triton

    on_gpu = device == "cuda"
    preset, extend = ("deepseek-v3.2", 131072) if on_gpu else ("tiny", 512)
    variants = {
        "default": ({}, False),
        "fp8_projections": ({"DSACP_FP8_PROJECTIONS": "1"}, False),
        "block_pointer_logits": ({}, True),
        "fp8_projections+block_pointer_logits": ({"DSACP_FP8_PROJECTIONS": "1"}, True),
    }
    out: dict[str, Any] = {
        "preset": preset,
        "workload": f"current-only:0+{extend}",
        "level": 8,
        "cp_size": 8 if on_gpu else 2,
        "n_layers": layers,
        "level_repeats": level_repeats,
        "wire_gbps": wire_gbps,
        "variants": {},
    }
    saved = indexer_triton.GPU_BLOCK_POINTERS
    for name, (env, block_pointers) in variants.items():
        os.environ.update(env)
        indexer_triton.GPU_BLOCK_POINTERS = block_pointers
        try:
            result = _guarded(
                lambda: measure(
                    preset,
                    Workload("current-only", 0, extend),
                    [8],
                    out["cp_size"],
                    0,
                    layers,
                    device,
                    wire_gbps if on_gpu else None,
                    level_repeats=level_repeats,
                )
            )
        finally:
            for key in env:
                os.environ.pop(key, None)
            indexer_triton.GPU_BLOCK_POINTERS = saved
        point = result["levels"][0] if "levels" in result else result
        out["variants"][name] = point
    return out


PROG = "python -m reference_impl.bench.limits"


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON to write (a superset of compute_bench.json)")
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run at toy sizes")
    parser.add_argument(
        "--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=4, help="layers of section 4's rank"
    )
    parser.add_argument("--level-repeats", type=int_arg(1, MAX_REPEATS), default=3, help="section 4's runs per variant")
    parser.add_argument("--wire-gbps", type=float_arg(), default=450.0, help="the layer's modeled interconnect, GB/s")
    parser.add_argument("--slow-ms", type=float_arg(), default=250.0, help="above this, time with 3 event-timed runs")
    parser.add_argument("--skip-compute", action="store_true", help="skip section 1 (the compute benchmark)")
    parser.add_argument(
        "--emulated-errors",
        action="store_true",
        help="only write the FP8 projections' error against bf16 from the CPU emulation (no device)",
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    if args.emulated_errors:
        doc = emulated_errors()
        doc["command"] = "python -m reference_impl.bench.limits --emulated-errors --out " + args.out
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    from reference_impl.bench import compute
    from reference_impl.bench.timing import ready_for

    require_cuda(args.device)
    ready_for(args.device)  # a CPU dry run: Triton's interpreter, before triton is imported
    started = time.time()
    if not args.skip_compute:
        compute_args = ["--out", str(out), "--sweep"]
        if args.device == "cpu":  # the compute bench's own dry run at toy sizes
            compute_args += [
                "--device",
                "cpu",
                "--tokens",
                "256",
                "--heads",
                "16",
                "--topk",
                "64",
                "--index-heads",
                "4",
                "--cp-context",
                "512",
                "--torch-max-tokens",
                "512",
                "--check-rows",
                "8",
            ]
        compute.main(compute_args)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.is_file() and not args.skip_compute else {}
    doc["limits_command"] = "python -m reference_impl.bench.limits " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    doc["limits_device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"

    def save() -> None:
        out.write_text(json.dumps(doc, indent=2))

    for key, section in (
        ("logits_variants", lambda: logits_variants(args.device, 131072, 8, args.slow_ms)),
        ("fp8_projections", lambda: fp8_projections(args.device, 16384, args.slow_ms)),
        ("layer_128k", lambda: layer_128k(args.device, args.layers, args.level_repeats, args.wire_gbps)),
    ):
        print(f"limits: {key}", file=sys.stderr, flush=True)
        doc[key] = _guarded(section)
        save()
    doc["limits_seconds"] = time.time() - started
    save()
    print(summary(doc))
    return 0


def summary(doc: dict[str, Any]) -> str:
    """The headline figures against their goals (560 / 1,100 TFLOPS, 45 ms)."""
    lines = []
    attention = doc.get("per_rank", {}).get("attention", {})
    if "engine_tflops" in attention:
        lines.append(f"sparse MLA, per-rank shape: {attention['engine_tflops']:.0f} TFLOPS (goal 560)")
    logits = doc.get("logits_variants", {})
    for row in logits.get("rows", []):
        lines.append(
            f"indexer logits, {row['num_warps']} warps, block pointers {row['block_pointers']}: "
            f"{row['tflops']:.0f} TFLOPS (goal 1100), equal {row['bitwise_equal_to_default']}"
        )
    fp8 = doc.get("fp8_projections", {}).get("totals", {})
    if fp8:
        lines.append("projections per layer, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in fp8.items()))
    for name, point in doc.get("layer_128k", {}).get("variants", {}).items():
        if "layer_ms_median" in point:
            lines.append(f"128K level-8 layer, {name}: {point['layer_ms_median']:.1f} ms (goal 45)")
        else:
            lines.append(f"128K level-8 layer, {name}: {point.get('error', '?')[:120]}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
