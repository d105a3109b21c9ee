"""Compile the indexer's logits kernel for sm_90 without a GPU, with and without the fused bound's
group-maxima epilogue, and print what ``ptxas -v`` reports (registers, spills) and its shared memory.

    python3 scripts/inspect_logits_kernel.py

At the GPU default config (:data:`reference_impl.kernels.indexer_triton.GPU_DEFAULT_CONFIG`) and the
DeepSeek-V3.2 indexer width (128). The compute-kernels page cites it for why the fused bound does not
pay on the H200: the kernel already runs out of registers without the epilogue. Needs Triton with its
NVIDIA backend (the ptxas it ships); no CUDA device or driver.
"""

from __future__ import annotations

import triton
from inspect_attention_kernels import TARGET, ptxas_verbose
from triton.compiler import ASTSource

from reference_impl.kernels import indexer_triton

ARGS = {
    "q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "key_start_ptr": "*i64",
    "key_end_ptr": "*i64", "out_ptr": "*fp32", "maxima_ptr": "*u32",
    **dict.fromkeys(("n_rows", "n_cols", "col0", "n_heads", "stride_qt", "stride_qh", "stride_wt", "stride_wh",
                     "stride_k", "stride_ot", "stride_mt"), "i32"),
}


def main() -> None:
    block_t, block_s, warps, stages, dot = indexer_triton.GPU_DEFAULT_CONFIG
    for write_maxima in (False, True):
        constexprs = {
            "D": 128, "BLOCK_D": 128, "BLOCK_T": block_t, "BLOCK_S": block_s, "DOT_BF16": dot == "bf16",
            "UPCAST": False, "WRITE_MAXIMA": write_maxima,
        }
        source = ASTSource(indexer_triton._indexer_logits_kernel, ARGS | dict.fromkeys(constexprs, "constexpr"), constexprs)
        kernel = triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})
        print(f"== logits kernel, WRITE_MAXIMA={write_maxima} ({block_t}x{block_s}, {warps} warps, {stages} stages, {dot})")
        print("  ptxas:", ptxas_verbose(kernel.asm["ptx"]))
        print(f"  shared memory: {kernel.metadata.shared} B")


if __name__ == "__main__":
    main()
