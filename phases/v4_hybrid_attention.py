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
# # DeepSeek-V4: hybrid attention under CP prefill, compressed caches sharded at rest
#
# **What it changes.** A DeepSeek-V4 layer caches **compressed entries** (one per 4 tokens on CSA
# layers, one per 128 on HCA layers) besides a 128-token sliding window. Under CP, each rank pools
# the entries whose last token it computes, with a small **halo** of earlier tokens' rows from the
# previous rank; one all-gather per layer moves the new entries (not raw tokens); CSA entries and
# their indexer keys are sharded at rest by entry page, while HCA entries, window tails and
# compressor states stay replicated.
#
# Code: `reference_impl/families/deepseek_v4/model/` (layer and oracle), `reference_impl/families/deepseek_v4/cache_layout.py`
# (entries byte by byte), `reference_impl/families/deepseek_v4/cp/` (plan, store, layer step). Design page:
# `docs/deepseek-v4.md`.

# %%
import json

import torch

from reference_impl.config import PhaseSet, Request, RunConfig, env_flag, get_preset
from reference_impl.cp.split import build_split
from reference_impl.families.deepseek_v4.cp.plan import build_plan
from reference_impl.families.deepseek_v4.model.compressor import slot_positions
from reference_impl.families.deepseek_v4.planner import plan_v4
from reference_impl.runner import run_prefills

ON_GPU = torch.cuda.is_available()
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Three layer types, two compressors
#
# `tiny-v4` has one layer of each type. A CSA entry `w` pools 8 tokens with stride 4: the first
# half of the previous window's rows and the second half of its own (negative positions: absent,
# weight 0). An HCA entry pools its own 128 tokens. Entry `w` is complete once its last token
# exists, so the query at position `t` sees entries `w < (t + 1) // m`.

# %%
# NBVAL_CHECK_OUTPUT
cfg = get_preset("tiny-v4")
print("layer types:", cfg.layer_types)
entries = torch.arange(3)
print("CSA slots of entries 0..2:", slot_positions(entries, 4).tolist())
print("HCA entry 1 reads positions", slot_positions(torch.tensor([1]), 128)[0, [0, -1]].tolist())
for t in (2, 3, 126, 127, 300):
    print(f"query at {t:>3} sees {(t + 1) // 4:>2} CSA and {(t + 1) // 128} HCA entries")

# %% [markdown]
# ## 2. The halo a split boundary needs
#
# One request of 1,021 tokens over `C = 4` ranks. Per rank: raw rows it reads from other ranks
# (windows reaching back 127 tokens, and every request's next window tail) and pre-pool rows
# (an entry's earlier tokens, and the next compressor state). Page-aligned blocks (phase 4) cut on
# multiples of 64, hence of 4: a CSA entry then straddles a boundary only through its overlap.
# Round-robin puts neighbouring tokens on different ranks: the halo is the whole chunk.

# %%
# NBVAL_CHECK_OUTPUT
for mode, aligned in (("in-seq", False), ("in-seq", True), ("round-robin", False)):
    meta = build_split(mode, 4, [1021], [0], 64, page_aligned=aligned)
    halos = []
    for rank in range(4):
        plan = build_plan(meta, cfg, rank)
        halos.append((len(plan.raw.need), len(plan.ratios[4].pool.need), len(plan.ratios[128].pool.need)))
    print(f"{mode:>11} aligned={aligned!s:>5}: (raw, CSA pre-pool, HCA pre-pool) rows per rank {halos}")

# %% [markdown]
# ## 3. Against the oracle at every level
#
# Two requests (203 new tokens; 29 cached + 110 new), chunks of 71: neither a multiple of 4 nor
# of 128. Every level agrees with the single-device oracle: hidden states, CSA top-k sets and every
# byte of the rebuilt caches. From level 2 the CSA entries are split across the ranks; the
# replicated parts are the same on every rank.

# %%
# NBVAL_CHECK_OUTPUT
base = RunConfig(preset="tiny-v4", cp_size=3, requests=(Request(0, 203), Request(29, 110)), chunk_size=71,
                 device="cpu", compute_dtype="fp32")
levels = (0, 2, 3, 8)
reports = run_prefills([base.replace(phases=PhaseSet.level(k)) for k in levels])
for k, rep in zip(levels, reports):
    csa = [r["csa_bytes"] for r in rep["per_rank"]]
    rest = {r["hca_bytes"] + r["window_bytes"] + r["compressor_state_bytes"] for r in rep["per_rank"]}
    print(f"level {k}: matches oracle {rep['matches_oracle']}, cache equal {rep['cache_equal']}, "
          f"CSA bytes per rank {csa}, replicated bytes per rank {sorted(rest)}")

# %% [markdown]
# ## 4. What moves per layer
#
# Bytes of each collective's gathered buffers, all layers, rank 0, level 3: the window halo
# (`v4_window`), the compressor halo (`v4_pool`), the new entries (`v4_entries`) and, with a
# prefix, the materialized history.

# %%
# NBVAL_CHECK_OUTPUT
from reference_impl.families.deepseek_v4.bench import tag_bytes  # noqa: E402
from reference_impl.runner import run_prefill  # noqa: E402

result = run_prefill(base.replace(phases=PhaseSet.level(3), check=False), tensors=True)
print(json.dumps(tag_bytes(result.ranks[0].collectives, base.cp_size), indent=1))

# %% [markdown]
# ## 5. DeepSeek-V4-Flash at 128K and 1M, one rank of C = 8
#
# On a GPU: `reference_impl.bench.v4` runs rank 0 of `C = 8` alone (its collectives as local
# copies plus a modeled 450 GB/s wire), the first four Flash layers (sliding, sliding, CSA, HCA),
# a 128K-token chunk and the last 8K chunk of a 1M-token request (its history installed as random
# entries). On a CPU, the planner's modeled figures for the same points.

# %%
if ON_GPU:
    from reference_impl.families.deepseek_v4 import bench as bench_v4

    workloads = "128k:0+16384,1m:131072+2048" if SMOKE else "128k:0+131072,1m:1040384+8192"
    bench_v4.main(["--out", "/tmp/v4_walkthrough.json", "--workloads", workloads, "--levels", "0,3,8",
                   "--wire-gbps", "450", "--repeats", "1"])
    doc = json.load(open("/tmp/v4_walkthrough.json"))
    summary = [{"context": w["context"], "level": p["level"], "layer_ms_by_type": p["layer_ms_by_type"],
                "measured_peak_bytes": p["measured_peak_bytes"], "kv_bytes": p["kv_bytes"] + p["index_bytes"]}
               for w in doc["workloads"] for p in w["levels"]]
else:
    doc = plan_v4("deepseek-v4-flash", 8, [131072, 1 << 20], [0, 3, 8], 48.0)
    summary = [{"context": p["context"], "level": p["level"], "modeled_layer_ms": p["layer_ms"],
                "kv_bytes_per_rank": p["kv_bytes_per_rank"]["total"], "v32_kv_bytes_per_rank": p["v32"]["kv_bytes_per_rank"]}
               for p in doc["points"]]
print(json.dumps({"on_gpu": ON_GPU, "points": summary}, indent=1))

# %% [markdown]
# ## 6. Capacity at 1M tokens, C = 8 (planner)
#
# Bytes at rest per rank for one 1M-token request, DeepSeek-V4-Flash beside DeepSeek-V3.2, and how
# many such requests fit a 48 GiB KV budget per GPU.

# %%
# NBVAL_CHECK_OUTPUT
capacity = plan_v4("deepseek-v4-flash", 8, [131072], [0], 48.0)["capacity_1m"]
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in capacity.items()}, indent=1))
