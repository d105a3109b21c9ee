"""Draw the site's data diagrams as SVGs, from the package's own metadata and the measured results.

    python3 scripts/draw_diagrams.py            # write docs/diagrams/*.svg
    python3 scripts/draw_diagrams.py --check    # exit 1 naming each diagram that is not what its sources say

* ``one_layer.svg``: one layer of the baseline on rank ``r``, the data flow and the shapes;
* ``splits.svg``: which rank computes which token under the in-seq (zigzag), round-robin and
  page-aligned splits (:func:`reference_impl.build_split`);
* ``pages_over_ranks.svg``: a batch's logical pages, their owners ``page % C`` and the compact
  physical pages on each rank (:mod:`reference_impl.cp.ownership`, the batch of phase 2's worked
  example);
* ``prefetch_timeline.svg``: phase 8's two streams over three layers, to scale, with the times of the
  prefix-heavy ``bench.layer`` run (``docs/results/layer_bench.json``).
* ``v4_hit_eviction.svg``: what a DeepSeek-V4 prefix hit at ``P`` reuses, carries and computes at several
  residues mod 4, 8 and 128 (:func:`~reference_impl.families.deepseek_v4.model.compressor.state_start`), and
  a budgeted pool's pages batch by batch as the engine's page table replays them (the scenario of
  ``tests/test_v4_eviction.py``).

Every diagram is drawn from a data object that the file carries (:mod:`reference_impl.figures`),
so the test command finds a diagram whose sources changed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reference_impl import figures  # noqa: E402
from reference_impl.tool_args import ToolParser, output_folder, refusing  # noqa: E402

OUT = ROOT / "docs" / "diagrams"
RESULTS = ROOT / "docs" / "results"
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


# ------------------------------------------------------------------------------------ the data


def one_layer_data() -> dict[str, Any]:
    """The baseline layer's boxes (text, position) and arrows (label): two rows, left to right then back."""
    nodes = [
        ("x", 9, 30, "x_local\n[n_local, dim]\nthis rank's tokens"),
        ("proj", 29.5, 30, "project()\nkv [n_local, 576]\nindex_k [n_local, 128]\nmodel/attention.py"),
        ("ag", 50, 30, "all-gather #1\npadded to max_rank_len\n[C, max_len, 576 + 128]\ncp/comm.py"),
        ("rr", 70.5, 30, "trim + rerange\nkv_seq [T, 576]\nindex_k_seq [T, 128]\ncp/rerange.py"),
        ("store", 91, 30, "store_current\nquantize, write\nall T tokens\ncp/kv_replicated.py"),
        ("pool", 91, 8, "pool\na full replica\non every rank\nkvcache/pool.py"),
        ("view", 70.5, 8, "full_view\nkv [S, 576] bf16\nindex_k [S, 128] e4m3\nread + dequantize"),
        ("att", 50, 8, "attend()\nindexer top-k,\nsparse MLA\nkernels/dispatch.py"),
        ("res", 29.5, 8, "x_local += out\n[n_local, dim]"),
    ]
    edges = [
        ("x", "proj", ""),
        ("proj", "ag", ""),
        ("ag", "rr", ""),
        ("rr", "store", ""),
        ("store", "pool", ""),
        ("pool", "view", ""),
        ("view", "att", ""),
        ("proj", "att", "q, index q, weights\n(local tokens only)"),
        ("att", "res", ""),
    ]
    return {
        "title": "One layer on rank r (baseline; every rank runs the same steps)",
        "nodes": [{"id": i, "x": x, "y": y, "text": t} for i, x, y, t in nodes],
        "edges": [{"from": a, "to": b, "label": label} for a, b, label in edges],
    }


