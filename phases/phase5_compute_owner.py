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
# # Phase 5: the compute-owner layout (direct writes)
#
# **What it changes.** Under phase 2 a rank owns pages that other ranks computed, so it quantizes
# and scatters its share of the **gathered** chunk. Phase 5 allocates each current page a logical
# id in its compute rank's lane (`page % C == rank`), so every rank writes the KV and index K
# **it computed** straight into its own pool. Enabled per batch only when the split is
# page-aligned (phase 4) and every local token's page is owned by the rank that computed it; a
# prefix that ends mid-page on another rank's page sends the batch down the phase-2 store path.
#
# Code: `reference_impl/cp/compute_owner.py`, `reference_impl/kvcache/allocator.py` (owner lanes).

# %%
import json

import torch

from reference_impl.bench.store import time_store_paths
from reference_impl.config import PhaseSet, Request, RunConfig, env_flag
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness and the fallback
#
# Tiny preset, page size 8. A prefix of 16 tokens (a page multiple) allows direct writes; a prefix
# of 13 leaves a partial page owned by a rank that does not compute its new tokens.

# %%
# NBVAL_CHECK_OUTPUT
for prefix in (16, 13):
    for cp in (2, 3):
        rep = run_prefill(RunConfig(preset="tiny", cp_size=cp, requests=(Request(prefix, 150), Request(0, 130)),
                                    page_size=8, compute_dtype="fp32", device="cpu", phases=PhaseSet.level(5)))
        print(f"prefix {prefix}, C={cp}: store path {rep['store_path']}, matches oracle {rep['matches_oracle']}, "
              f"cache equal {rep['cache_equal']}")

# %% [markdown]
# ## 2. Store path per layer: phase 2 vs phase 5
#
# Rank 0 of `C = 8`, one request, DeepSeek-V3.2 dims, FP8 cache. Both paths write the same rows
# (the ones rank 0 owns and computed); phase 2 first selects them from the gathered chunk, which on
# the torch path is one more read and write of those rows (`index_select`). With phase 7 the
# selection moves inside the fused kernel (`src_rows`), so the two paths then move the same bytes.
# One process measures it exactly: the store path has no collective. On the GPU each store is
# captured in a CUDA graph and its replays are timed (`triton.testing.do_bench` median), so the
# figure is device time: eager, one store is ~20 launches and the host's launch rate would be timed.

# %%
sizes = ([8192] if SMOKE else [8192, 32768, 131072]) if ON_GPU else [4096]
points = [time_store_paths(n, 8, "cuda" if ON_GPU else "cpu") for n in sizes]
print(json.dumps({"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "points": points}, indent=1))
print(f"{'tokens':>7} {'rows':>6} | {'path':>14} {'MB moved':>9} {'ms':>7} {'GB/s':>6}")
for p in points:
    for path in ("phase2", "phase5", "phase2_fused", "phase5_fused"):
        mb, ms = p[f"{path}_bytes"] / 1e6, p[f"{path}_ms"]
        print(f"{p['tokens']:>7} {p['local_tokens']:>6} | {path:>14} {mb:>9.1f} {ms:>7.3f} {mb / ms:>6.0f}")
