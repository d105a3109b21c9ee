"""Compile the indexer's logits kernel for sm_90 without a GPU and print what ``ptxas -v`` reports
(registers, spills) and its shared memory, for the variants that matter:

* the GPU default config (:data:`reference_impl.kernels.indexer_triton.GPU_DEFAULT_CONFIG`), with
  and without the fused bound's group-maxima epilogue;
* the same with the q and key tiles loaded through block pointers (``BLOCK_PTRS``, no tensor of
  per-element 64-bit addresses live across the head loop), and both at 8 warps.

    python3 scripts/inspect_logits_kernel.py [--json docs/results/logits_kernel_sm90.json]

At the DeepSeek-V3.2 indexer width (128). The compute-kernels page cites it for why the fused bound
does not pay on the H200, the long-context page for the spill and what removes it. Needs Triton
with its NVIDIA backend (the ptxas it ships); no CUDA device or driver.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import triton
from triton.compiler import ASTSource

from inspect_attention_kernels import TARGET, ptxas_verbose
from reference_impl.kernels import indexer_triton
from reference_impl.tool_args import ToolParser, output_file, refusing_exit

ARGS = {
    "q_ptr": "*fp8e4nv",
    "w_ptr": "*fp32",
    "k_ptr": "*fp8e4nv",
    "k_scale_ptr": "*fp32",
    "key_start_ptr": "*i64",
    "key_end_ptr": "*i64",
    "out_ptr": "*fp32",
    "maxima_ptr": "*u32",
    **dict.fromkeys(
        (
            "n_rows",
            "n_cols",
            "col0",
            "n_heads",
            "stride_qt",
            "stride_qh",
            "stride_wt",
            "stride_wh",
            "stride_k",
            "stride_ot",
            "stride_mt",
        ),
        "i32",
    ),
}


def build(
    block_t: int, block_s: int, warps: int, stages: int, dot: str, write_maxima: bool, block_ptrs: bool
) -> dict[str, Any]:
    """One variant built for sm_90 -> its ``ptxas -v`` report, registers, spill bytes, shared memory."""
    constexprs = {
        "D": 128,
        "BLOCK_D": 128,
        "BLOCK_T": block_t,
        "BLOCK_S": block_s,
        "DOT_BF16": dot == "bf16",
        "UPCAST": False,
        "WRITE_MAXIMA": write_maxima,
        "BLOCK_PTRS": block_ptrs,
        "DOT_IEEE": False,  # the DSA layer's FP8 products (IEEE float32 products are GLM-5.3's pooled keys)
    }
    source = ASTSource(indexer_triton._indexer_logits_kernel, ARGS | dict.fromkeys(constexprs, "constexpr"), constexprs)
    kernel = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    report = ptxas_verbose(kernel.asm["ptx"])
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {
        "block_t": block_t,
        "block_s": block_s,
        "num_warps": warps,
        "num_stages": stages,
        "dot": dot,
        "write_maxima": write_maxima,
        "block_pointers": block_ptrs,
        "ptxas": report,
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "shared_bytes": kernel.metadata.shared,
    }


@refusing_exit
def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = ToolParser("python3 scripts/inspect_logits_kernel.py", __doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.json is not None:
        output_file(args.json, "--json")
    block_t, block_s, warps, stages, dot = indexer_triton.GPU_DEFAULT_CONFIG
    variants = [(warps, False, False), (warps, True, False), (warps, False, True), (8, False, False), (8, False, True)]
    rows = []
    for n_warps, write_maxima, block_ptrs in variants:
        row = build(block_t, block_s, n_warps, stages, dot, write_maxima, block_ptrs)
        rows.append(row)
        print(
            f"== logits kernel, WRITE_MAXIMA={write_maxima}, BLOCK_PTRS={block_ptrs} "
            f"({block_t}x{block_s}, {n_warps} warps, {stages} stages, {dot})"
        )
        print("  ptxas:", row["ptxas"])
        print(f"  shared memory: {row['shared_bytes']} B")
    if args.json:
        doc = {
            "target": "sm_90 (compiled on a CPU, no device)",
            "triton": triton.__version__,
            "command": "python3 scripts/inspect_logits_kernel.py --json " + args.json,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
