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
# # GLM-5.3: the KDA state hand-off and the pooled indexer under CP prefill
#
# **What it changes.** A GLM-5.3 KDA layer is a recurrence along the sequence: a token needs the state
# after every earlier token. Under the in-seq split each rank maps its own blocks' state as an affine
# function `S -> A S + B`, the maps are all-gathered, and every rank composes them in sequence order to
# get the state entering each of its blocks. On indexed layers, a pooled group key (16 tokens) is
# stored once, by the owner of the group's last token; at level 2 that owner alone pools it, from phase 3
# every rank pools every group its chunk completes and the owner stores it.
#
# **What it buys and costs.** No rank replays another rank's tokens; the price is one map per block per
# KDA layer per chunk, float32 `H x Dk x (Dk + Dv)`, whatever the block's length.
#
# Code: `reference_impl/families/glm53/model/kda.py` (the layer, `span_map`, `compose`),
# `reference_impl/families/glm53/cp/step.py` (the hand-off), `reference_impl/families/glm53/cp/store.py`
# (what each rank keeps), `reference_impl/families/glm53/planner.py` (the bytes at scale). Design page:
# `docs/glm-5.3.md`.

# %%
import json

import torch

import reference_impl as ri
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.split import build_split
from reference_impl.families.glm53 import planner
from reference_impl.families.glm53.config import GLM53_PRESETS
from reference_impl.families.glm53.model.kda import compose, kda_chunked, span_map
from reference_impl.families.glm53.model.oracle import build_glm53_model

torch.manual_seed(0)
cfg = GLM53_PRESETS["tiny-glm53"]
C, T, PAGE = 3, 150, 8  # 150 tokens: not a multiple of the 16-token group or the 8-token pages
model = build_glm53_model(cfg, torch.float32, 0, "cpu")
print("layer types:", cfg.layer_types, "| indexer types:", cfg.indexer_types)

# %% [markdown]
# ## 1. The zigzag blocks
#
# One request of 150 tokens over `C = 3` ranks: `2C = 6` blocks; rank `r` computes blocks `r` and
# `2C - 1 - r`, so each rank holds one early and one late block.

# %%
# NBVAL_CHECK_OUTPUT
meta = build_split("in-seq", C, [T], [0], PAGE)
blocks = sorted((s.q_abs_start, s.length, r) for r in range(C) for s in meta.segments[r] if s.length)
for b, (start, length, rank) in enumerate(blocks):
    print(f"block {b}: positions {start:>3} .. {start + length - 1:>3}  computed by rank {rank}")

# %% [markdown]
# ## 2. Each rank maps its own blocks
#
# Layer 0 is a KDA layer. A block's map needs only its own tokens (and a 3-row convolution halo from
# the block before it, all-gathered beside the maps): `A` is the recurrence run from the identity with
# zero values, `B` the recurrence from a zero state. One map is float32 `[H, Dk, Dk + Dv]`.

# %%
# NBVAL_CHECK_OUTPUT
attn = model.layers[0].attn
x = model.layers[0].attn_norm(torch.randn(T, cfg.dim) * 0.5)
mixed = attn.mixed(x)
g, beta = attn.gates(x)
halo0 = torch.zeros(attn.halo, cfg.conv_dim)  # before the sequence: zeros
q, k, v = attn.qkv(attn.conv(mixed, halo0))  # what the whole sequence's convolution gives
maps, qkv = [], []
for start, length, _ in blocks:
    span = slice(start, start + length)
    before = halo0 if start == 0 else mixed[start - attn.halo : start]  # the halo: the previous block's rows
    qb, kb, vb = attn.qkv(attn.conv(mixed[span], before))
    assert torch.equal(kb, k[span])  # with its halo, a block's convolution is the sequence's
    maps.append(span_map(kb, vb, g[span], beta[span]))
    qkv.append((qb, kb, vb))
A, B = maps[0]
print("one map [A | B]:", list(torch.cat([A, B], dim=-1).shape), "float32 =", planner.map_bytes(cfg), "bytes")

# %% [markdown]
# ## 3. All-gather and compose, against the sequential oracle
#
# After the all-gather every rank holds the `2C` maps and composes them in sequence order from the
# request's cached state (zero here): `S_{b+1} = A_b S_b + B_b`. The sequential oracle runs the
# recurrence token by token over everything before the block. They agree to float32 rounding.

# %%
# NBVAL_CHECK_OUTPUT
state = torch.zeros(cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim)
entering = []
for (start, _, _), (A, B) in zip(blocks, maps):
    entering.append(state)
    _, oracle_state = kda_chunked(q[:start], k[:start], v[:start], g[:start], beta[:start], torch.zeros_like(state))
    err = (state - oracle_state).abs().max().item()
    print(f"state entering block at {start:>3}: max |composed - sequential| {'< 1e-5' if err < 1e-5 else err}")
    state = compose(state, A, B)

# %% [markdown]
# ## 4. Each rank runs its own blocks from their entering states
#
# Rank `r` runs blocks `r` and `2C - 1 - r` from the states composed above; the concatenated outputs
# equal the recurrence over the whole sequence.

