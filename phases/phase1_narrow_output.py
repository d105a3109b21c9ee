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
# # Phase 1: narrow output collection
#
# **What it changes.** After the last layer every CP rank holds the final hidden states of its own
# tokens only. The baseline's tail all-gather (all-gather #2) brings **every** token's hidden state
# to every rank, `T x hidden`, although sampling reads one row per request. Phase 1 gathers only the
# rows downstream needs: `n_req x hidden`. Eligibility is a batch-level fact that every rank shares
# (`OutputSpec`); a batch that needs every row (input logprobs, hidden-state return) falls back to
# the full gather, so every rank always issues the same collectives.
#
# Sections: correctness against the oracle and the full gather; bytes (DeepSeek-V3.2 dims, 4K to
# 128K tokens); measured time of the tail collection on this machine's device.
#
# Code: `reference_impl/cp/narrow_output.py` (phase 1), `reference_impl/cp/tail.py` (the baseline).

# %%
import json

import matplotlib.pyplot as plt
import torch

from reference_impl.config import PhaseSet, Request, RunConfig, env_flag, get_preset
from reference_impl.cp.narrow_output import tail_gather_bytes
from reference_impl.cp.split import build_split
from reference_impl.cp.tail import OutputSpec
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()  # does not initialize CUDA, so CPU ranks below can fork
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness
#
# The tiny preset, three requests (two with prefixes that end mid-page), four ranks. Phase 1 must
# agree with the single-device oracle and with the baseline's full gather; the two fallbacks must
# take the full path. Compute is float32 so that this cell prints the same on CPU and GPU.

# %%
# NBVAL_CHECK_OUTPUT
base = RunConfig(
    preset="tiny", cp_size=4, requests=(Request(0, 96), Request(40, 70), Request(13, 37)),
    compute_dtype="fp32", phases=PhaseSet.level(1), device="cpu",
)
narrow = run_prefill(base)
full = run_prefill(base.replace(phases=PhaseSet.level(0)))
fallbacks = {flag: run_prefill(base.replace(**{flag: True})) for flag in ("input_logprobs", "return_hidden_states")}
print("phase 1 matches oracle:", narrow["matches_oracle"], "| tail:", narrow["tail_mode"])
print("baseline matches oracle:", full["matches_oracle"], "| tail:", full["tail_mode"])
for flag, rep in fallbacks.items():
    print(f"fallback {flag}: tail={rep['tail_mode']}, matches oracle: {rep['matches_oracle']}")
print("collectives identical on all ranks:", all(r["collectives_identical"] for r in [narrow, full, *fallbacks.values()]))
print("tail-gather bytes per rank, full vs narrow:",
      full["per_rank"][0]["output_gather_bytes"], "vs", narrow["per_rank"][0]["output_gather_bytes"])

# %% [markdown]
# ## 2. Bytes of the tail gather at DeepSeek-V3.2 dims
#
# Computed from the split metadata (`tail_gather_bytes`, the same arithmetic the engine's measured
# byte counts are tested against): hidden 7168, bf16, one request, `C` in {2, 4, 8}. The full gather's
# buffer holds `C x ceil(T/C)` rows on every rank; the narrow one `C x 1` rows.

# %%
# NBVAL_CHECK_OUTPUT
cfg = get_preset("deepseek-v3.2")
row_bytes = cfg.dim * 2  # bf16 hidden state
contexts = [4096, 8192, 16384, 32768, 65536, 131072]
table = []
for cp in (2, 4, 8):
    for tokens in contexts:
        meta = build_split("in-seq", cp, [tokens])
        table.append((cp, tokens,
                      tail_gather_bytes(meta, row_bytes, OutputSpec(), narrow=False),
                      tail_gather_bytes(meta, row_bytes, OutputSpec(), narrow=True)))
print(f"{'C':>2} {'tokens':>7} {'full MiB':>10} {'narrow KiB':>11} {'ratio':>8}")
for cp, tokens, full_b, narrow_b in table:
    print(f"{cp:>2} {tokens:>7} {full_b / 2**20:>10.1f} {narrow_b / 2**10:>11.1f} {full_b / narrow_b:>8.0f}")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for cp in (2, 8):
    rows = [r for r in table if r[0] == cp]
    ax.plot([r[1] for r in rows], [r[2] / 2**20 for r in rows], "o-", label=f"full, C={cp}")
    ax.plot([r[1] for r in rows], [r[3] / 2**20 for r in rows], "s--", label=f"narrow, C={cp}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens in the batch")
ax.set_ylabel("tail all-gather buffer per rank (MiB)")
ax.set_title("DeepSeek-V3.2 tail gather: full vs narrow (one request)")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. Measured time of the tail collection
#
# `time_collectives` runs on every rank: the full tail gather of `[T/C, 7168]` bf16 hidden states
# versus the narrow gather of one row per request, median of 3 repeats on the GPU (5 on CPU) after a warm-up, a barrier
# before each repeat. **How CP runs here:** with one GPU the `C = 4` ranks share it and talk through
# gloo (NCCL refuses two ranks on one device), so the times include gloo's host staging; with
# several GPUs the launcher gives each rank its own GPU and NCCL. On CPU the sizes are toy sizes and
# the times say nothing about a GPU.

# %%
from reference_impl.bench.collectives import sweep_collectives
from reference_impl.launch import choose_backend

cp = 4
REPEATS = (1 if SMOKE else 3) if ON_GPU else 5
sizes = ([4096] if SMOKE else [4096, 16384, 32768]) if ON_GPU else [1024, 4096]
timings = sweep_collectives(cp, sizes, REPEATS, torch.bfloat16 if ON_GPU else torch.float32)
print(json.dumps({"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "cp_size": cp, "repeats": REPEATS,
                  "launch": choose_backend(cp, "auto", "auto", torch.cuda.device_count()).describe(),
                  "timings_ms": timings}, indent=1))

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([t["tokens"] for t in timings], [t["tail_full_ms"] for t in timings], "o-", label="full gather")
ax.plot([t["tokens"] for t in timings], [t["tail_narrow_ms"] for t in timings], "s--", label="narrow gather")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens in the batch")
ax.set_ylabel("tail collection, median ms (slowest rank)")
ax.set_title(f"tail collection, C={cp}")
ax.legend()
plt.show()

# %% [markdown]
# **Reading the result.** The narrow gather's bytes do not grow with the context: one row per
# request per rank. The full gather grows linearly with `T`. The measured times follow the bytes
# once the buffers are large enough that launch and synchronization costs stop dominating.
