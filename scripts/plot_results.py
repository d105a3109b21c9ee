"""Plot the end-to-end results for the benchmarks page: one rank's layer at every level, and phase 8.

    python3 scripts/plot_results.py [--results docs/results] [--out docs/results]
    python3 scripts/plot_results.py --check      # exit 1 naming each plot that is not what its results say

Reads ``layer_bench.json`` (and ``layer_bench_8k.json``, ``prefetch_bench_*gbps.json``,
``kv_designs_*.json`` where present) and writes SVGs next to them:

* ``layer_bench.svg``: per-layer time by level, measured against the planner, for each
  current-only size; and per-rank memory by level at the largest size (KV at rest, measured peak,
  planner peak);
* ``prefetch.svg``: level 7 against level 8 per-layer time and the payload, for every prefix-heavy
  run, with the hidden share by both measures;
* ``kv_designs.svg``: the competing KV designs per workload (layer time, bytes received per layer) and
  their KV at rest per rank, from ``kv_designs_h200.json`` (measured) or, until it exists,
  ``kv_designs_modeled.json`` (the planner's).
* ``long_context.svg``: one rank's layer time (the last chunk of a chunked prefill) and its
  transient memory against the context, per level, measured beside the planner, from
  ``long_context_h200.json``; the planner alone, labelled modeled, from ``long_context_modeled.json``
  while no GPU run exists.

Each figure is drawn from a data object computed from the results (:func:`layer_data`,
:func:`prefetch_data`, :func:`designs_data`,
:func:`long_context_data`) and carries it (:mod:`reference_impl.figures`), so ``--check`` and the test command
find a plot that was not redrawn after its results changed. The SVGs carry no date and fixed
element ids, so an unchanged input rewrites identical files.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference_impl import figures as figure_data  # noqa: E402
from reference_impl.tool_args import ToolParser, input_folder, output_folder, refusing  # noqa: E402

MIB = 2**20


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def inputs(results: Path) -> dict[str, list[dict[str, Any]]]:
    """The results the plots read: the main ``bench.layer`` run, the 8K run, the slow-wire phase 8 runs."""
    main_doc = _load(results / "layer_bench.json")
    if main_doc is None:
        raise SystemExit(f"no layer_bench.json in {results}")
    extra = [d for d in (_load(results / "layer_bench_8k.json"),) if d]
    prefetch = [d for d in (_load(p) for p in sorted(results.glob("prefetch_bench_*gbps.json"))) if d]
    designs = _load(results / "kv_designs_h200.json") or _load(results / "kv_designs_modeled.json")
    long_context = _load(results / "long_context_h200.json") or _load(results / "long_context_modeled.json")
    return {
        "layer": [main_doc, *extra],
        "prefetch": [main_doc, *prefetch],
        "designs": [designs] if designs else [],
        "long_context": [long_context] if long_context else [],
    }


def current_only(docs: list[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(tokens, level points)`` of every current-only workload, smallest first."""
    found = {
        w["workload"]["extend"]: w["levels"] for doc in docs for w in doc["workloads"] if not w["workload"]["prefix"]
    }
    return sorted(found.items())