def splits_data() -> dict[str, Any]:
    """Rank of every token under three splits, and each rank's local order."""
    import reference_impl as ri

    cases = [
        (
            "in-seq (zigzag), one request of 19 tokens, C = 4: 2C blocks, rank r takes blocks r and 2C-1-r",
            ri.build_split("in-seq", 4, [19]),
        ),
        ("round-robin, the same request: token t on rank t % C", ri.build_split("round-robin", 4, [19])),
        (
            "page-aligned in-seq (phase 4): 13 cached + 100 new tokens, page 16, C = 2: block ends on page ends",
            ri.build_split("in-seq", 2, [100], [13], page_size=16, page_aligned=True),
        ),
    ]
    rows = []
    for title, split in cases:
        n = sum(len(split.local_tokens(r)) for r in range(split.cp_size))
        owner = [0] * n
        for rank in range(split.cp_size):
            for t in split.local_tokens(rank):
                owner[t] = rank
        prefix = split.prefix_lens[0] if split.prefix_lens else 0
        rows.append(
            {
                "title": title,
                "cp_size": split.cp_size,
                "rank_of_token": owner,
                "prefix": prefix,
                "page_size": split.page_size if split.page_aligned else None,
                "local": [list(split.local_tokens(r)) for r in range(split.cp_size)],
            }
        )
    return {"rows": rows}


