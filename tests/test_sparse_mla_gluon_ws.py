"""The warp-specialized Gluon sparse MLA kernel without a GPU: its input limits, and its sm_90 build.

The kernel itself runs in the GPU tier (``tests/gpu/test_gpu_sparse_mla_gluon.py``). Here Triton's
CUDA backend compiles it ahead of time for sm_90 (no device needed), so a Triton upgrade that breaks
the Gluon source, or a change that makes ``ptxas`` spill or outgrow shared memory, fails on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from conftest import gluon_operand_refusals

from reference_impl.kernels.sparse_mla_gluon_ws import sparse_mla_attention_gluon_ws, unsupported_reason

H200_SHARED_BYTES = 227 * 1024  # the most shared memory one block can opt into on sm_90


def test_names_what_it_cannot_run() -> None:
    bf16 = torch.bfloat16
    assert unsupported_reason("cuda", (9, 0), bf16, bf16, 576, 512) is None
    assert unsupported_reason("cuda", (9, 0), torch.float16, torch.float16, 80, 64) is None
    refused = {
        **gluon_operand_refusals(),
        "rope width in [16, 64]": [
            ("cuda", (9, 0), bf16, bf16, 640, 512),
            ("cuda", (9, 0), bf16, bf16, 560, 500),
            ("cuda", (9, 0), bf16, bf16, 40, 32),
            ("cuda", (9, 0), bf16, bf16, 1088, 1024),
        ],
    }
    for words, cases in refused.items():
        for case in cases:
            reason = unsupported_reason(*case)
            assert reason is not None and words in reason, (case, reason)
    q = torch.zeros(2, 4, 576, dtype=bf16)
    kv, indices = torch.zeros(8, 576, dtype=bf16), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(
        ValueError, match="warp-specialized Gluon sparse MLA kernel does not run under TRITON_INTERPRET"
    ):
        sparse_mla_attention_gluon_ws(q, kv, indices, 0.1, 512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="kernel needs an sm_90 GPU, got cpu"):
            sparse_mla_attention_gluon_ws(q, kv, indices, 0.1, 512)


# Compiled in a child process: the CPU tier runs under TRITON_INTERPRET=1, and a kernel module
# imported there holds interpreter functions, not compilable ones.
_COMPILE = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from reference_impl.kernels.sparse_mla_gluon_ws import _sparse_mla_fwd_ws_kernel as kernel, launch_constexprs

d_v, d_rope, pipeline_qk = json.loads(sys.argv[1])
signature = dict(
    q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32",
    n_heads="i32", n_kv="i32", topk="i32", n_head_blocks="i32",
    stride_qt="i32", stride_qh="i32", stride_kv="i32", stride_it="i32", stride_ot="i32", stride_oh="i32",
    stride_lt="i32", qk_scale_log2="fp32",
)
constexprs = launch_constexprs(d_v, d_rope, pipeline_qk)
signature.update({name: "constexpr" for name in constexprs})
# What the JIT specializes on a launch with aligned tensors: pointers and strides divisible by 16.
aligned = [name for name, ty in signature.items() if ty.startswith("*") or name.startswith("stride")]
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"])
    f.flush()
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
ptx = compiled.asm["ptx"]
print(json.dumps({
    "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
    "usage": {k: int(v) for k, v in re.findall(r"\\b(REG|STACK|LOCAL):(\\d+)", usage)},
    "cp_async_mbarrier": "cp.async.mbarrier.arrive.noinc" in ptx, "wgmma": "wgmma.mma_async" in ptx,
    "setmaxnreg": sorted({int(n) for n in re.findall(
        r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}),
}))
"""


def _compile_for_sm90(d_v: int, d_rope: int, pipeline_qk: bool) -> dict:
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no CUDA backend tools")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps([d_v, d_rope, pipeline_qk])],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("d_v", "d_rope", "pipeline_qk"), [(512, 64, True), (512, 64, False), (64, 16, True)])
def test_compiles_for_sm90_without_spills_within_shared_memory(d_v: int, d_rope: int, pipeline_qk: bool) -> None:
    """The DeepSeek widths (sS0 in slot 0's rope part) and the smallest (sS0 a buffer of its own):
    three warp groups (two consumers, a producer) with their own register budgets, tensor-core
    products and mbarrier-tracked copies, shared memory within the SM's, and at most a few words
    spilled (a handful of loop-invariant scalars; hoisting the score products' shared-memory
    descriptors out of the loop, which ``_views_this_pair`` prevents, spills ~700 bytes)."""
    built = _compile_for_sm90(d_v, d_rope, pipeline_qk)
    assert built["num_warps"] == 12 and built["shared"] <= H200_SHARED_BYTES, built
    assert built["cp_async_mbarrier"] and built["wgmma"], built
    assert len(built["setmaxnreg"]) >= 3, built
    assert built["usage"]["STACK"] <= 32 and built["usage"]["LOCAL"] == 0, built
