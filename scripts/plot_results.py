"""Plot the end-to-end results for the benchmarks page: one rank's layer at every level, and phase 8.

    python3 scripts/plot_results.py [--results docs/results] [--out docs/results]

Reads ``layer_bench.json`` (and ``layer_bench_8k.json``, ``prefetch_bench_*gbps.json`` where
present) and writes two SVGs next to them:

* ``layer_bench.svg``: per-layer time by level, measured against the planner, for each
  current-only size; and per-rank memory by level at the largest size (KV at rest, measured peak,
  planner peak);
* ``prefetch.svg``: level 7 against level 8 per-layer time and the payload, for every prefix-heavy
  run, with the hidden share by both measures;
* ``long_context.svg``: one rank's layer time (the last chunk of a chunked prefill) and its
  transient memory against the context, per level, measured beside the planner, from
  ``long_context_h200.json``; the planner alone, labelled modeled, from ``long_context_modeled.json``
  while no GPU run exists.

The SVGs carry no date and fixed element ids, so an unchanged input rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def current_only(docs: list[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(tokens, level points)`` of every current-only workload, smallest first."""
    found = {w["workload"]["extend"]: w["levels"] for doc in docs for w in doc["workloads"] if not w["workload"]["prefix"]}
    return sorted(found.items())


def prefetch_runs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, prefetch block)`` of every prefix-heavy workload with a phase 8 measurement."""
    runs = []
    for doc in docs:
        for w in doc["workloads"]:
            if "prefetch" in w:
                wl = w["workload"]
                runs.append((f"{wl['prefix'] // 1024}K+{wl['extend'] // 1024}K\n{doc['wire_gbps']:g} GB/s", w["prefetch"]))
    return runs


def plot_layers(docs: list[dict[str, Any]], out: Path) -> None:
    sizes = current_only(docs)
    fig, axes = plt.subplots(1, len(sizes) + 1, figsize=(4 * (len(sizes) + 1), 3.4))
    for ax, (tokens, points) in zip(axes, sizes):
        levels = [p["level"] for p in points]
        ax.plot(levels, [p["layer_ms_median"] for p in points], "o-", label="measured")
        ax.plot(levels, [p["planner"]["layer_ms"] for p in points], "s--", label="planner")
        ax.set_title(f"{tokens:,} tokens, current-only")
        ax.set_xlabel("phase level")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("ms per layer, rank 0 of C=8")
    axes[0].legend()
    tokens, points = sizes[-1]
    ax = axes[-1]
    levels = [p["level"] for p in points]
    ax.plot(levels, [p["kv_bytes"] / MIB for p in points], "o-", label="KV at rest (4 layers)")
    ax.plot(levels, [p["measured_peak_bytes"] / MIB for p in points], "^-", label="measured peak")
    ax.plot(levels, [p["planner"]["peak_bytes"] / MIB for p in points], "s--", label="planner peak")
    ax.set_yscale("log")
    ax.set_title(f"memory per rank, {tokens:,} tokens")
    ax.set_xlabel("phase level")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    fig.suptitle("One H200 playing rank 0 of C=8 (LoopbackGroup, modeled 450 GB/s wire), DeepSeek-V3.2 dims",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def plot_prefetch(docs: list[dict[str, Any]], out: Path) -> None:
    runs = prefetch_runs(docs)
    fig, ax = plt.subplots(figsize=(2.2 * len(runs) + 2, 3.6))
    x = range(len(runs))
    width = 0.27
    ax.bar([i - width for i in x], [r["level7_ms"] for _, r in runs], width, label="level 7 (synchronous)")
    ax.bar(list(x), [r["level8_ms"] for _, r in runs], width, label="level 8 (prefetch)")
    ax.bar([i + width for i in x], [r["payload_ms"] for _, r in runs], width, label="payload alone")
    for i, (_, r) in zip(x, runs):
        ax.annotate(f"{r['hidden_fraction']:.0%} / {r['hidden_fraction_direct']:.1%}",
                    (i, max(r["level7_ms"], r["level8_ms"])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [label for label, _ in runs], fontsize=8)
    ax.set_ylim(0, 1.15 * max(max(r["level7_ms"], r["level8_ms"]) for _, r in runs))
    ax.set_ylabel("ms per layer, rank 0 of C=8")
    ax.set_title("Phase 8; labels: hidden by layer difference / by the stall at the wait", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def plot_long_context(doc: dict[str, Any], out: Path) -> None:
    """Layer time and transient memory against the context, one line per level (dashed: planner)."""
    measured = not doc.get("modeled")
    contexts = [r["context"] for r in doc["runs"]]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6))
    for i, level in enumerate(doc["levels"]):
        points = [next(p for p in r["levels"] if p["level"] == level) for r in doc["runs"]]
        color = f"C{i}"
        if measured:
            ax_t.plot(contexts, [p["last_chunk_layer_ms"] for p in points], "o-", color=color, label=f"level {level}")
            ax_m.plot(contexts, [p["measured_peak_bytes"] / 2**30 for p in points], "o-", color=color,
                      label=f"level {level} transient")
        ax_t.plot(contexts, [p["planner"]["last_chunk_layer_ms"] for p in points], "s--", color=color,
                  label=f"level {level} planner" if measured else f"level {level} (modeled)")
        ax_m.plot(contexts, [p["planner"]["peak_bytes"] / 2**30 for p in points], "s--", color=color,
                  label=f"level {level} planner" if measured else f"level {level} transient (modeled)")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    ax_t.set_ylabel(f"ms per layer, last chunk, rank {doc['rank']} of C={doc['cp_size']}")
    ax_m.set_ylabel("GiB above the pools, weights and inputs")
    kind = "measured" if measured else "modeled (planner)"
    fig.suptitle(f"Chunked prefill, {doc['chunk_tokens']:,}-token chunks, {doc['preset']}: {kind}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="docs/results")
    parser.add_argument("--out", default=None, help="folder for the SVGs (default: --results)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out or args.results)
    out.mkdir(parents=True, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "dsa-cp"  # fixed element ids
    main_doc = _load(results / "layer_bench.json")
    if main_doc is None:
        raise SystemExit(f"no layer_bench.json in {results}")
    extra = [d for d in (_load(p) for p in [results / "layer_bench_8k.json"]) if d]
    prefetch = [d for d in (_load(p) for p in sorted(results.glob("prefetch_bench_*gbps.json"))) if d]
    plot_layers([main_doc, *extra], out / "layer_bench.svg")
    plot_prefetch([main_doc, *prefetch], out / "prefetch.svg")
    long_context = _load(results / "long_context_h200.json") or _load(results / "long_context_modeled.json")
    if long_context is not None:
        plot_long_context(long_context, out / "long_context.svg")
    print(f"wrote {out / 'layer_bench.svg'}, {out / 'prefetch.svg'} and {out / 'long_context.svg'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
