# ---
# jupyter:
#   jupytext:
#     formats: phases//py:percent,notebooks//ipynb
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Phase 7: fused Triton kernels
#
# **What it changes.** The CP data movement around attention runs as plain torch ops: quantize,
# pack and scatter for the store; trim then reorder for the rerange; gather then unpack for the
# materialization. Each pass reads and writes the whole tensor. Phase 7 fuses each into one Triton
# kernel behind one dispatch point (`cp/fused_ops.py`): the kernel on CUDA, the torch path on
# CPU, in debug mode, with `DSACP_FORCE_TORCH=1`, or when a kernel raises (one warning per process,
# `kernels/fallback.py`).
#
# Code: `reference_impl/kernels/fused_store.py`, `fused_rerange.py`, `fused_materialize.py`,
# `reference_impl/cp/fused_ops.py`.

# %%
import json
import os
import tempfile

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run under the interpreter on CPU
from reference_impl.config import PhaseSet, Request, RunConfig, env_flag
from reference_impl.runner import run_prefill

SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code

print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness in the engine
#
# Level 7 (phases 1-7) and phase 7 alone, FP8 and BF16 caches: the engine agrees with the oracle.
# On CPU the dispatch takes the torch paths; the kernels themselves are checked byte for byte
# under the interpreter in `tests/test_kernels_fused.py` and forced through the engine in
# `tests/test_phase7_engine.py`.

# %%
# NBVAL_CHECK_OUTPUT
for phases in (PhaseSet.level(7), PhaseSet(frozenset({7}))):
    for kv_dtype in ("fp8", "bf16"):
        rep = run_prefill(RunConfig(preset="tiny", cp_size=3, requests=(Request(16, 150), Request(13, 130)),
                                    page_size=8, kv_dtype=kv_dtype, compute_dtype="fp32", device="cpu", phases=phases))
        print(f"phases {sorted(phases.enabled)} {kv_dtype}: matches {rep['matches_oracle']}, cache equal {rep['cache_equal']}")

# %% [markdown]
# ## 2. Bandwidth: each kernel against its torch path and the device copy
#
# Bytes counted once each (read and written); the device time of a call, median of 200, each
# after an L2 flush and with its launch queued behind a GPU sleep, so the host's launch work is not
# timed (`bench.timing.queued_median_ms`). 32K and 128K tokens at DeepSeek-V3.2 dims, next to the
# measured device-to-device copy (1 GiB) and, in the last column, a copy of the row's own bytes
# under the same timer. The bar is 80% of the copy bandwidth. On CPU this is an interpreter dry run
# at 64 tokens (correctness of the bench only).

# %%
from reference_impl.bench.kernels import format_table
from reference_impl.bench.kernels import main as bench_kernels

out = os.path.join(tempfile.mkdtemp(), "kernels.json")
bench_kernels(["--out", out] + (["--tokens", "8192" if SMOKE else "32768,131072"] if ON_GPU else ["--device", "cpu"]))
result = json.load(open(out))
print(format_table(result))

# %% [markdown]
# **Reading the table** (the committed outputs are an H200 run). At 131,072 tokens the FP8 and
# BF16 MLA stores, the KV rerange and the FP8 materialize reach the 80%-of-copy bar, many times
# faster than torch (the KV rerange only a little: with no rank padded, torch's trim is a view).
# The index store and the index rerange move a fifth of their bytes and stay short of the bar
# against the 1 GiB copy, yet close to a copy of their own bytes (last column): a transfer of a
# few tens of megabytes cannot amortize the launch, the ramp-up and the grid's tail, nor the
# write-back of the dirty lines the flush leaves in the L2. At 32,768 tokens every kernel is short
# of the bar for the same reason. The phase 7 page profiles both with Nsight Compute. The launch
# configs are the best byte-exact ones of `python -m reference_impl.bench.kernels --sweep`; the FP8
# store got there by dividing with a reciprocal and one FMA correction (`fast_div`, the same
# quotients) and by loading a whole row
# before its first store (`one_pass`). See the [phase 7 page](../../phases/phase7-fused-kernels/#measured-results).
