"""Launch configurations of the V4 sparse attention kernel, timed on a GPU: the data behind
``v4_attention_triton.GPU_CONFIG``.

    # about 20 s on an H200:
    PYTHONPATH=. python3 scripts/sweep_v4_attention.py --out docs/results/v4_attention_sweep_h200.json

Two shapes of V4-Flash (64 heads of 512; 4,096 queries, random rows of a 40,000-entry view): a CSA
layer's 128-token window plus 512 selected entries (640 keys per query) and a sliding layer's
window alone (128). Each ``(BLOCK_H, BLOCK_K, num_warps, num_stages)`` is timed with
``triton.testing.do_bench`` (median of its repeats over ~200 ms, L2 flushed between calls);
TFLOPS count ``4 x queries x heads x keys x 512`` (scores and values).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from reference_impl.errors import ConfigError
from reference_impl.tool_args import output_file, refusing

CONFIGS = [
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (64, 16, 8, 2),
    (64, 32, 8, 1),
    (64, 32, 8, 3),
    (32, 32, 4, 2),
    (32, 64, 4, 2),
    (32, 64, 8, 2),
    (16, 64, 4, 2),
    (64, 64, 8, 3),
    (64, 32, 4, 2),
]


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    output_file(args.out)
    if not torch.cuda.is_available():
        raise ConfigError("this sweep times a CUDA kernel: no CUDA device is visible")
    import triton

    from reference_impl.families.deepseek_v4.kernels.attention_triton import GPU_CONFIG, v4_sparse_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    t, s = 4096, 40000
    q = (torch.randn(t, 64, 512, device="cuda", generator=g) / 4).bfloat16()
    view = torch.randn(s, 512, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(64, device="cuda", generator=g)
    csa = torch.randint(0, s, (t, 128 + 512), device="cuda", generator=g, dtype=torch.int32)
    shapes = {"csa (128 window + 512 selected)": csa, "sliding (128 window)": csa[:, :128].contiguous()}
    rows = []
    for shape, idx in shapes.items():
        flops = 4 * t * 64 * idx.shape[1] * 512
        for cfg in CONFIGS:
            ms = triton.testing.do_bench(
                lambda idx=idx, cfg=cfg: v4_sparse_attention_triton(q, view, idx, sinks, 512**-0.5, config=cfg),
                rep=200,
            )
            rows.append({"shape": shape, "config": list(cfg), "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{shape} {cfg}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOPS", file=sys.stderr, flush=True)
    doc = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "python3 scripts/sweep_v4_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "queries": t,
        "heads": 64,
        "view_rows": s,
        "config_fields": ["BLOCK_H", "BLOCK_K", "num_warps", "num_stages"],
        "timer": "triton.testing.do_bench, rep=200 ms (median)",
        "default": list(GPU_CONFIG),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
