"""Compile the three sparse MLA kernels for sm_90 without a GPU and print what the compiler made of them.

    python3 scripts/inspect_attention_kernels.py

For each kernel at the DeepSeek-V3.2 shape (64-head blocks, 64-key tiles, d_v 512, rope 64, bf16,
the GPU default switches): the MMA layouts (``warpsPerCTA`` of each product), the count of each
WGMMA instruction in the PTX, 16-byte ``cp.async`` copies (and, for the warp-specialized kernel,
its mbarrier-tracked arrivals and per-warp-group register budgets), registers and spills
(``ptxas -v`` from Triton's bundled ptxas), and shared memory. Integer arguments are marked divisible by 16, as the
launcher specializes them at run time (without that the KV gathers compile to scalar loads).
Needs Triton with its NVIDIA backend (the ptxas it ships); no CUDA device or driver.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from reference_impl.kernels import sparse_mla_gluon, sparse_mla_gluon_ws, sparse_mla_triton
from reference_impl.tool_args import ToolParser, refusing

ARGS = [
    "q_ptr",
    "kv_ptr",
    "idx_ptr",
    "out_ptr",
    "lse_ptr",
    "n_heads",
    "n_kv",
    "topk",
    "n_head_blocks",
    "stride_qt",
    "stride_qh",
    "stride_kv",
    "stride_it",
    "stride_ot",
    "stride_oh",
    "stride_lt",
    "qk_scale_log2",
]
TYPES = ["*bf16", "*bf16", "*i32", "*bf16", "*fp32"] + ["i32"] * 11 + ["fp32"]
NOT_DIVISIBLE = {"n_head_blocks", "qk_scale_log2"}  # 2 head blocks; a float
TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(source_cls: type, fn: Any, constexprs: dict[str, Any], **options: int) -> Any:
    signature = dict(zip(ARGS, TYPES, strict=True)) | dict.fromkeys(constexprs, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(ARGS) if name not in NOT_DIVISIBLE}
    return triton.compile(source_cls(fn, signature, constexprs, attrs), target=TARGET, options=options)


def ptxas_verbose(ptx: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    return "; ".join(
        line.split("info    : ")[-1].strip() for line in run.stderr.splitlines() if "Used" in line or "spill" in line
    )


def report(name: str, kernel: Any) -> None:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    print(f"== {name}")
    for layout in re.findall(r"#ttg\.nvidia_mma<\{[^}]*\}>", ttgir.split("module")[0]):
        print("  MMA layout:", layout)
    pattern = r"wgmma\.mma_async\.sync\.aligned\.\w+|cp\.async\.cg\.shared\.global|cp\.async\.mbarrier\.arrive\.noinc"
    counts = collections.Counter(re.findall(pattern, ptx))
    for instr, n in sorted(counts.items()):
        print(f"  {n:4d} x {instr}")
    budgets = sorted({int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    if budgets:
        print("  setmaxnreg budgets:", budgets)
    print("  ptxas:", ptxas_verbose(ptx))
    print(f"  shared memory: {kernel.metadata.shared} B")


@refusing
def main(argv: list[str] | None = None) -> int:
    ToolParser("python3 scripts/inspect_attention_kernels.py", __doc__.split("\n\n")[0]).parse_args(argv)  # no flags
    from triton.experimental.gluon._runtime import GluonASTSource

    block_h, block_k, warps, stages, *switches = sparse_mla_triton.GPU_DEFAULT_CONFIG
    triton_constexprs = dict(
        D_V=512,
        D_ROPE=64,
        BLOCK_DV=512,
        BLOCK_DR=64,
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        **dict(zip(("DEFER_PV", "LAZY_RESCALE", "WARP_SPECIALIZE", "RELOAD_PREV"), switches, strict=True)),
        RESCALE_LOG2=sparse_mla_triton.RESCALE_THRESHOLD_LOG2,
        UPCAST=False,
        IEEE=False,
    )
    triton_kernel = compile_for_sm90(
        ASTSource, sparse_mla_triton._sparse_mla_fwd_kernel, triton_constexprs, num_warps=warps, num_stages=stages
    )
    report(f"Triton kernel, GPU default {sparse_mla_triton.GPU_DEFAULT_CONFIG}", triton_kernel)
    gluon_constexprs = dict(
        D_V=512,
        D_ROPE=64,
        BLOCK_H=sparse_mla_gluon.BLOCK_H,
        BLOCK_K=sparse_mla_gluon.BLOCK_K,
        **dict(zip(("OVERLAP_PV", "EVICT_LAST"), sparse_mla_gluon.GPU_DEFAULT_CONFIG, strict=True)),
    )
    gluon_kernel = compile_for_sm90(
        GluonASTSource,
        sparse_mla_gluon._sparse_mla_fwd_gluon_kernel,
        gluon_constexprs,
        num_warps=sparse_mla_gluon.NUM_WARPS,
    )
    report(f"Gluon kernel, GPU default {sparse_mla_gluon.GPU_DEFAULT_CONFIG}", gluon_kernel)
    ws_kernel = compile_for_sm90(
        GluonASTSource,
        sparse_mla_gluon_ws._sparse_mla_fwd_ws_kernel,
        sparse_mla_gluon_ws.launch_constexprs(512, 64),
        num_warps=4,  # per warp group: the kernel adds the producer and the second consumer
    )
    report(f"Warp-specialized Gluon kernel, PIPELINE_QK={sparse_mla_gluon_ws.GPU_PIPELINE_QK}", ws_kernel)
    print(f"(Triton {triton.__version__}, target sm_90a)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
