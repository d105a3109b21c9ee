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
# # Phase 8: one-layer-ahead prefix prefetch
#
# **What it changes.** With phases 2-3 every layer materializes its history (the cached prefix
# pages) before its attention can start. The history does not depend on the layer's computation,
# so while layer `l` computes, a side stream materializes layer `l + 1`'s history MLA rows into the
# other of two alternating buffers; layer `l + 1` waits on an event only when it consumes it. MLA
# only: the indexer K history stays synchronous. On CPU the same code runs synchronously.
#
# Code: `reference_impl/cp/prefetch.py`.

# %%
import logging

import torch

from reference_impl import engine
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.prefetch import MlaPrefetcher
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. Correctness, and what the wait protects
#
# A prefix-heavy batch over 4 layers. `DeferredStream` runs the prefetch only when its consumer
# waits (what a side stream allows); `NoWaitStream` lets the consumer skip the wait, so it reads
# what its buffer held two layers earlier. Only the first agrees with the oracle.

# %%
# NBVAL_CHECK_OUTPUT
class DeferredStream:
    def __init__(self):
        self.pending = {}

    def submit(self, work, slot):
        self.pending[slot] = work
        return slot

    def wait(self, handle):
        self.pending.pop(handle)()

    def release(self, slot):
        pass


class NoWaitStream(DeferredStream):
    def submit(self, work, slot):
        late = self.pending.pop(slot, None)
        if late is not None:
            late()
        self.pending[slot] = work
        return slot

    def wait(self, handle):
        pass


run = RunConfig(preset="tiny", cp_size=1, requests=(Request(16, 150), Request(13, 130)), page_size=8, n_layers=4,
                compute_dtype="fp32", device="cpu", phases=PhaseSet.level(8))
logging.getLogger("reference_impl").setLevel(logging.CRITICAL)  # the disagreement is the point here
real = engine.MlaPrefetcher
for stream in (DeferredStream, NoWaitStream):
    engine.MlaPrefetcher = lambda store, n, s=stream: MlaPrefetcher(store, n, s())
    print(f"{stream.__name__}: matches oracle {run_prefill(run)['matches_oracle']}")
engine.MlaPrefetcher = real
logging.getLogger("reference_impl").setLevel(logging.WARNING)
rep = run_prefill(run.replace(cp_size=3))
print(f"C=3 with the real stream: matches oracle {rep['matches_oracle']}, collectives per rank {rep['per_rank'][0]['collectives']}")

# %% [markdown]
# ## 2. Per-layer time with and without prefetch (GPU)
#
# DeepSeek-V3.2 dims, 4 layers, a prefix-heavy batch. With one GPU the ranks share it through gloo,
# whose all-gather is a synchronous host call: the prefetch cannot overlap there. The overlap needs
# NCCL with one GPU per rank.

# %%
if ON_GPU:
    base = RunConfig(preset="deepseek-v3.2", n_layers=4, cp_size=max(1, torch.cuda.device_count()),
                     requests=(Request(16384, 2048),), check=False)
    for level in (7, 8):
        rep = run_prefill(base.replace(phases=PhaseSet.level(level)))
        print(f"level {level}: layer ms median {rep['timings']['layer_ms_median']:.2f} ({rep['backend']})")
else:
    print("no GPU here: the GPU cell runs on an H200")
