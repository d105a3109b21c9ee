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
# # Round-robin with KV sharded at rest (interleave 1)
#
# **What it changes.** The cache is sharded by an **interleave** `I`: runs of `I` consecutive
# slots, run `g` on rank `g % C`, packed per rank. The round-robin split computes the token at
# position `t` of every request on rank `t % C`; at `I = 1` with `C` dividing the page size, that
# rank owns the token, so every batch writes directly, with no page alignment and no lanes, and
# the shards are the layout a decode-context-parallel decode of size `C` reads.
#
# Code: `reference_impl/cp/ownership.py` (`Ownership`), `reference_impl/cp/split.py` (round-robin),
# `reference_impl/pd/dcp.py`. Design page: `docs/round-robin-shared-kv.md`.

# %%
import torch

from reference_impl.bench.layer import Workload, measure
from reference_impl.config import PhaseSet, Request, RunConfig, env_flag
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpLayout, transfer_to_dcp
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()
SMOKE = env_flag("notebook_smoke")  # the test command's quick GPU pass: small sizes, the same code
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Where a token lives
#
# `C = 4`, pages of 16 slots. A request starts on a fresh page, so with `I = 1` slot `l` of its
# token at position `t` has `l % 4 == t % 4`: the owner is the round-robin compute rank. Each
# rank packs its slots densely (`physical = l // 4`).

# %%
# NBVAL_CHECK_OUTPUT
own = Ownership(cp_size=4, interleave=1, page_size=16)
request_first_page = 5  # any page id: requests start on a page boundary
positions = torch.arange(37, 45)  # a prefix of 37, then new tokens
locs = request_first_page * 16 + positions
print("positions      ", positions.tolist())
print("compute rank   ", (positions % 4).tolist())
print("owner          ", own.owner(locs).tolist())
print("physical loc   ", own.physical(locs).tolist())
print("follows positions:", own.follows_positions, "| with C = 3:", Ownership(3, 1, 16).follows_positions)

# %% [markdown]
# ## 2. Against the oracle: every level that applies
#
# Tiny preset, three requests (prefixes 37 and 5 end mid-page), pages of 16. Round-robin's levels
# drop phases 4 and 5 (in-seq only). `C = 3` does not divide 16: the batch takes the gathered store
# path, and still agrees.

# %%
# NBVAL_CHECK_OUTPUT
requests = (Request(37, 70), Request(0, 45), Request(5, 9))
for cp in (2, 3, 4):
    for phases in ("2", "3", "+1,2,3,6,7,8"):
        rep = run_prefill(RunConfig(preset="tiny", cp_size=cp, split_mode="round-robin", requests=requests,
                                    page_size=16, phases=PhaseSet.parse(phases), device="cpu", compute_dtype="fp32"))
        print(f"C={cp} phases {str(PhaseSet.parse(phases)):>12}: store {rep['store_path']:>8}, "
              f"matches oracle {rep['matches_oracle']}, cache equal {rep['cache_equal']}")

# %% [markdown]
# ## 3. Per rank: round-robin at interleave 1 against in-seq, level 8
#
# One rank (rank 0 of `C = 8`) alone, its collectives as local copies plus a modeled 450 GB/s wire
# (`LoopbackGroup`), DeepSeek-V3.2 dims on a GPU: per-layer time (median of the layers after a
# warm-up run), KV at rest, and the bytes materialized per layer. On a CPU the same code runs the
# tiny preset at toy sizes: its times are CPU times and say nothing about a GPU.

# %%
if ON_GPU:
    preset, cp, layers, wire = "deepseek-v3.2", 8, 4, 450.0
    workloads = [Workload("32k", 32768, 32768)] if SMOKE else [Workload("32k", 32768, 32768), Workload("128k", 65536, 65536)]
else:
    preset, cp, layers, wire = "tiny", 4, 2, None
    workloads = [Workload("toy", 256, 256)]
rows = []
for workload in workloads:
    for mode in ("in-seq", "round-robin"):
        out = measure(preset, workload, [8], cp, 0, layers, "cuda" if ON_GPU else "cpu", wire, prefetch_repeats=1,
                      split_mode=mode)
        point = out["levels"][0]
        rows.append((workload.name, mode, point))
print(f"{'workload':>8} {'split':>11} {'phases':>16} {'store':>8} {'layer ms':>9} {'KV at rest MiB':>15} {'materialized MiB':>17}")
for name, mode, p in rows:
    print(f"{name:>8} {mode:>11} {p['phases']:>16} {p['store_path']:>8} {p['layer_ms_median']:>9.2f} "
          f"{p['kv_bytes'] / 2**20:>15.1f} {p['materialized_bytes'] / 2**20:>17.1f}")

# %% [markdown]
# ## 4. The shards are a DCP decode's layout
#
# Each prefill rank sends, per layer and request, its rows to the decode rank that keeps them. A
# DCP decode of the same size and interleave gets every row from the same-numbered prefill rank
# at its next local row: nothing is re-laid out. A decode of another size re-lays the rows out by
# position; both are byte-equal to the oracle.

# %%
# NBVAL_CHECK_OUTPUT
run = RunConfig(preset="tiny", cp_size=4, split_mode="round-robin", requests=requests, page_size=16,
                phases=PhaseSet.parse("+1,2,3,6,7,8"), device="cpu", compute_dtype="fp32")
result = run_prefill(run, tensors=True)
layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
for decode in (DcpLayout(4, 1), DcpLayout(2, 1)):
    shards, stats = transfer_to_dcp([r.stored for r in result.ranks], [r.total for r in requests], decode, layout, 16)
    equal = all(
        torch.equal(shard.rows(layer, req)[0], cache.mla_rows[torch.arange(len(cache))[decode.rank_of(torch.arange(len(cache))) == shard.rank]])
        for layer, caches in enumerate(result.oracle.caches) for req, cache in enumerate(caches) for shard in shards
    )
    print(f"decode C={decode.cp_size}: re-laid-out rows per prefill rank {[s.relaid_rows for s in stats]}, "
          f"sent to {[sorted(s.to_ranks) for s in stats]}, MLA rows equal to the oracle's: {equal}")
