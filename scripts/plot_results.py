"""Plot the end-to-end results for the benchmarks page: one rank's layer at every level, and phase 8.

    python3 scripts/plot_results.py [--results docs/results] [--out docs/results]

Reads ``layer_bench.json`` (and ``layer_bench_8k.json``, ``prefetch_bench_*gbps.json``,
``kv_designs_*.json`` where present) and writes SVGs next to them:

* ``layer_bench.svg``: per-layer time by level, measured against the planner, for each
  current-only size; and per-rank memory by level at the largest size (KV at rest, measured peak,
  planner peak);
* ``prefetch.svg``: level 7 against level 8 per-layer time and the payload, for every prefix-heavy
  run, with the hidden share by both measures;
* ``kv_designs.svg``: the competing KV designs per workload (layer time, bytes moved per layer) and
  their KV at rest per rank, from ``kv_designs_h200.json`` (measured) or, until it exists,
  ``kv_designs_modeled.json`` (the planner's).

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


def plot_designs(doc: dict[str, Any], out: Path) -> None:
    """Per workload, each KV design's layer time and the bytes it moves per layer; KV at rest per rank."""
    workloads = doc["workloads"]
    designs = [r["design"] for r in workloads[0]["designs"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    width = 0.8 / len(designs)
    x = range(len(workloads))
    labels = [f"{w['name']}\n{w['prefix'] // 1024}K+{w['extend'] // 1024}K" for w in workloads]
    for panel, (key, scale, title) in zip(axes[:2], (("layer_ms", 1, "ms per layer"),
                                                     ("bytes_moved_per_layer", MIB, "MiB moved per layer"))):
        for i, design in enumerate(designs):
            values = [next(r for r in w["designs"] if r["design"] == design)[key] / scale for w in workloads]
            panel.bar([j + (i - (len(designs) - 1) / 2) * width for j in x], values, width, label=design)
        panel.set_xticks(list(x), labels, fontsize=8)
        panel.set_title(title, fontsize=9)
    at_rest = [next(r for r in workloads[-1]["designs"] if r["design"] == d)["kv_bytes_at_rest"] / 2**30 for d in designs]
    axes[2].bar(designs, at_rest, color=[f"C{i}" for i in range(len(designs))])
    axes[2].set_title(f"KV at rest per rank, GiB, whole model ({labels[-1].replace(chr(10), ' ')})", fontsize=9)
    axes[2].tick_params(axis="x", labelsize=7, rotation=20)
    axes[0].legend(fontsize=7)
    kind = "measured" if doc.get("kind") == "measured" else "modeled by the planner"
    fig.suptitle(f"KV designs, rank {doc['rank']} of C={doc['cp_size']} ({kind})", fontsize=10)
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
    designs = _load(results / "kv_designs_h200.json") or _load(results / "kv_designs_modeled.json")
    if designs is not None:
        plot_designs(designs, out / "kv_designs.svg")
    print(f"wrote {out / 'layer_bench.svg'}, {out / 'prefetch.svg'}" + (f" and {out / 'kv_designs.svg'}" if designs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
