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
# # Phase 4: the page-aligned split
#
# **What it changes.** The token-balanced zigzag cuts each request's extend into `2C` blocks of
# nearly equal token counts, so a block boundary can fall inside a page and two ranks then compute
# tokens of one page. Phase 4 cuts on page boundaries of absolute positions (`prefix + j`): every
# current page gets exactly one compute owner, which phase 5 needs. The price is load balance: blocks
# now differ by up to a page. Requests with fewer than `2C` page units keep the token-balanced split.
#
# Code: `reference_impl/cp/page_aligned.py`.

# %%
import matplotlib.pyplot as plt
import torch

from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.split import build_split
from reference_impl.runner import run_prefill

ON_GPU = torch.cuda.is_available()
print("GPU available:", ON_GPU)

# %% [markdown]
# ## 1. A worked example and correctness
#
# One request with a 13-token prefix and 100 new tokens, page size 16, `C = 2`: the first unit is
# the 3 tokens that fill the prefix's partial page.

# %%
# NBVAL_CHECK_OUTPUT
aligned = build_split("in-seq", 2, [100], [13], 16, page_aligned=True)
balanced = build_split("in-seq", 2, [100], [13], page_size=16)
print("token-balanced blocks:", balanced.block_sizes[0])
print("page-aligned blocks:  ", aligned.block_sizes[0], "| page_aligned:", aligned.page_aligned)
for cp in (2, 3, 4):
    rep = run_prefill(RunConfig(preset="tiny", cp_size=cp, requests=(Request(13, 150), Request(40, 130)), page_size=8,
                                compute_dtype="fp32", device="cpu", phases=PhaseSet.level(4)))
    print(f"C={cp}: matches oracle {rep['matches_oracle']}, cache equal {rep['cache_equal']}")

# %% [markdown]
# ## 2. Load balance: page-aligned vs token-balanced
#
# Max over ranks of the tokens a rank computes, divided by the mean, for one request with page
# size 64, a prefix that ends mid-page (37 tokens) and lengths that are not page multiples. 1.0 is
# perfect balance; the page-aligned split is off by at most about a page per block, which matters
# for short requests and fades with length. Pure metadata: the same on any device.

# %%
# NBVAL_CHECK_OUTPUT
lengths = [1000, 2500, 5000, 12345, 40000, 100000, 131000]  # not page multiples
imbalance = {}
print(f"{'tokens':>7} " + " ".join(f"{'C=' + str(c) + ' tok':>9} {'C=' + str(c) + ' page':>10}" for c in (2, 4, 8)))
for n in lengths:
    row = []
    for cp in (2, 4, 8):
        for name, meta in (("tok", build_split("in-seq", cp, [n], [37], page_size=64)),
                           ("page", build_split("in-seq", cp, [n], [37], 64, page_aligned=True))):
            ratio = max(meta.rank_lengths) / (sum(meta.rank_lengths) / cp)
            imbalance[(cp, name, n)] = ratio
            row.append(f"{ratio:>9.4f}" if name == "tok" else f"{ratio:>10.4f}")
    print(f"{n:>7} " + " ".join(row))

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for cp in (2, 4, 8):
    ax.plot(lengths, [imbalance[(cp, "page", n)] for n in lengths], "o-", label=f"page-aligned, C={cp}")
    ax.plot(lengths, [imbalance[(cp, "tok", n)] for n in lengths], "k:", alpha=0.5)
ax.set_xscale("log", base=2)
ax.set_xlabel("extend tokens (one request, prefix 37, page 64)")
ax.set_ylabel("max / mean tokens per rank")
ax.set_title("load balance (dotted: token-balanced)")
ax.legend()
plt.show()