def pages_data() -> dict[str, Any]:
    """Phase 2's worked example: requests 0+96, 40+70, 13+37, page 16, C = 3."""
    import torch

    import reference_impl as ri
    from reference_impl.cp.batch import BatchLocs
    from reference_impl.cp.ownership import page_owner, physical_page

    cp, page = 3, 16
    meta = ri.build_split("in-seq", cp, [96, 70, 37], [0, 40, 13], page_size=page)
    batch = BatchLocs.build(meta)
    requests = [sorted({int(p) for p in (locs // page).tolist()}) for locs in batch.request_locs]
    pages = torch.arange(batch.n_pages)
    return {
        "cp_size": cp,
        "page_size": page,
        "requests": requests,
        "owner": page_owner(pages, cp).tolist(),
        "physical": physical_page(pages, cp).tolist(),
        "tokens": [[p, e] for p, e in zip([0, 40, 13], [96, 70, 37])],
    }


def prefetch_timeline_data(results: Path = RESULTS) -> dict[str, Any]:
    """Phase 8 to scale: the prefix-heavy run with the most new tokens of ``layer_bench.json``."""
    doc = json.loads((results / "layer_bench.json").read_text())
    work = max((w for w in doc["workloads"] if "prefetch" in w), key=lambda w: w["workload"]["extend"])
    pf = work["prefetch"]
    return {
        "prefix": work["workload"]["prefix"],
        "extend": work["workload"]["extend"],
        "wire_gbps": doc["wire_gbps"],
        "level7_ms": pf["level7_ms"],
        "level8_ms": pf["level8_ms"],
        "payload_ms": pf["payload_ms"],
        "stall_ms": pf["exposed_wait_ms_median"],
        "layers": 3,
    }


def v4_hit_eviction_data() -> dict[str, Any]:
    """Hit points at several residues (per layer kind: complete entries reused, first carried row, window
    start) and the eviction scenario's pool per batch (page -> holders, evicted, hits, misses)."""
    from reference_impl.config import PhaseSet, RunConfig, parse_batches
    from reference_impl.engine import RunPool, chunk_metadata
    from reference_impl.families.deepseek_v4.model.compressor import state_start
    from reference_impl.presets import get_preset
    from reference_impl.schedule import chunk_schedule

    window = get_preset("deepseek-v4-flash").window_size
    hits = [
        {
            "prefix": p,
            "window_from": max(0, p - (window - 1)),
            "kinds": {kind: {"ratio": m, "entries": p // m, "carried_from": state_start(p, m)} for kind, m in ks},
        }
        for p in (70, 68, 72, 131, 256)
        for ks in [(("csa", 4), ("hca", 128))]
    ]
    spec, page, budget = "0+160;0+160;r0:131+16,0+64;r1:133+20", 32, 10
    requests, sizes = parse_batches(spec)
    run = RunConfig(
        preset="tiny-v4",
        cp_size=2,
        requests=tuple(requests),
        batch_sizes=sizes,
        page_size=page,
        pool_pages=budget,
        phases=PhaseSet.level(2),
        device="cpu",
    )
    pool = RunPool(run)
    table, batches = pool.table, []
    for chunk in chunk_schedule(run):
        before = set(table.requests)
        pool.build(chunk, chunk_metadata(run, chunk), "cpu", budget, True)
        holders: list[list[int]] = [[] for _ in range(budget)]
        for req in table.requests:
            for p in table.pages(req):
                holders[p].append(int(req))  # type: ignore[call-overload]
        batches.append(
            {
                "batch": chunk.batch,
                "new": [
                    f"r{r}"
                    + (f" = r{run.requests[r].shares}:" if run.requests[r].shares is not None else " = ")
                    + f"{run.requests[r].prefix}+{run.requests[r].extend}"
                    for r in chunk.requests
                ],
                "holders": holders,
                "evicted": sorted(int(r) for r in before - set(table.requests)),  # type: ignore[call-overload]
                "hits": [r for r in chunk.requests if run.requests[r].shares is not None and table.shared_tokens(r)],
                "misses": [
                    r for r in chunk.requests if run.requests[r].shares is not None and not table.shared_tokens(r)
                ],
            }
        )
        pool.release(pool.leaving(chunk))
    return {"window": window, "hits": hits, "spec": spec, "page_size": page, "pool_pages": budget, "batches": batches}


# ---------------------------------------------------------------------------------- the drawing


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_one_layer(data: dict[str, Any], out: Path) -> None:
    from matplotlib.patches import FancyBboxPatch

    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.7))
    ax.set_xlim(0, 100)
    ax.set_ylim(1, 37.5)
    ax.axis("off")
    w, h = 16.5, 12
    at = {n["id"]: n for n in data["nodes"]}
    for n in data["nodes"]:
        ax.add_patch(
            FancyBboxPatch(
                (n["x"] - w / 2, n["y"] - h / 2), w, h, boxstyle="round,pad=0.3", fc="#EEF3FA", ec="#4C72B0", lw=1.1
            )
        )
        ax.text(n["x"], n["y"], n["text"], ha="center", va="center", fontsize=8.4, linespacing=1.3)
    for e in data["edges"]:
        a, b = at[e["from"]], at[e["to"]]
        if a["y"] == b["y"]:  # same row: edge to edge
            sign = 1 if b["x"] > a["x"] else -1
            start, end = (a["x"] + sign * w / 2, a["y"]), (b["x"] - sign * w / 2, b["y"])
        elif a["x"] == b["x"]:  # straight down
            start, end = (a["x"], a["y"] - h / 2), (b["x"], b["y"] + h / 2)
        else:  # diagonal from the upper row's bottom to the lower row's top
            start, end = (a["x"] + 3, a["y"] - h / 2), (b["x"] - 3, b["y"] + h / 2)
        ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "-|>", "color": "#333333", "lw": 1.1})
        if e["label"]:
            mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
            ax.text(mx - 1.5, my, e["label"], ha="right", va="center", fontsize=7.6, color="#333333")
    ax.set_title(data["title"], fontsize=10)
    fig.tight_layout()
    figures.save(fig, out, data)
    plt.close(fig)


def draw_splits(data: dict[str, Any], out: Path) -> None:
    from matplotlib.patches import Patch, Rectangle

    plt = _plt()
    rows = data["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.55 * len(rows) + 0.3))
    for ax, row in zip(axes, rows):
        owner = row["rank_of_token"]
        n = len(owner)
        cell = 1.0
        ax.set_xlim(-0.5, n * cell + 0.5)
        ax.set_ylim(-1.7, 1.6)
        ax.axis("off")
        label_every = 1 if n <= 40 else 10
        for t, rank in enumerate(owner):
            ax.add_patch(Rectangle((t * cell, 0), cell, 1, fc=RANK_COLORS[rank], ec="white", lw=0.6 if n <= 40 else 0))
            if t % label_every == 0:
                ax.text(
                    t * cell + cell / 2,
                    -0.35,
                    str(t + row["prefix"]) if n > 40 else str(t),
                    ha="center",
                    va="top",
                    fontsize=6.5 if n <= 40 else 6.5,
                )
        if row["page_size"]:  # page boundaries on absolute positions
            first = -row["prefix"] % row["page_size"]
            for b in range(first, n + 1, row["page_size"]):
                ax.plot([b * cell, b * cell], [-0.1, 1.1], color="black", lw=1.2)
        ax.set_title(row["title"], fontsize=8.5, loc="left")
    handles = [Patch(color=RANK_COLORS[r], label=f"rank {r}") for r in range(max(r["cp_size"] for r in rows))]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    figures.save(fig, out, data)
    plt.close(fig)


def draw_pages(data: dict[str, Any], out: Path) -> None:
    from matplotlib.patches import Patch, Rectangle

    plt = _plt()
    cp, owner, physical = data["cp_size"], data["owner"], data["physical"]
    n = len(owner)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.set_xlim(-4.5, n + 0.5)
    ax.set_ylim(-cp * 1.3 - 0.8, 3.4)
    ax.axis("off")
    ax.text(-0.3, 0.5, "logical\npages", ha="right", va="center", fontsize=8)
    for p in range(n):
        ax.add_patch(Rectangle((p, 0), 1, 1, fc=RANK_COLORS[owner[p]], ec="white", lw=1))
        ax.text(p + 0.5, 0.5, str(p), ha="center", va="center", fontsize=8, color="white")
    for i, (pages, (prefix, extend)) in enumerate(zip(data["requests"], data["tokens"])):
        lo, hi = min(pages), max(pages) + 1
        ax.plot([lo + 0.05, hi - 0.05], [1.25, 1.25], color="black", lw=1)
        ax.text(
            (lo + hi) / 2, 1.45, f"request {i}: {prefix} cached + {extend} new", ha="center", va="bottom", fontsize=7.5
        )
    for rank in range(cp):
        y = -1.5 - rank * 1.3
        ax.text(-0.3, y + 0.5, f"rank {rank}\nphysical", ha="right", va="center", fontsize=8)
        mine = [p for p in range(n) if owner[p] == rank]
        for p in mine:
            x = physical[p]
            ax.add_patch(Rectangle((x, y), 1, 1, fc=RANK_COLORS[rank], ec="white", lw=1))
            ax.text(x + 0.5, y + 0.5, str(p), ha="center", va="center", fontsize=8, color="white")
            ax.text(x + 0.5, y - 0.12, str(x), ha="center", va="top", fontsize=6, color="#555555")
    ax.set_title(
        f"Logical page p is stored on rank p % {cp}, at physical page p // {cp} (page size {data['page_size']} "
        "tokens); numbers in the cells are logical pages, below them physical pages",
        fontsize=8.5,
    )
    ax.legend(
        handles=[Patch(color=RANK_COLORS[r], label=f"rank {r}") for r in range(cp)],
        loc="upper right",
        fontsize=7.5,
        ncol=cp,
        frameon=False,
        bbox_to_anchor=(1, 1.02),
    )
    fig.tight_layout()
    figures.save(fig, out, data)
    plt.close(fig)


def draw_prefetch_timeline(data: dict[str, Any], out: Path) -> None:
    from matplotlib.patches import Rectangle

    plt = _plt()
    layers, pay = data["layers"], data["payload_ms"]
    fig, ax = plt.subplots(figsize=(10, 3.2))
    lanes = {"level 7\nmain stream": 3.0, "level 8\nmain stream": 1.6, "level 8\nside stream": 0.6}
    for name, y in lanes.items():
        ax.text(-0.3, y + 0.3, name, ha="right", va="center", fontsize=8)
    # Level 7: each layer materializes its history on the main stream, before its attention.
    compute7 = data["level7_ms"] - pay
    for layer in range(layers):
        t, before = layer * data["level7_ms"], 0.35 * compute7
        ax.add_patch(Rectangle((t, 3.0), before, 0.6, fc="#4C72B0", ec="white"))
        ax.add_patch(Rectangle((t + before, 3.0), pay, 0.6, fc="#C44E52", ec="white"))
        ax.add_patch(Rectangle((t + before + pay, 3.0), compute7 - before, 0.6, fc="#4C72B0", ec="white"))
        ax.text(
            t + before + pay + (compute7 - before) / 2,
            3.3,
            f"layer {layer}",
            ha="center",
            va="center",
            fontsize=7.5,
            color="white",
        )
    # Level 8: layer 0's history is launched before the loop, layer l + 1's at the start of layer l; the
    # main stream waits for a buffer where the layer reads it (after project, all-gather #1 and the store).
    length, use = data["level8_ms"], 0.35 * data["level8_ms"]
    for layer in range(layers):
        t = layer * length
        ax.add_patch(Rectangle((t, 1.6), length, 0.6, fc="#4C72B0", ec="white"))
        ax.text(
            t + length / 2 + 0.6,
            1.9,
            f"layer {layer}, reads buffer {'AB'[layer % 2]}",
            ha="center",
            va="center",
            fontsize=7.5,
            color="white",
        )
        ax.plot([t + use, t + use], [1.6, 2.2], color="white", lw=1.2)
        start = pay if layer == 1 else (layer - 1) * length if layer else 0.0
        ax.add_patch(Rectangle((start, 0.6), pay, 0.6, fc="#C44E52", ec="white"))
        ax.text(start + pay / 2, 0.47, f"{layer}>{'AB'[layer % 2]}", ha="center", va="top", fontsize=6.5)
        ax.annotate(
            "",
            xy=(t + use, 1.6),
            xytext=(start + pay, 1.2),
            arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 0.8, "linestyle": "--"},
        )
    end = max(layers * data["level7_ms"], layers * data["level8_ms"])
    ax.set_xlim(-3.2, end + 0.3)
    ax.set_ylim(0.1, 3.9)
    ax.set_yticks([])
    ax.set_xlabel("ms")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"Phase 8 to scale: {data['prefix']:,} cached + {data['extend']:,} new tokens, rank 0 of C=8, "
        f"{data['wire_gbps']:g} GB/s wire.\nRed: materializing a layer's history ({pay:.2f} ms; l>A: layer l into "
        f"buffer A); white tick and dashed arrow: the one wait, where the layer reads it (median stall "
        f"{data['stall_ms'] * 1e3:.0f} us)",
        fontsize=8,
    )
    fig.tight_layout()
    figures.save(fig, out, data)
    plt.close(fig)


def draw_v4_hit_eviction(data: dict[str, Any], out: Path) -> None:
    from matplotlib.patches import Patch, Rectangle

    plt = _plt()
    reused, carried, window_c, new_c = "#55A868", "#DD8452", "#F2C49B", "#4C72B0"
    n_hits = len(data["hits"])
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 9.2), gridspec_kw={"height_ratios": [n_hits * 3.2, len(data["batches"]) * 1.5]}
    )
    span, ahead = data["window"] + 8, 8
    lanes = (("csa", "CSA, m = 4"), ("hca", "HCA, m = 128"), ("window", "window tail"))
    for i, hit in enumerate(data["hits"]):
        p = hit["prefix"]
        lo = max(0, p - span)
        base = (n_hits - 1 - i) * 3.6
        top.text(
            -0.01 * span,
            base + 3.0,
            f"hit at P = {p}: P mod 4 = {p % 4}, mod 8 = {p % 8}, mod 128 = {p % 128}",
            fontsize=8,
            ha="left",
            va="bottom",
            transform=top.transData,
        )
        for lane, (kind, label) in enumerate(lanes):
            y = base + 2 - lane * 0.85
            top.text(-2, y + 0.35, label, ha="right", va="center", fontsize=7.5)
            if kind == "window":
                top.add_patch(
                    Rectangle((hit["window_from"] - lo, y), p - hit["window_from"], 0.7, fc=window_c, ec="none")
                )
            else:
                k = hit["kinds"][kind]
                m, start, n = k["ratio"], k["carried_from"], k["entries"]
                for b in range(lo // m, n):  # complete entries in view: reused
                    x0 = max(b * m, lo) - lo
                    top.add_patch(Rectangle((x0, y), (b + 1) * m - lo - x0, 0.7, fc=reused, ec="white", lw=0.4))
                if p > start:  # the carried pre-pool rows: the incomplete block's, and CSA's block before it
                    top.add_patch(Rectangle((start - lo, y), p - start, 0.32, fc=carried, ec="white", lw=0.4))
                entries = f"{n} {'entry' if n == 1 else 'entries'}"
                top.text(
                    p - lo + ahead + 1, y + 0.35, f"{entries} reused, {p - start} rows carried", fontsize=7, va="center"
                )
            top.add_patch(Rectangle((p - lo, y), ahead, 0.7, fc=new_c, ec="none"))
        top.plot([p - lo, p - lo], [base + 0.1, base + 2.8], color="black", lw=0.8)
    top.set_xlim(-0.02 * span, span + ahead + 70)
    top.set_ylim(-0.3, n_hits * 3.6)
    top.axis("off")
    top.legend(
        handles=[
            Patch(
                color=reused, label="complete entries: reused (whole shared pages by reference, the partial page moved)"
            ),
            Patch(color=carried, label="pre-pool rows carried in the checkpoint (the lower band)"),
            Patch(color=window_c, label="raw window rows carried in the checkpoint"),
            Patch(color=new_c, label="new tokens: computed"),
        ],
        loc="upper center",
        ncol=2,
        fontsize=7,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    top.set_title(f"What a hit at P reuses and carries (up to {span} tokens before P; the black line is P)", fontsize=9)
    colors = RANK_COLORS
    n_pages = data["pool_pages"]
    for row, batch in enumerate(data["batches"]):
        y = (len(data["batches"]) - 1 - row) * 1.5
        bottom.text(-0.3, y + 0.45, f"batch {batch['batch']}", ha="right", va="center", fontsize=8)
        for page, holders in enumerate(batch["holders"]):
            if not holders:
                bottom.add_patch(Rectangle((page, y), 1, 0.9, fc="#EEEEEE", ec="white"))
            for k, req in enumerate(holders):
                h = 0.9 / len(holders)
                bottom.add_patch(Rectangle((page, y + k * h), 1, h, fc=colors[req % len(colors)], ec="white"))
                bottom.text(
                    page + 0.5, y + k * h + h / 2, f"r{req}", ha="center", va="center", fontsize=6.5, color="white"
                )
        notes = ", ".join(batch["new"])
        if batch["hits"]:
            notes += "; hit: " + ", ".join(f"r{r}" for r in batch["hits"])
        if batch["misses"]:
            notes += "; miss (source evicted, prefix recomputed): " + ", ".join(f"r{r}" for r in batch["misses"])
        if batch["evicted"]:
            notes += "; evicted: " + ", ".join(f"r{r}" for r in batch["evicted"])
        bottom.text(n_pages + 0.3, y + 0.45, notes, ha="left", va="center", fontsize=7)
    bottom.set_xlim(-1.6, n_pages + 15)
    bottom.set_ylim(-0.2, len(data["batches"]) * 1.5)
    bottom.axis("off")
    bottom.set_title(
        f"A budget of {data['pool_pages']} pages of {data['page_size']} tokens, batches {data['spec']}:\n"
        "each batch's pages and their holders once it has them; an evicted request's state goes with it",
        fontsize=9,
    )
    fig.tight_layout()
    figures.save(fig, out, data)
    plt.close(fig)


DIAGRAMS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any], Path], None]]] = {
    "one_layer.svg": (one_layer_data, draw_one_layer),
    "splits.svg": (splits_data, draw_splits),
    "pages_over_ranks.svg": (pages_data, draw_pages),
    "prefetch_timeline.svg": (prefetch_timeline_data, draw_prefetch_timeline),
    "v4_hit_eviction.svg": (v4_hit_eviction_data, draw_v4_hit_eviction),
}


def stale(out: Path = OUT) -> list[str]:
    """The diagrams under ``out`` whose embedded data differs from what their sources give now."""
    return [
        name
        for name, (data_of, _) in DIAGRAMS.items()
        if not (out / name).is_file() or figures.embedded(out / name) != figures.expected(data_of())
    ]


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser("python3 scripts/draw_diagrams.py", __doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the SVGs")
    parser.add_argument("--check", action="store_true", help="check the committed diagrams instead of drawing them")
    args = parser.parse_args(argv)
    if args.check:
        names = stale(args.out)
        for name in names:
            print(f"{args.out / name} is not what its sources say: python3 scripts/draw_diagrams.py")
        return 1 if names else 0
    output_folder(str(args.out))
    for name, (data_of, draw) in DIAGRAMS.items():
        draw(data_of(), args.out / name)
    print(f"wrote {len(DIAGRAMS)} diagrams to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
