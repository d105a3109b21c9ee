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
# # Phase 0: the baseline and its two all-gathers
#
# Context-parallel prefill splits a batch's tokens over `C` ranks (the in-seq zigzag split). Each
# layer needs the KV of **all** earlier tokens, so every layer starts with **all-gather #1**: every
# rank's latent KV (576 wide) and indexer K (128 wide), padded to the longest rank, gathered
# rank-major, trimmed and **reranged** to sequence order. Every rank then quantizes and stores the
# whole chunk (a replicated cache) and runs the indexer top-k and sparse attention for its own
# queries. After the last layer **all-gather #2** (the tail) brings the hidden states back.
#
# Code: `reference_impl/engine.py`, `reference_impl/cp/rerange.py`, `reference_impl/cp/kv_replicated.py`,
# `reference_impl/cp/tail.py`.

# %%
import json

import matplotlib.pyplot as plt
import torch

from reference_impl.config import PhaseSet, Request, RunConfig, env_flag, get_preset
from reference_impl.cp.split import build_split
from reference_impl.kvcache.layout import KVLayout
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()  # does not initialize CUDA, so CPU ranks below can fork
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. The split and the rerange
#
# Two requests (11 tokens with a 5-token prefix, and 13 tokens) over `C = 4` ranks. Each request
# is cut into `2C = 8` blocks, the remainder going to the first blocks; rank `r` computes blocks
# `r` and `2C-1-r`. The rerange index maps the rank-major gathered rows back to sequence order.

# %%
# NBVAL_CHECK_OUTPUT
meta = build_split("in-seq", 4, [11, 13], [5, 0])
for rank in range(4):
    print(f"rank {rank}: tokens {list(meta.local_tokens(rank))}, positions {list(meta.local_positions(rank))}")
gathered = [g for rank in range(4) for g in meta.local_tokens(rank)]  # what the all-gather returns
print("rank-major:", gathered)
print("reranged:  ", [gathered[i] for i in meta.rerange_index])

# %% [markdown]
# ## 2. Correctness of the baseline
#
# Tiny preset, `C` in {1, 2, 3, 4}, FP8 and BF16 caches: outputs, top-k sets and the cache rebuilt
# from every rank agree with the single-device oracle.

# %%
# NBVAL_CHECK_OUTPUT
requests = (Request(0, 96), Request(40, 70), Request(13, 37))
for kv_dtype in ("fp8", "bf16"):
    for cp in (1, 2, 3, 4):
        rep = run_prefill(RunConfig(preset="tiny", cp_size=cp, requests=requests, kv_dtype=kv_dtype,
                                    compute_dtype="fp32", phases=PhaseSet(), device="cpu"))
        print(f"{kv_dtype} C={cp}: matches oracle {rep['matches_oracle']}, cache equal {rep['cache_equal']}, "
              f"collectives per rank {rep['per_rank'][0]['collectives']}")

# %% [markdown]
# ## 3. Bytes per token per layer
#
# All-gather #1 moves the 576 + 128 values of each token **before** quantization (bf16 on the GPU);
# the cache then stores them packed. The tail moves one hidden state per token, once per forward.

# %%
# NBVAL_CHECK_OUTPUT
for name in ("deepseek-v3.2", "glm-5"):
    cfg = get_preset(name)
    fp8 = KVLayout.from_config(cfg, "fp8", 64)
    gather = (cfg.kv_width + cfg.index_head_dim) * 2
    print(f"{name}: all-gather #1 {gather} B/token/layer (x{cfg.n_layers} layers = {gather * cfg.n_layers} B/token); "
          f"cache {fp8.mla_bytes}+{fp8.index_bytes} B/token/layer; tail {cfg.dim * 2} B/token")
    at_128k = 131072 * cfg.n_layers * (fp8.mla_bytes + fp8.index_bytes)
    print(f"  FP8 cache + index at 128K tokens: {at_128k / 2**30:.2f} GiB per replica")

# %% [markdown]
# ## 4. Measured time of all-gather #1 (one layer) on this device
#
# One layer's gather of `[T/C, 576]` KV and `[T/C, 128]` index K (bf16 on GPU), trim and rerange;
# median of 3 repeats on the GPU (5 on CPU), slowest rank. With one GPU the `C = 4` ranks share it through gloo (host
# staging included); with several GPUs each rank has its own and NCCL carries the gather.

# %%
from reference_impl.bench.collectives import sweep_collectives
from reference_impl.launch import choose_backend

cp = 4
REPEATS = (1 if SMOKE else 3) if ON_GPU else 5
sizes = ([4096] if SMOKE else [4096, 16384, 32768]) if ON_GPU else [1024, 4096]
points = sweep_collectives(cp, sizes, REPEATS, torch.bfloat16 if ON_GPU else torch.float32)
print(json.dumps({"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "cp_size": cp, "repeats": REPEATS,
                  "launch": choose_backend(cp, "auto", "auto", torch.cuda.device_count()).describe(),
                  "points": points}, indent=1))

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([p["tokens"] for p in points], [p["layer_gather_ms"] for p in points], "o-")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens in the batch")
ax.set_ylabel("all-gather #1, one layer, median ms")
ax.set_title(f"per-layer KV + index all-gather, C={cp}")
plt.show()
