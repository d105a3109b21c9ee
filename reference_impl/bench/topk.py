"""GPU benchmark of the indexer's top-k selection at the per-rank shape: its three kernels, the whole
selection and ``torch.topk``, every config checked exact.

Usage::

    python -m reference_impl.bench.topk --out results.json [--context 131072 --cp-size 8 --topk 2048] [--sweep]

The shape is the engine's: rank 0's zigzag queries of one ``--context``-token request split over
``--cp-size`` ranks, each against the keys it sees, with the index logits of the Triton logits
kernel on :func:`~reference_impl.bench.compute_cases.indexer_inputs` (64 heads x 128), cut into
row chunks of at most 1 GiB of fp32 logits as
:func:`~reference_impl.kernels.indexer_triton.indexer_topk_triton` cuts them. Times are summed over
the chunks: each of the three kernels alone (:func:`~reference_impl.kernels.topk_select.select_launches`),
the whole selection, and ``torch.topk`` over the same logits. Before timing, each config's result on
every chunk must equal :func:`exact_selection` (the contract: a stable descending sort).

The selection runs as the engine runs it (``"default"``: the bound reads the logits) and with the
opt-in fused bound (``"fused_bound"``: its first kernel reads the group maxima the logits kernel
wrote); ``logits_ms`` times the logits kernel without and with writing the maxima.

``--sweep`` also times each candidate of :data:`SWEEP` (changes to ``GPU_CONFIG``); the fastest exact
one is the value to put in ``topk_select.GPU_CONFIG``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from reference_impl.bench.timing import median_ms_timer, ready_for
from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP, MAX_SEED, ConfigError
from reference_impl.tool_args import ToolParser, device_arg, int_arg, output_file, refusing, require_cuda

# Changes to GPU_CONFIG that --sweep times (the compact kernel's block, warps and segment size go together).
SWEEP: list[dict[str, int]] = [
    {"bound_warps": 16},
    {"bound_steps": 8},
    {"bound_steps": 3},
    {"finish_warps": 16},
    {"finish_warps": 4},
    {"compact_block": 512, "compact_warps": 1, "segment_keys": 16384, "max_segments": 8},
    {"compact_block": 1024, "compact_warps": 2, "segment_keys": 8192, "max_segments": 16},
    {"compact_block": 256, "compact_warps": 1, "segment_keys": 8192, "max_segments": 16},
    {"compact_block": 512, "compact_warps": 1, "segment_keys": 4096, "max_segments": 32},
]


class Chunk(NamedTuple):
    """One row chunk: ``logits [rows, hi - lo]`` f32 and each row's visible columns, relative to
    ``lo``; ``maxima``: the group maxima the logits kernel wrote beside them (the fused bound's input)."""

    logits: torch.Tensor
    col_start: torch.Tensor
    col_end: torch.Tensor
    lo: int
    maxima: torch.Tensor | None = None


def per_rank_chunks(
    context: int,
    cp_size: int,
    heads: int,
    dim: int,
    device: str,
    bench: Callable[[Callable[[], object]], float] | None = None,
) -> tuple[list[Chunk], dict[str, float]]:
    """Rank 0's index logits at ``context`` tokens over ``cp_size`` ranks, in the engine's row
    chunks, with their group maxima; and, with ``bench``, the logits kernel's ms summed over the
    chunks without (``"plain"``) and with (``"with_maxima"``) writing the maxima."""
    from reference_impl.bench.compute_cases import indexer_inputs, zigzag_rank0_positions
    from reference_impl.kernels.indexer_triton import indexer_logits_triton
    from reference_impl.kernels.topk_select import maxima_width
    from reference_impl.model.sparse_attention import chunk_key_range

    positions = zigzag_rank0_positions(context, cp_size)
    q, w, k, k_scale, start, end = indexer_inputs(positions, context, heads, dim, torch.device(device))
    rows = max(1, (1 << 30) // (context * 4))
    chunks = []
    logits_ms = {"plain": 0.0, "with_maxima": 0.0}
    for r0 in range(0, positions.numel(), rows):
        r1 = min(r0 + rows, positions.numel())
        lo, hi = chunk_key_range(start, end, r0, r1, None)
        inputs = (q[r0:r1], w[r0:r1], k, k_scale, start[r0:r1], end[r0:r1], lo, hi)
        maxima = torch.empty(r1 - r0, maxima_width(hi - lo), dtype=torch.uint32, device=device)
        logits = indexer_logits_triton(*inputs, maxima=maxima)
        if bench is not None:
            logits_ms["plain"] += bench(lambda inputs=inputs: indexer_logits_triton(*inputs))
            logits_ms["with_maxima"] += bench(lambda inputs=inputs, m=maxima: indexer_logits_triton(*inputs, maxima=m))
        chunks.append(Chunk(logits, (start[r0:r1] - lo).contiguous(), (end[r0:r1] - lo).contiguous(), lo, maxima))
    return chunks, logits_ms


def exact_selection(chunk: Chunk, k: int) -> torch.Tensor:
    """The selection's contract, vectorized: per row the first ``min(k, visible)`` columns of a
    stable descending sort of the visible columns, ascending, ``-1`` padded -> ``[rows, k]`` int32
    (columns relative to the chunk, like ``topk_select_triton`` with ``col_offset=0``)."""
    logits, start, end = chunk.logits, chunk.col_start, chunk.col_end
    cols = torch.arange(logits.shape[1], device=logits.device)
    visible = (cols[None] >= start[:, None]) & (cols[None] < end[:, None])
    order = torch.sort(logits.masked_fill(~visible, float("-inf")), dim=1, descending=True, stable=True).indices
    order = order[:, :k] if order.shape[1] >= k else torch.nn.functional.pad(order, (0, k - order.shape[1]))
    n_visible = visible.sum(1, keepdim=True)
    sentinel = torch.iinfo(torch.int64).max
    chosen = torch.where(torch.arange(k, device=logits.device)[None] < n_visible, order, sentinel).sort(1).values
    return torch.where(chosen == sentinel, -1, chosen).to(torch.int32)


def measure(
    chunks: list[Chunk],
    expected: list[torch.Tensor],
    k: int,
    config: Any,
    bench: Callable[[Callable[[], object]], float],
    fused_bound: bool = False,
) -> dict[str, Any]:
    """One config: exact on every chunk (``expected``: :func:`exact_selection` of each)?, then each
    kernel's and the whole selection's ms, summed over chunks; the bound from the chunks' group
    maxima (``fused_bound``) or from the logits."""
    from reference_impl.kernels.topk_select import select_launches, topk_select_triton

    def maxima(c: Chunk) -> torch.Tensor | None:
        return c.maxima if fused_bound else None

    row: dict[str, Any] = {"config": dataclasses.asdict(config), "fused_bound": fused_bound}
    paths = [torch.full((c.logits.shape[0],), -1, dtype=torch.int8, device=c.logits.device) for c in chunks]
    row["exact"] = all(
        torch.equal(
            topk_select_triton(c.logits, c.col_start, c.col_end, k, config=config, maxima=maxima(c), paths=p), want
        )
        for c, want, p in zip(chunks, expected, paths, strict=True)
    )
    row["rows_per_path"] = torch.bincount(torch.cat(paths).long(), minlength=3).tolist()
    kernel_ms = {"bound": 0.0, "compact": 0.0, "finish": 0.0}
    for c in chunks:
        out = torch.empty(c.logits.shape[0], k, dtype=torch.int32, device=c.logits.device)
        launches = select_launches(c.logits, c.col_start, c.col_end, k, c.lo, out, None, config, maxima(c))
        for launch in launches.values():  # in order: each kernel's inputs are the previous one's outputs
            launch()
        for name, launch in launches.items():
            kernel_ms[name] += bench(launch)
    row["kernel_ms"] = kernel_ms
    row["select_ms"] = bench(
        lambda: [
            topk_select_triton(c.logits, c.col_start, c.col_end, k, col_offset=c.lo, config=config, maxima=maxima(c))
            for c in chunks
        ]
    )
    return row


PROG = "python -m reference_impl.bench.topk"
MAX_WIDTH = 1 << 12  # index heads and key width: past any model's (64 heads x 128)


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--context", type=int_arg(1, MAX_BATCH_TOKENS), default=131072, help="tokens of the request")
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="C: rank 0 of C ranks")
    parser.add_argument("--topk", type=int_arg(1, MAX_BATCH_TOKENS), default=2048, help="keys each query selects")
    parser.add_argument("--index-heads", type=int_arg(1, MAX_WIDTH), default=64, help="indexer heads Hi")
    parser.add_argument("--index-dim", type=int_arg(1, MAX_WIDTH), default=128, help="indexer key width D")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config of SWEEP")
    parser.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0, help="inputs' random seed")
    parser.add_argument("--device", type=device_arg, default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    if args.context < 2 * args.cp_size:
        raise ConfigError(
            f"--context {args.context}: the zigzag split of C={args.cp_size} ranks (--cp-size) "
            f"needs at least {2 * args.cp_size} tokens"
        )
    require_cuda(args.device)
    ready_for(args.device)  # a CPU dry run: Triton's interpreter, before triton is imported
    import triton

    from reference_impl.kernels.topk_select import CPU_CONFIG, GPU_CONFIG

    on_gpu = args.device == "cuda"
    bench = median_ms_timer(on_gpu, warmup_ms=10, rep_ms=60)

    torch.manual_seed(args.seed)
    chunks, logits_ms = per_rank_chunks(
        args.context, args.cp_size, args.index_heads, args.index_dim, args.device, bench
    )
    config = GPU_CONFIG if on_gpu else CPU_CONFIG
    expected = [exact_selection(c, args.topk) for c in chunks]  # once, for every config
    result: dict[str, Any] = {
        "command": "python -m reference_impl.bench.topk " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "shape": {
            "what": f"rank 0 of C={args.cp_size} at {args.context} tokens",
            "k": args.topk,
            "rows": sum(c.logits.shape[0] for c in chunks),
            "chunks": [list(c.logits.shape) for c in chunks],
        },
        "timing": "median of triton.testing.do_bench (warmup 10 ms, rep 60 ms) per chunk, summed"
        if on_gpu
        else "one CPU call",
        "logits_ms": logits_ms,
        "torch_topk_ms": bench(lambda: [c.logits.topk(min(args.topk, c.logits.shape[1]), dim=-1) for c in chunks]),
        "default": measure(chunks, expected, args.topk, config, bench),
        "fused_bound": measure(chunks, expected, args.topk, config, bench, fused_bound=True),
    }
    if args.sweep:
        result["sweep"] = [
            measure(chunks, expected, args.topk, dataclasses.replace(config, **change), bench) for change in SWEEP
        ]
    out.write_text(json.dumps(result, indent=2))
    rows = [result["default"], result["fused_bound"], *result.get("sweep", [])]
    for row in rows:
        times = " ".join(f"{name} {ms:.3f}" for name, ms in row["kernel_ms"].items())
        print(
            f"select {row['select_ms']:.3f} ms ({times})  exact {row['exact']}  fused bound {row['fused_bound']}  "
            f"paths {row['rows_per_path']}  {row['config']}"
        )
    print(f"logits {logits_ms['plain']:.3f} ms, writing the maxima too {logits_ms['with_maxima']:.3f} ms")
    print(f"torch.topk {result['torch_topk_ms']:.3f} ms")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
