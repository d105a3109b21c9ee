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
# # Phase 6: metadata on the device, remap without sorting
#
# **What it changes.** The layer loop must not wait on the host: every CP decision (split, locs,
# ownership, page gather) is derived once per batch, before the loop, and the loop only launches
# device work. The engine audits the loop (`HostSyncAudit`: CUDA's own sync count on a GPU, the
# torch calls that would sync on a CPU); in debug mode it fails on any host sync, the debug
# diagnostics themselves excluded. The logical-to-physical remap is
# page arithmetic, computed once per batch and reused by every layer and by both the MLA and the
# index writes; `cp/remap.py` keeps the page-inverse table for engines whose compact rows are not
# arithmetic, with its `sort` + `searchsorted` baseline.
#
# Code: `reference_impl/sync_audit.py`, `reference_impl/cp/remap.py`, `reference_impl/engine.py`.

# %%
import json
import os
import tempfile

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel benchmark's CPU dry run
from reference_impl.config import PhaseSet, Request, RunConfig, env_flag
from reference_impl.cp.remap import page_inverse_remap, sorted_remap
from reference_impl.runner import run_prefill

SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code

print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Zero host syncs in the layer loop, and correctness
#
# Debug mode on: the audit raises if the loop syncs; the report counts what it saw.

# %%
# NBVAL_CHECK_OUTPUT
for requests, chunk in (((Request(0, 96), Request(0, 70)), None), ((Request(13, 150), Request(40, 130)), None),
                        ((Request(16, 150),), 64)):
    rep = run_prefill(RunConfig(preset="tiny", cp_size=3, requests=requests, page_size=8, chunk_size=chunk, debug=True,
                                compute_dtype="fp32", device="cpu", phases=PhaseSet.level(6)))
    print(f"{[(r.prefix, r.extend) for r in requests]} chunk={chunk}: matches {rep['matches_oracle']}, "
          f"host syncs in the layer loop {[e['host_syncs_in_layer_loop'] for e in rep['per_rank']]}")

# %% [markdown]
# ## 2. The page-inverse remap equals sort + searchsorted

# %%
# NBVAL_CHECK_OUTPUT
locs = torch.randperm(4096)
for cp, rank in ((2, 1), (8, 3)):
    fast = page_inverse_remap(locs, 64, cp, rank)
    slow = sorted_remap(locs, 64, cp, rank, n_pages=64)
    print(f"C={cp} rank {rank}: equal {torch.equal(fast, slow)}, rows owned {int((fast >= 0).sum())} of {locs.numel()}")

# %% [markdown]
# ## 3. Cost per forward: page arithmetic once vs sort per layer and per write
#
# `python -m reference_impl.bench.kernels` times both (on the GPU the device time of a call, median
# of 200; a CPU run is a dry run). Per forward, the sorted remap runs `2 x 61` times (MLA and index
# writes, every layer), the page arithmetic once.

# %%
from reference_impl.bench.kernels import main as bench_kernels

out = os.path.join(tempfile.mkdtemp(), "kernels.json")
bench_kernels(["--out", out] + (["--tokens", "8192" if SMOKE else "32768,131072"] if ON_GPU else ["--device", "cpu"]))
print(json.dumps({"device": json.load(open(out))["device"], "remap": json.load(open(out))["remap"]}, indent=1))