def layer_data(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``layer_bench.svg`` draws."""
    sizes = current_only(docs)
    tokens, points = sizes[-1]
    main = docs[0]
    return {
        "sizes": [
            {
                "tokens": t,
                "levels": [p["level"] for p in pts],
                "measured_ms": [p["layer_ms_median"] for p in pts],
                "planner_ms": [p["planner"]["layer_ms"] for p in pts],
            }
            for t, pts in sizes
        ],
        "memory": {
            "tokens": tokens,
            "levels": [p["level"] for p in points],
            "kv_mib": [p["kv_bytes"] / MIB for p in points],
            "peak_mib": [p["measured_peak_bytes"] / MIB for p in points],
            "planner_peak_mib": [p["planner"]["peak_bytes"] / MIB for p in points],
            "n_layers": main["n_layers"],
        },
        "title": (
            f"One {main['device']} playing rank {main['rank']} of C={main['cp_size']} (LoopbackGroup, modeled "
            f"{main['wire_gbps']:g} GB/s wire), {main['preset']}"
        ),
    }


def prefetch_data(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``prefetch.svg`` draws: every prefix-heavy workload with a phase 8 measurement."""
    runs = []
    for doc in docs:
        for w in doc["workloads"]:
            if "prefetch" in w:
                wl, pf = w["workload"], w["prefetch"]
                runs.append(
                    {
                        "label": f"{wl['prefix'] // 1024}K+{wl['extend'] // 1024}K\n{doc['wire_gbps']:g} GB/s",
                        **{
                            k: pf[k]
                            for k in (
                                "level7_ms",
                                "level8_ms",
                                "payload_ms",
                                "hidden_fraction",
                                "hidden_fraction_direct",
                            )
                        },
                    }
                )
    return {"runs": runs}


def draw_layers(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = data["sizes"]
    fig, axes = plt.subplots(1, len(sizes) + 1, figsize=(4 * (len(sizes) + 1), 3.4))
    for ax, size in zip(axes, sizes):
        ax.plot(size["levels"], size["measured_ms"], "o-", label="measured")
        ax.plot(size["levels"], size["planner_ms"], "s--", label="planner")
        ax.set_title(f"{size['tokens']:,} tokens, current-only")
        ax.set_xlabel("phase level")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("ms per layer, rank 0 of C=8")
    axes[0].legend()
    mem, ax = data["memory"], axes[-1]
    ax.plot(mem["levels"], mem["kv_mib"], "o-", label=f"KV at rest ({mem['n_layers']} layers)")
    ax.plot(mem["levels"], mem["peak_mib"], "^-", label="measured peak")
    ax.plot(mem["levels"], mem["planner_peak_mib"], "s--", label="planner peak")
    ax.set_yscale("log")
    ax.set_title(f"memory per rank, {mem['tokens']:,} tokens")
    ax.set_xlabel("phase level")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    fig.suptitle(data["title"], fontsize=9)
    fig.tight_layout()
    figure_data.save(fig, out, data)
    plt.close(fig)


def draw_prefetch(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(2.2 * len(runs) + 2, 3.6))
    x = range(len(runs))
    width = 0.27
    ax.bar([i - width for i in x], [r["level7_ms"] for r in runs], width, label="level 7 (synchronous)")
    ax.bar(list(x), [r["level8_ms"] for r in runs], width, label="level 8 (prefetch)")
    ax.bar([i + width for i in x], [r["payload_ms"] for r in runs], width, label="payload alone")
    for i, r in zip(x, runs):
        ax.annotate(
            f"{r['hidden_fraction']:.0%} / {r['hidden_fraction_direct']:.1%}",
            (i, max(r["level7_ms"], r["level8_ms"])),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(x), [r["label"] for r in runs], fontsize=8)
    ax.set_ylim(0, 1.15 * max(max(r["level7_ms"], r["level8_ms"]) for r in runs))
    ax.set_ylabel("ms per layer, rank 0 of C=8")
    ax.set_title("Phase 8; labels: hidden by layer difference / by the stall at the wait", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    figure_data.save(fig, out, data)
    plt.close(fig)


def designs_data(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``kv_designs.svg`` draws: per workload, each design's layer time and bytes received per layer;
    KV at rest per rank at the last workload."""
    doc = docs[0]
    workloads = doc["workloads"]
    designs = [r["design"] for r in workloads[0]["designs"]]

    def row(w: dict[str, Any], design: str) -> dict[str, Any]:
        return next(r for r in w["designs"] if r["design"] == design)

    return {
        "designs": designs,
        "labels": [f"{w['name']}\n{w['prefix'] // 1024}K+{w['extend'] // 1024}K" for w in workloads],
        "layer_ms": {d: [row(w, d)["layer_ms"] for w in workloads] for d in designs},
        "moved_mib": {d: [row(w, d)["bytes_moved_per_layer"] / MIB for w in workloads] for d in designs},
        "at_rest_gib": [row(workloads[-1], d)["kv_bytes_at_rest"] / 2**30 for d in designs],
        "title": (
            f"KV designs, rank {doc['rank']} of C={doc['cp_size']} "
            f"({'measured' if doc.get('kind') == 'measured' else 'modeled by the planner'})"
        ),
    }


def draw_designs(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    designs, labels = data["designs"], data["labels"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    width = 0.8 / len(designs)
    x = range(len(labels))
    for panel, (key, title) in zip(axes[:2], (("layer_ms", "ms per layer"), ("moved_mib", "MiB received per layer"))):
        for i, design in enumerate(designs):
            panel.bar([j + (i - (len(designs) - 1) / 2) * width for j in x], data[key][design], width, label=design)
        panel.set_xticks(list(x), labels, fontsize=8)
        panel.set_title(title, fontsize=9)
    axes[2].bar(designs, data["at_rest_gib"], color=[f"C{i}" for i in range(len(designs))])
    axes[2].set_title(f"KV at rest per rank, GiB, whole model ({labels[-1].replace(chr(10), ' ')})", fontsize=9)
    axes[2].tick_params(axis="x", labelsize=7, rotation=20)
    axes[0].legend(fontsize=7)
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    figure_data.save(fig, out, data)
    plt.close(fig)


def long_context_data(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``long_context.svg`` draws: per level, the last chunk's layer time and the peak against the
    context, measured (where a GPU run exists) beside the planner."""
    doc = docs[0]
    measured = not doc.get("modeled")
    contexts = [r["context"] for r in doc["runs"]]
    levels = []
    for level in doc["levels"]:
        points = [next(p for p in r["levels"] if p["level"] == level) for r in doc["runs"]]
        levels.append(
            {
                "level": level,
                "measured_ms": [p["last_chunk_layer_ms"] for p in points] if measured else None,
                "measured_peak_gib": [p["measured_peak_bytes"] / 2**30 for p in points] if measured else None,
                "planner_ms": [p["planner"]["last_chunk_layer_ms"] for p in points],
                "planner_peak_gib": [p["planner"]["peak_bytes"] / 2**30 for p in points],
            }
        )
    kind = "measured" if measured else "modeled (planner)"
    return {
        "contexts": contexts,
        "levels": levels,
        "measured": measured,
        "ylabel": f"ms per layer, last chunk, rank {doc['rank']} of C={doc['cp_size']}",
        "title": f"Chunked prefill, {doc['chunk_tokens']:,}-token chunks, {doc['preset']}: {kind}",
    }


def draw_long_context(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts, measured = data["contexts"], data["measured"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6))
    for i, level in enumerate(data["levels"]):
        color, name = f"C{i}", f"level {level['level']}"
        if measured:
            ax_t.plot(contexts, level["measured_ms"], "o-", color=color, label=name)
            ax_m.plot(contexts, level["measured_peak_gib"], "o-", color=color, label=f"{name} measured")
        planner = f"{name} planner" if measured else f"{name} (modeled)"
        ax_t.plot(contexts, level["planner_ms"], "s--", color=color, label=planner)
        ax_m.plot(contexts, level["planner_peak_gib"], "s--", color=color, label=planner)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    ax_t.set_ylabel(data["ylabel"])
    ax_m.set_ylabel("peak memory per rank, GiB")
    fig.suptitle(data["title"], fontsize=9)
    fig.tight_layout()
    figure_data.save(fig, out, data)
    plt.close(fig)


#: file name -> (which inputs, data function, drawing function)
FIGURES: dict[
    str, tuple[str, Callable[[list[dict[str, Any]]], dict[str, Any]], Callable[[dict[str, Any], Path], None]]
] = {
    "layer_bench.svg": ("layer", layer_data, draw_layers),
    "prefetch.svg": ("prefetch", prefetch_data, draw_prefetch),
    "kv_designs.svg": ("designs", designs_data, draw_designs),
    "long_context.svg": ("long_context", long_context_data, draw_long_context),
}


def stale(results: Path, figures: Path) -> list[str]:
    """The figures under ``figures`` whose embedded data differs from what ``results`` gives now."""
    docs = inputs(results)
    return [
        name
        for name, (kind, data_of, _) in FIGURES.items()
        if docs[kind] and figure_data.embedded(figures / name) != figure_data.expected(data_of(docs[kind]))
    ]


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser("python3 scripts/plot_results.py", __doc__.split("\n\n")[0])
    parser.add_argument("--results", default="docs/results", help="folder of the results JSON files")
    parser.add_argument("--out", default=None, help="folder for the SVGs (default: --results)")
    parser.add_argument("--check", action="store_true", help="check the committed plots instead of drawing them")
    args = parser.parse_args(argv)
    results = input_folder(args.results, "--results")
    out = Path(args.out or args.results) if args.check else output_folder(args.out or args.results)
    if args.check:
        names = stale(results, out)
        for name in names:
            print(f"{out / name} is not what its results say: python3 scripts/plot_results.py")
        return 1 if names else 0
    docs = inputs(results)
    drawn = [name for name, (kind, _, _) in FIGURES.items() if docs[kind]]
    for name in drawn:
        kind, data_of, draw = FIGURES[name]
        draw(data_of(docs[kind]), out / name)
    print(f"wrote {', '.join(str(out / n) for n in drawn)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
