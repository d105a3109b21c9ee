"""GPU benchmark of the query preparation: the one-pass Triton kernels against the torch references.

Usage::

    python -m reference_impl.bench.query_prep --out results.json [--tokens 4096,16384]

At DeepSeek-V3.2 widths, for ``T`` local tokens: the indexer query (``[T, 64, 128]`` bf16 in,
FP8 codes and ``[T, 64]`` weights out; :func:`~reference_impl.kernels.query_prep_triton.indexer_query_triton`)
and the MLA query's RoPE (``[T, 128, 64]`` of the ``[T, 128, 192]`` ``wq_b`` output into the
``[T, 128, 576]`` absorbed query; :func:`~reference_impl.kernels.query_prep_triton.rope_into_triton`).
Each row records the torch reference's and the kernel's time (median of
``triton.testing.do_bench``), the kernel's bytes read plus written and their rate against a device
copy of as many bytes (``torch.Tensor.copy_``), and the agreement checks the GPU tier asserts.
``T = 16384`` is one rank of C=8 at 128K tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from reference_impl.fp8 import hadamard_matrix
from reference_impl.model import query_prep as ref
from reference_impl.model.rope import rope_cos_sin, rope_frequencies
from reference_impl.presets import get_preset


def _copy_ms(n_bytes: int, device: str, bench: Any) -> float:
    """Median ms of a device copy that reads and writes ``n_bytes / 2`` bytes each."""
    src = torch.empty(max(n_bytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def bench_tokens(n_tokens: int, device: str, bench: Any, seed: int) -> dict[str, Any]:
    """The two ops at ``n_tokens`` tokens: times, bytes, rates and agreement."""
    from reference_impl.kernels.query_prep_triton import indexer_query_triton, rope_into_triton

    cfg = get_preset("deepseek-v3.2")
    gen = torch.Generator(device=device).manual_seed(seed)
    hi, d, h, r = cfg.index_n_heads, cfg.index_head_dim, cfg.n_heads, cfg.qk_rope_head_dim
    cos, sin = rope_cos_sin(rope_frequencies(cfg, device), torch.arange(n_tokens, device=device))
    q = (torch.randn(n_tokens, hi, d, device=device, generator=gen) * 2).to(torch.bfloat16)
    weights = torch.randn(n_tokens, hi, device=device, generator=gen)
    hadamard = hadamard_matrix(d, device)
    args = (q, cos, sin, hadamard, weights, r, cfg.index_rope_interleaved, cfg.index_scale_fmt)
    want_q, want_w = ref.indexer_query(*args)
    got_q, got_w = indexer_query_triton(*args)
    index_bytes = q.numel() * 2 + weights.numel() * 4 + got_q.numel() + got_w.numel() * 4
    index_ms, index_torch_ms = bench(lambda: indexer_query_triton(*args)), bench(lambda: ref.indexer_query(*args))
    index_copy_ms = _copy_ms(index_bytes, device, bench)

    wq_b = torch.randn(n_tokens, h, cfg.qk_head_dim, device=device, generator=gen).to(torch.bfloat16)
    q_full = torch.zeros(n_tokens, h, cfg.kv_lora_rank + r, dtype=torch.bfloat16, device=device)
    want_full = q_full.clone()
    x, out, want_out = wq_b[..., cfg.qk_nope_head_dim :], q_full[..., cfg.kv_lora_rank :], want_full[..., cfg.kv_lora_rank :]
    ref.rope_into(want_out, x, cos, sin, True)
    rope_into_triton(out, x, cos, sin, True)
    rope_bytes = 2 * x.numel() * 2
    rope_ms, rope_torch_ms = bench(lambda: rope_into_triton(out, x, cos, sin, True)), bench(
        lambda: ref.rope_into(want_out, x, cos, sin, True)
    )
    rope_copy_ms = _copy_ms(rope_bytes, device, bench)
    return {
        "tokens": n_tokens,
        "indexer_query": {
            "shape": [n_tokens, hi, d],
            "torch_ms": index_torch_ms,
            "kernel_ms": index_ms,
            "speedup": index_torch_ms / index_ms,
            "bytes": index_bytes,
            "kernel_gbps": index_bytes / index_ms / 1e6,
            "copy_gbps": index_bytes / index_copy_ms / 1e6,
            "fraction_of_copy": index_copy_ms / index_ms,
            "codes_equal": (got_q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean().item(),
            "weights_equal": (got_w == want_w).float().mean().item(),
            "weights_max_rel_err": ((got_w - want_w).abs() / want_w.abs().clamp(min=1e-30)).max().item(),
        },
        "rope_into": {
            "shape": list(x.shape),
            "torch_ms": rope_torch_ms,
            "kernel_ms": rope_ms,
            "speedup": rope_torch_ms / rope_ms,
            "bytes": rope_bytes,
            "kernel_gbps": rope_bytes / rope_ms / 1e6,
            "copy_gbps": rope_bytes / rope_copy_ms / 1e6,
            "fraction_of_copy": rope_copy_ms / rope_ms,
            "bit_equal": bool(torch.equal(q_full, want_full)),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", default="4096,16384", help="local token counts T, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu: dry run
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # dry run of the script's logic at toy sizes
    import triton
    import triton.testing

    from reference_impl.bench.timing import cpu_median_ms

    on_gpu = args.device == "cuda"

    def bench(fn: Any) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100)) if on_gpu else cpu_median_ms(fn, 1)

    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.query_prep " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "timing": "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms)" if on_gpu else "one CPU call",
        "bytes": "what the kernel must read plus write; copy_gbps: a device copy of as many bytes",
        "rows": [bench_tokens(int(t), args.device, bench, args.seed) for t in args.tokens.split(",")],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        for op in ("indexer_query", "rope_into"):
            r = row[op]
            print(
                f"T={row['tokens']:>6} {op:<14} torch {r['torch_ms']:8.3f} ms  kernel {r['kernel_ms']:7.3f} ms "
                f"({r['speedup']:5.1f}x, {r['kernel_gbps']:6.0f} GB/s = {r['fraction_of_copy']:.0%} of a copy)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
