"""GPU benchmark of the per-token glue: the one-pass Triton kernels against the torch paths they replace.

Usage::

    python -m reference_impl.bench.glue --out results.json [--tokens 4096,16384] [--cp-size 8]

At DeepSeek-V3.2 widths, for ``T`` local tokens of one rank (``T = 16384`` is rank 0 of C=8 at
128K tokens):

* ``indexer_query``: ``[T, 64, 128]`` bf16 in, FP8 codes and ``[T, 64]`` weights out
  (:func:`~reference_impl.kernels.query_prep_triton.indexer_query_triton`);
* ``rope_into``: the ``[T, 128, 64]`` rope part of ``wq_b``'s ``[T, 128, 192]`` output into the
  ``[T, 128, 576]`` absorbed query (:func:`~reference_impl.kernels.query_prep_triton.rope_into_triton`);
* ``rms_norm_<n>``: RMSNorm of ``[T, n]`` bf16 for the three norms of a layer (7168, 1536, 512;
  :func:`~reference_impl.kernels.rms_norm_triton.rms_norm_triton`);
* ``fill_current``: phase 3's current rows of the full view from the gathered chunk of ``C x T``
  tokens, FP8 layout (:func:`~reference_impl.kernels.fused_current.fill_current_triton` against
  :func:`~reference_impl.cp.current_reuse.fill_rows`).

Each row records the torch path's and the kernel's time (median of ``triton.testing.do_bench``),
the kernel's bytes read plus written and their rate against a device copy of as many bytes
(``torch.Tensor.copy_``), and agreement with the torch path (the GPU tier asserts the same).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from reference_impl.bench.timing import median_ms_timer, ready_for
from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, MAX_SEED, ConfigError
from reference_impl.fp8 import hadamard_matrix
from reference_impl.kvcache.layout import KVLayout
from reference_impl.model import norm
from reference_impl.model import query_prep as ref
from reference_impl.model.rope import rope_cos_sin, rope_frequencies
from reference_impl.presets import get_preset
from reference_impl.tool_args import ToolParser, device_arg, int_arg, int_list, output_file, refusing, require_cuda

Bench = Callable[[Callable[[], object]], float]


def _row(
    name: str, shape: list[int], n_bytes: int, torch_ms: float, kernel_ms: float, copy_ms: float, **agreement: Any
) -> dict[str, Any]:
    return {
        "op": name,
        "shape": shape,
        "torch_ms": torch_ms,
        "kernel_ms": kernel_ms,
        "speedup": torch_ms / kernel_ms,
        "bytes": n_bytes,
        "kernel_gbps": n_bytes / kernel_ms / 1e6,
        "copy_gbps": n_bytes / copy_ms / 1e6,
        "fraction_of_copy": copy_ms / kernel_ms,
        **agreement,
    }


def _copy_ms(n_bytes: int, device: str, bench: Bench) -> float:
    """Median ms of a device copy that reads and writes ``n_bytes / 2`` bytes each."""
    src = torch.empty(max(n_bytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def _equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()
        if a.dtype.itemsize == 1
        else (a == b).float().mean().item()
    )


def bench_tokens(n_tokens: int, cp_size: int, device: str, bench: Bench, seed: int) -> list[dict[str, Any]]:
    """Every glue op at ``n_tokens`` local tokens -> one row each."""
    from reference_impl.cp.current_reuse import fill_rows
    from reference_impl.kernels.fused_current import fill_current_triton
    from reference_impl.kernels.query_prep_triton import indexer_query_triton, rope_into_triton
    from reference_impl.kernels.rms_norm_triton import rms_norm_triton

    cfg = get_preset("deepseek-v3.2")
    gen = torch.Generator(device=device).manual_seed(seed)
    hi, d, h, r = cfg.index_n_heads, cfg.index_head_dim, cfg.n_heads, cfg.qk_rope_head_dim
    rows: list[dict[str, Any]] = []
    cos, sin = rope_cos_sin(rope_frequencies(cfg, device), torch.arange(n_tokens, device=device))

    q = (torch.randn(n_tokens, hi, d, device=device, generator=gen) * 2).to(torch.bfloat16)
    weights = torch.randn(n_tokens, hi, device=device, generator=gen)
    args = (q, cos, sin, hadamard_matrix(d, device), weights, r, cfg.index_rope_interleaved, cfg.index_scale_fmt)
    (want_q, want_w), (got_q, got_w) = ref.indexer_query(*args), indexer_query_triton(*args)
    n_bytes = q.numel() * 2 + weights.numel() * 4 + got_q.numel() + got_w.numel() * 4
    rows.append(
        _row(
            "indexer_query",
            list(q.shape),
            n_bytes,
            bench(lambda: ref.indexer_query(*args)),
            bench(lambda: indexer_query_triton(*args)),
            _copy_ms(n_bytes, device, bench),
            codes_equal=_equal(got_q, want_q),
            weights_equal=_equal(got_w, want_w),
            weights_max_rel_err=((got_w - want_w).abs() / want_w.abs().clamp(min=1e-30)).max().item(),
        )
    )

    wq_b = torch.randn(n_tokens, h, cfg.qk_head_dim, device=device, generator=gen).to(torch.bfloat16)
    x = wq_b[..., cfg.qk_nope_head_dim :]
    q_full = torch.zeros(n_tokens, h, cfg.kv_lora_rank + r, dtype=torch.bfloat16, device=device)
    want_full = q_full.clone()
    out, want_out = q_full[..., cfg.kv_lora_rank :], want_full[..., cfg.kv_lora_rank :]
    ref.rope_into(want_out, x, cos, sin, True)
    rope_into_triton(out, x, cos, sin, True)
    n_bytes = 2 * x.numel() * 2
    rows.append(
        _row(
            "rope_into",
            list(x.shape),
            n_bytes,
            bench(lambda: ref.rope_into(want_out, x, cos, sin, True)),
            bench(lambda: rope_into_triton(out, x, cos, sin, True)),
            _copy_ms(n_bytes, device, bench),
            bit_equal=bool(torch.equal(q_full, want_full)),
        )
    )

    for width in (cfg.dim, cfg.q_lora_rank, cfg.kv_lora_rank):
        hidden = (torch.randn(n_tokens, width, device=device, generator=gen) * 3).to(torch.bfloat16)
        weight = 1.0 + 0.1 * torch.randn(width, device=device, generator=gen)
        got, want = rms_norm_triton(hidden, weight, cfg.norm_eps), norm.rms_norm(hidden, weight, cfg.norm_eps)
        n_bytes = 2 * hidden.numel() * 2
        rows.append(
            _row(
                f"rms_norm_{width}",
                list(hidden.shape),
                n_bytes,
                bench(lambda x=hidden, w=weight: norm.rms_norm(x, w, cfg.norm_eps)),
                bench(lambda x=hidden, w=weight: rms_norm_triton(x, w, cfg.norm_eps)),
                _copy_ms(n_bytes, device, bench),
                values_equal=_equal(got, want),
                max_rel_err=((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max().item(),
            )
        )

    layout = KVLayout.from_config(cfg, "fp8", 64)
    n_chunk = cp_size * n_tokens
    kv = torch.randn(n_chunk, layout.kv_width, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(n_chunk, 128, device=device, generator=gen).to(torch.bfloat16)
    view_rows = torch.arange(n_chunk, device=device)
    views = [
        (
            torch.empty(n_chunk, layout.kv_width, dtype=torch.bfloat16, device=device),
            torch.empty(n_chunk, 128, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(n_chunk, device=device),
        )
        for _ in range(2)
    ]
    fill_args = (kv, k, view_rows)
    fill_rows(*fill_args, *views[0], layout)
    fill_current_triton(*fill_args, *views[1], layout)
    n_bytes = n_chunk * (2 * layout.kv_width + 2 * 128 + 2 * layout.kv_width + 128 + 4 + 8)
    rows.append(
        _row(
            "fill_current",
            [n_chunk, layout.kv_width],
            n_bytes,
            bench(lambda: fill_rows(*fill_args, *views[0], layout)),
            bench(lambda: fill_current_triton(*fill_args, *views[1], layout)),
            _copy_ms(n_bytes, device, bench),
            bytes_equal=all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*views)),
        )
    )
    for row in rows:
        row["tokens"] = n_tokens
    return rows


PROG = "python -m reference_impl.bench.glue"


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default="4096,16384", help="local token counts T, comma separated")
    parser.add_argument(
        "--cp-size",
        type=int_arg(1, MAX_PLAN_CP),
        default=8,
        help="C: the gathered chunk of fill_current is C x T tokens",
    )
    parser.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0, help="inputs' random seed")
    parser.add_argument("--device", type=device_arg, default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    tokens = int_list(args.tokens, "--tokens", 1)
    if max(tokens) * args.cp_size > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"--tokens {max(tokens)} x --cp-size {args.cp_size}: the gathered chunk holds more than "
            f"{MAX_BATCH_TOKENS:,} tokens"
        )
    require_cuda(args.device)
    ready_for(args.device)  # a CPU dry run: Triton's interpreter, before triton is imported
    import triton

    on_gpu = args.device == "cuda"
    bench = median_ms_timer(on_gpu, warmup_ms=25, rep_ms=100)

    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.glue " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "timing": "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms)" if on_gpu else "one CPU call",
        "bytes": "what the kernel must read plus write; copy_gbps: a device copy of as many bytes",
        "rows": [row for t in tokens for row in bench_tokens(t, args.cp_size, args.device, bench, args.seed)],
    }
    out.write_text(json.dumps(result, indent=2))
    for r in result["rows"]:
        print(
            f"T={r['tokens']:>6} {r['op']:<14} torch {r['torch_ms']:8.3f} ms  kernel {r['kernel_ms']:7.3f} ms "
            f"({r['speedup']:5.1f}x, {r['kernel_gbps']:6.0f} GB/s = {r['fraction_of_copy']:.0%} of a copy)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