# %%
# NBVAL_CHECK_OUTPUT
core_seq, final_seq = kda_chunked(q, k, v, g, beta, torch.zeros_like(state))
core = torch.cat([kda_chunked(*qkv[b], g[s : s + n], beta[s : s + n], entering[b])[0]
                  for b, (s, n, _) in enumerate(blocks)])
print("block outputs vs the sequential layer: max diff < 1e-5:", (core - core_seq).abs().max().item() < 1e-5)
print("state after the chunk (every rank):      max diff < 1e-5:", (state - final_seq).abs().max().item() < 1e-5)

# %% [markdown]
# ## 5. The pooled indexer's ownership rule
#
# A group of 16 tokens has one pooled key, stored at its **last token's** loc: from phase 2 it lives on
# that loc's owner (pages of 8 tokens here, page `p` on rank `p mod C`). At level 2 the owner pools it
# from the gathered rows; from phase 3 every rank pools it and only the owner stores it. A group may
# straddle two blocks computed by different ranks, or two pages of different owners: the last token
# decides. The 6 tokens after the last complete group wait as pending rows.

# %%
# NBVAL_CHECK_OUTPUT
P = cfg.index_kpool
block_rank = {p: r for s, n, r in blocks for p in range(s, s + n)}
for grp in range(T // P):
    first, last = grp * P, grp * P + P - 1
    straddles = []
    if block_rank[first] != block_rank[last]:
        straddles.append(f"blocks of ranks {block_rank[first]} and {block_rank[last]}")
    if (first // PAGE) % C != (last // PAGE) % C:
        straddles.append(f"pages of ranks {(first // PAGE) % C} and {(last // PAGE) % C}")
    print(f"group {grp} ({first:>3}..{last:>3}): key on rank {(last // PAGE) % C}"
          + (f"  (straddles {'; '.join(straddles)})" if straddles else ""))
print(f"pending (incomplete group): positions {T // P * P}..{T - 1}, replicated on every rank")

# %% [markdown]
# ## 6. The engine against the oracle
#
# The same request through the CP engine at levels 0 (everything replicated) and 2 (latent rows and
# group keys sharded at rest), and a chunked prefill after a cached prefix at level 8 (every phase), each
# compared with the single-device GLM-5.3 oracle: hidden states, every indexed layer's selection, every
# KDA state and convolution tail, every latent row (FP8, the default row) and group key.

# %%
# NBVAL_CHECK_OUTPUT
runs = {
    "level 0": RunConfig(preset="tiny-glm53", cp_size=C, phases=PhaseSet.level(0), page_size=PAGE,
                         requests=(Request(0, T),), device="cpu"),
    "level 2": RunConfig(preset="tiny-glm53", cp_size=C, phases=PhaseSet.level(2), page_size=PAGE,
                         requests=(Request(0, T),), device="cpu"),
    "level 8, prefix 37, chunks of 23": RunConfig(preset="tiny-glm53", cp_size=C, phases=PhaseSet.level(8),
                                                  page_size=PAGE, requests=(Request(37, 61),),
                                                  chunk_size=23, device="cpu"),
}
reports = {name: ri.run_prefill(run) for name, run in runs.items()}
for name, rep in reports.items():
    keys = [r["index_bytes"] for r in rep["per_rank"]]
    print(f"{name}: matches oracle {rep['matches_oracle']}; group-key bytes per rank {keys}")

# %% [markdown]
# ## 7. What moves: the state maps against the KV all-gather
#
# Per rank, all layers, for the 150-token request at level 2: the KDA maps and halos received, against
# the latent rows and group keys gathered from their owners on the indexed layers. At these tiny dims a
# map is 4 KiB, so the maps and halos come to about half of what the indexed layers materialize; at
# GLM-5.3-Flash's sizes (the planner, rank 0 of `C = 8`, per layer) the maps are fixed per chunk while the
# KV all-gather grows with the context.

# %%
# NBVAL_CHECK_OUTPUT
rank0 = reports["level 2"]["per_rank"][0]
print(json.dumps({k: rank0[k] for k in ("kda_map_bytes_received", "kda_halo_bytes_received", "materialized_bytes")}))
assert rank0["kda_map_bytes_received"] == cfg.count("linear_attention") * (2 * C - 2) * planner.map_bytes(cfg)
flash = GLM53_PRESETS["glm-5.3-flash"]
for name, chunk, context in (("128K, one chunk", 131072, 131072), ("last 8K chunk of 1M", 8192, 1 << 20)):
    ex = planner.exchange_bytes(flash, chunk, context, 8)
    print(f"Flash {name}: KDA maps {ex['kda_maps'] / 2**20:,.0f} MiB per KDA layer; "
          f"KV all-gather {ex['kv_all_gather'] / 2**20:,.0f} MiB per indexed layer")

# %%
# NBVAL_CHECK_OUTPUT
assert all(rep["matches_oracle"] for rep in reports.values()), {n: r["problems"] for n, r in reports.items()}
print("CP equals the oracle at every run above")
