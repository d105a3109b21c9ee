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
# # Phase 3: reuse the current chunk, materialize only history
#
# **What it changes.** After all-gather #1 every rank already holds the current chunk's latent KV
# and index K in sequence order. Phase 2 still rebuilds those rows from the sharded pages. Phase 3
# fills the full view's current rows from the gathered tensors (quantized exactly as the cache
# stores them) and materializes only the prefix pages: a **current-only** batch materializes
# nothing (no collective at all), a **mixed** batch only its prefix pages; anything else falls back
# to phase 2. The decision is per batch, from metadata every rank shares.
#
# Code: `reference_impl/cp/current_reuse.py` (on top of `reference_impl/cp/kv_sharded.py`).

# %%
import json

import matplotlib.pyplot as plt
import torch

from reference_impl.config import PhaseSet, Request, RunConfig, env_flag
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()  # does not initialize CUDA, so CPU ranks below can fork
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness and materialized bytes
#
# Tiny preset, `C = 3`, page size 16. Materialized bytes are per rank, summed over the 2 layers;
# one page is `16 x (260 + 132)` bytes (tiny FP8 MLA rows + indexer K).

# %%
# NBVAL_CHECK_OUTPUT
page = 16 * (260 + 132)
batches = {"current-only": (Request(0, 96), Request(0, 70)), "mixed": (Request(0, 96), Request(40, 70), Request(13, 37))}
for name, requests in batches.items():
    for level in (2, 3):
        run = RunConfig(preset="tiny", cp_size=3, requests=requests, page_size=16, compute_dtype="fp32",
                        device="cpu", phases=PhaseSet.level(level))
        rep = run_prefill(run)
        r0 = rep["per_rank"][0]
        print(f"{name:>12} phase {level}: matches {rep['matches_oracle']}, cache equal {rep['cache_equal']}, "
              f"materialized {r0['materialized_bytes'] // page} pages, collectives {r0['collectives']}")

# %% [markdown]
# ## 2. Measured per-layer full-view cost, phase 2 vs phase 3
#
# One layer's `full_view` (materialize + unpack + current fill) at DeepSeek-V3.2 dims, FP8 cache,
# one request, `C = 4`: a current-only batch (no prefix) and a prefix-heavy batch (a long cached
# prefix plus a short chunk, as in chunked prefill). Median of the repeats after a warm-up; slowest
# rank. With one GPU the 4 ranks share it through gloo, so the materialization all-gather includes
# gloo's host staging; with several GPUs each rank has its own and NCCL carries it. Torch paths
# throughout (the fused kernels are phase 7).

# %%
from reference_impl.bench.full_view import FullViewBench, time_full_view
from reference_impl.launch import choose_backend, launch

cp = 4
if ON_GPU:
    cases = [("current-only", 0, 4096), ("prefix-heavy", 4096, 1024)] if SMOKE else [
        ("current-only", 0, 32768), ("prefix-heavy", 32768, 4096)]
    repeats = 1 if SMOKE else 3
else:
    cases = [("current-only", 0, 1024), ("prefix-heavy", 2048, 256)]
    repeats = 3
results = []
for name, prefix, extend in cases:
    per_rank = launch(time_full_view, cp, FullViewBench(prefix=prefix, extend=extend, repeats=repeats))
    row = {"batch": name, "prefix": prefix, "extend": extend}
    row.update({k: max(r[k] for r in per_rank) for k in per_rank[0]})
    results.append(row)
print(json.dumps({"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "cp_size": cp, "repeats": repeats,
                  "launch": choose_backend(cp, "auto", "auto", torch.cuda.device_count()).describe(),
                  "results": results}, indent=1))

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.5))
labels = [f"{r['batch']}\n{r['prefix']}+{r['extend']}" for r in results]
x = range(len(results))
ax.bar([i - 0.2 for i in x], [r["phase2_ms"] for r in results], width=0.4, label="phase 2: materialize all pages")
ax.bar([i + 0.2 for i in x], [r["phase3_ms"] for r in results], width=0.4, label="phase 3: history only")
ax.set_xticks(list(x), labels, fontsize=8)
ax.set_ylabel("full view, one layer, median ms")
ax.set_title(f"per-layer full-view cost, C={cp}")
ax.legend(fontsize=8)
plt.show()
