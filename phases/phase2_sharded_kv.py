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
# # Phase 2: KV sharded at rest
#
# **What it changes.** The baseline keeps a full replica of the batch's KV on every CP rank, so `C`
# ranks hold `C` copies. Phase 2 splits logical locs (what the allocator, the radix cache and PD
# transfer speak) from per-rank physical storage: logical page `p` is owned by rank `p % C` and
# stored there at compact physical page `p // C`; each rank stores only the MLA latent and indexer
# K pages it owns. The attention and top-k code keep their dense full-view contract through a
# per-layer **materialization** (the owners' pages are all-gathered into the full view). A decode
# side that is not CP rebuilds the full layout from every prefill rank's owned pages (PD transfer).
#
# Code: `reference_impl/cp/ownership.py`, `reference_impl/cp/kv_sharded.py`,
# `reference_impl/cp/page_gather.py`, `reference_impl/pd/`, `reference_impl/cp/capacity.py`.

# %%
import json

import matplotlib.pyplot as plt
import torch

from reference_impl.cp.capacity import kv_bytes_per_rank, max_context_per_rank
from reference_impl.config import PhaseSet, Request, RunConfig, env_flag, get_preset
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()  # does not initialize CUDA, so CPU ranks below can fork
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness
#
# Tiny preset, three requests (prefixes 40 and 13 end mid-page), page size 16. With phase 2 on,
# every `C` agrees with the oracle, the cache rebuilt from all ranks equals the oracle's byte for
# byte, and no rank holds more than `ceil(pages / C) + 1` pages of any request.

# %%
# NBVAL_CHECK_OUTPUT
requests = (Request(0, 96), Request(40, 70), Request(13, 37))
pages = [-(-r.total // 16) for r in requests]
for kv_dtype in ("fp8", "bf16"):
    for cp in (1, 2, 3, 4):
        run = RunConfig(preset="tiny", cp_size=cp, requests=requests, kv_dtype=kv_dtype, page_size=16,
                        compute_dtype="fp32", device="cpu", phases=PhaseSet.level(2))
        rep = run_prefill(run)
        page_bytes = 16 * (260 if kv_dtype == "fp8" else 384)
        held = [e["kv_bytes"] // (run.model.n_layers * page_bytes) for e in rep["per_rank"]]
        bound = sum(-(-n // cp) + 1 for n in pages)
        print(f"{kv_dtype} C={cp}: matches {rep['matches_oracle']}, cache equal {rep['cache_equal']}, "
              f"pages held per rank {held} (of {sum(pages)}; bound {bound})")

# %% [markdown]
# ## 2. KV at rest per rank, DeepSeek-V3.2
#
# From the real layouts: 61 layers, per 64-token page `64 x 656` B of FP8 MLA rows plus an 8448 B
# indexer page. One request; rank 0 (the rank holding the most pages).

# %%
# NBVAL_CHECK_OUTPUT
cfg = get_preset("deepseek-v3.2")
contexts = [8192, 32768, 131072, 262144, 524288, 1048576]
GiB = 2**30
print(f"{'tokens':>8} {'replicated':>11} " + " ".join(f"{'C=' + str(c):>9}" for c in (2, 4, 8)))
for tokens in contexts:
    rep_b = kv_bytes_per_rank(cfg, tokens, 1, sharded=False)
    sharded = [kv_bytes_per_rank(cfg, tokens, c, sharded=True) for c in (2, 4, 8)]
    print(f"{tokens:>8} {rep_b / GiB:>10.2f}G " + " ".join(f"{b / GiB:>8.2f}G" for b in sharded))

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(contexts, [kv_bytes_per_rank(cfg, t, 1, False) / GiB for t in contexts], "o-", label="replicated (any C)")
for c in (2, 4, 8):
    ax.plot(contexts, [kv_bytes_per_rank(cfg, t, c, True) / GiB for t in contexts], "s--", label=f"sharded, C={c}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("context tokens (one request)")
ax.set_ylabel("KV + index at rest per rank (GiB)")
ax.set_title("DeepSeek-V3.2, FP8 cache, 61 layers")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. Max context per rank for an HBM budget
#
# Suppose 48 GiB of each GPU is left for the KV cache after weights and activations (an assumption:
# the split depends on the deployment). The longest single request that fits:

# %%
# NBVAL_CHECK_OUTPUT
budget = 48 * GiB
for c in (1, 2, 4, 8):
    rep_t = max_context_per_rank(cfg, budget, c, sharded=False)
    sh_t = max_context_per_rank(cfg, budget, c, sharded=True)
    print(f"C={c}: replicated {rep_t:>9,} tokens | sharded {sh_t:>10,} tokens")

# %% [markdown]
# ## 4. Measured pool memory per process on the GPU
#
# The pool a rank allocates (rank 0, 61 layers), measured with `torch.cuda.memory_allocated` around
# its construction, next to the layout arithmetic above. Only on a GPU, and only sizes that fit.

# %%
from reference_impl.bench.full_view import pool_memory

measured = []
if ON_GPU:
    for tokens in (131072,) if SMOKE else (131072, 524288, 1048576):
        for c, sharded in ((1, False), (2, True), (4, True), (8, True)):
            used = pool_memory("deepseek-v3.2", tokens, c, sharded, "cuda:0")
            measured.append({"tokens": tokens, "C": c, "sharded": sharded, "measured_GiB": round(used / GiB, 3),
                             "layout_GiB": round(kv_bytes_per_rank(cfg, tokens, c, sharded) / GiB, 3)})
    print(json.dumps({"device": torch.cuda.get_device_name(0), "pools": measured}, indent=1))
else:
    print("no GPU here: the committed notebook shows the H200 run")
