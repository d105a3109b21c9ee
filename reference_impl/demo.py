"""The main job (``python -m reference_impl demo``, ``bash scripts/main.sh``): every phase level on
this machine's device, and what each level buys.

**On a CUDA machine**, two parts, each figure labeled with how it was made:

1. *Correctness*: every level 0..8 against the single-device oracle at DeepSeek-V3.2 dimensions
   (2 layers, two requests whose prefixes end on page boundaries, so that levels 5-8 check phase 5's
   direct writes; bf16), in one launch. Ranks share the GPU over gloo (C = 2) or, with C GPUs, one
   rank per GPU over NCCL; compared with the oracle by the rounding-tolerant rule of
   :mod:`reference_impl.check`. Each level's row names the store path of this run.
2. *What each level buys, per rank*: rank 0 of C = 8 alone (:class:`~reference_impl.cp.loopback.
   LoopbackGroup`: its own kernels and collectives, the wire modeled at 450 GB/s), bf16, 4 layers,
   one request of a 32K-token cached prefix and 32K new tokens. A warm-up run compiles the
   kernels first; the per-layer time is the median over the run's layers; memory is the rank's KV
   at rest and the measured peak during the prefill. This is a second run, not the checked one: its
   store path is recorded apart (``per_rank_store_path``). Phase 8's prefetch is measured as in
   :mod:`reference_impl.bench.layer` (2 extra alternating level 7 / 8 runs).

**On a CPU machine**: the tiny preset on 4 gloo ranks, every level against the oracle, the ranks'
memory; the times are CPU times (cold, a few hundred tokens) and say nothing about a GPU.

Either way it writes ``demo.json`` and ``demo.png`` (memory and time per level) into one results
folder and names it at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from reference_impl.config import DEVICES, ConfigError, PhaseSet, Request, RunConfig, available_levels, check_choice
from reference_impl.report import device_name, versions
from reference_impl.runner import run_prefills

MIB = 2**20
# The correctness batches: mixed (a cached prefix and new tokens, so phases 3 and 8 have history to
# skip or prefetch), prefixes on page boundaries and at least 2C pages of new tokens per request (up
# to C = 8), so the page-aligned split holds and phase 5 writes directly; any fallback a level takes
# anyway is stated in its row (:func:`fallbacks`).
GPU_CHECK = RunConfig(
    preset="deepseek-v3.2",
    n_layers=2,
    requests=(Request(1024, 2100), Request(64, 1100)),
    page_size=64,
    device="cuda",
)
GPU_WORKLOAD = (32768, 32768)  # cached prefix, new tokens: history to materialize and queries to hide it behind
GPU_WIRE_GBPS = 450.0
GPU_LAYERS = 4  # the timed run's layers
CPU_CHECK = RunConfig(
    preset="tiny",
    cp_size=4,
    requests=(Request(0, 160), Request(48, 130), Request(0, 144)),
    page_size=16,
    device="cpu",
)


def fallbacks(report: dict[str, Any], run: RunConfig, cuda: bool) -> list[str]:
    """What a level's run did other than its phases' fast path, in words (empty: nothing): the full
    tail gather, the token-balanced split, the gathered store instead of direct writes, the torch
    paths of the kernels (on a CPU, or after a kernel failed), the prefetch inline."""
    from reference_impl.engine import build_metadata

    out: list[str] = []
    phases = run.phases
    if phases.narrow_output and report["tail_mode"] != "narrow":
        out.append(f"phase 1: {report['tail_mode']} tail gather")
    aligned = build_metadata(run).page_aligned if phases.page_aligned else False
    if phases.page_aligned and not aligned:
        out.append("phase 4: token-balanced split (a request has fewer than 2C pages)")
    if phases.compute_owner and report["store_path"] != "direct":
        why = "a prefix ends mid-page" if aligned else "the split is not page-aligned"
        out.append(f"phase 5: {report['store_path']} store ({why})")
    if phases.fused_kernels and not cuda:
        out.append("phase 7: torch paths (no CUDA)")
    if phases.prefetch and not cuda:
        out.append("phase 8: inline (no CUDA stream)")
    out.extend(f"{kernel}: torch path ({error})" for kernel, error in report["kernel_fallbacks"].items())
    return out


def _levels_bar(levels: list[int], what: str, progress: bool) -> Any:
    from tqdm import tqdm

    # A bar redraws itself with carriage returns: only on a terminal, never into a log file.
    return tqdm(levels, desc=what, unit="level", disable=not progress or not sys.stderr.isatty(), file=sys.stderr)


def _correctness(base: RunConfig, progress: bool) -> list[dict[str, Any]]:
    levels = available_levels()
    with _levels_bar(levels, "oracle check, every level", progress) as bar:
        reports = run_prefills([base.replace(phases=PhaseSet.level(k)) for k in levels])
        bar.update(len(levels))
    return reports


def _gpu_per_rank(progress: bool) -> dict[str, Any]:
    from reference_impl.bench.layer import Workload, measure

    levels = available_levels()
    prefix, extend = GPU_WORKLOAD
    with _levels_bar(levels, "per-rank time and memory (rank 0 of C=8, warm)", progress) as bar:
        return measure(
            "deepseek-v3.2",
            Workload("mixed", prefix, extend),
            levels,
            cp_size=8,
            rank=0,
            n_layers=GPU_LAYERS,
            device="cuda",
            wire_gbps=GPU_WIRE_GBPS,
            prefetch_repeats=2,
            on_level=lambda level: bar.update(1),
        )


def prepare_out_dir(path: str | Path, name: str = "out_dir") -> Path:
    """The results folder ``path``, created (parents too) and writable, or a :class:`ConfigError`
    naming ``name`` (the argument, or the CLI's ``--out``) before any work starts."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise ConfigError(f"{name}={path!r}: need a folder path")
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{name} {str(path)!r}: exists and is not a folder") from None
    except OSError as exc:
        raise ConfigError(f"{name} {str(path)!r}: cannot create it ({exc.strerror or exc})") from None
    if not out.is_dir():
        raise ConfigError(f"{name} {str(path)!r}: exists and is not a folder")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {str(path)!r}: this user cannot write there")
    return out


def run_demo(device: str = "auto", out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Run the main job on ``device`` (``auto``: CUDA when present) -> the JSON-ready result, also
    written with its plot into ``out_dir`` (default ``results/demo-<device>-<time>``)."""
    check_choice("device", device, DEVICES)
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("demo --device cuda: no CUDA device is visible")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = prepare_out_dir(
        out_dir if out_dir is not None else Path("results") / f"demo-{'cuda' if cuda else 'cpu'}-{stamp}"
    )
    if cuda:
        base = GPU_CHECK.replace(cp_size=max(2, torch.cuda.device_count()))
    else:
        base = CPU_CHECK
    reports = _correctness(base, progress)
    per_rank = _gpu_per_rank(progress) if cuda else None
    levels = []
    for rep in reports:
        r0 = rep["per_rank"][0]
        row: dict[str, Any] = {
            "level": rep["phase_level"],
            "phases": rep["phases"],
            "matches_oracle": rep["matches_oracle"],
            "problems": rep["problems"],
            "store_path": rep["store_path"],
            "fallbacks": fallbacks(rep, base.replace(phases=PhaseSet.level(rep["phase_level"])), cuda),
            "check_kv_at_rest_bytes": r0["kv_bytes"] + r0["index_bytes"],
            "check_transient_peak_bytes": r0["transient_peak_bytes"],
            "check_tail_gather_bytes": r0["output_gather_bytes"],
            "check_layer_ms": r0["layer_ms_median"],
        }
        levels.append(row)
    if per_rank is not None:
        for row, point in zip(levels, per_rank["levels"]):
            if point["store_path"] != "direct" and row["level"] >= 5:
                row["fallbacks"].append(f"per rank: phase 5: {point['store_path']} store")
            row.update(
                {
                    "layer_ms": point["layer_ms_median"],
                    "kv_at_rest_bytes": point["kv_bytes"],
                    "measured_peak_bytes": point["measured_peak_bytes"],
                    "transient_peak_bytes": point["transient_peak_bytes"],
                    "materialized_bytes": point["materialized_bytes"],
                    "per_rank_store_path": point["store_path"],
                }
            )
    result: dict[str, Any] = {
        "command": "python -m reference_impl demo " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["demo"] else []),
        "device": device_name(torch.device("cuda" if cuda else "cpu")),
        "versions": versions(),
        "check": {
            "how": (
                f"{base.cp_size} ranks sharing the GPU over {reports[0]['backend']}"
                if cuda and reports[0]["ranks_share_device"]
                else f"{base.cp_size} ranks over {reports[0]['backend']}"
            ),
            "preset": base.preset,
            "cp_size": base.cp_size,
            "n_layers": base.model.n_layers,
            "requests": [[r.prefix, r.extend] for r in base.requests],
            "compute_dtype": reports[0]["config"]["compute_dtype"],
            "times": "cold: one run per level, kernels compiling in it; not a performance figure",
        },
        "per_rank": None
        if per_rank is None
        else {
            "how": f"rank 0 of C=8 alone (LoopbackGroup), all-gathers as local copies plus a modeled "
            f"{GPU_WIRE_GBPS:g} GB/s wire, bf16, {GPU_LAYERS} layers, after a warm-up run",
            "n_layers": GPU_LAYERS,
            "workload": {"prefix": GPU_WORKLOAD[0], "extend": GPU_WORKLOAD[1]},
            "timing": "CUDA events per layer, median over the run's layers",
            "prefetch": per_rank.get("prefetch"),
        },
        "levels": levels,
        "all_match_oracle": all(r["matches_oracle"] for r in reports),
        "out_dir": str(out),
    }
    result["plot"] = str(plot_demo(result, out / "demo.png"))
    (out / "demo.json").write_text(json.dumps(result, indent=1))
    return result


def demo_figure_data(result: dict[str, Any]) -> dict[str, Any]:
    """What :func:`plot_demo` draws: per level, KV at rest, the peak and the layer time, and the labels."""
    gpu = result["per_rank"] is not None
    kv_key = "kv_at_rest_bytes" if gpu else "check_kv_at_rest_bytes"
    peak_key = "measured_peak_bytes" if gpu else "check_transient_peak_bytes"
    time_key = "layer_ms" if gpu else "check_layer_ms"
    rows = result["levels"]
    return {
        "levels": [row["level"] for row in rows],
        "kv_mib": [row[kv_key] / MIB for row in rows],
        "peak_mib": [(row.get(peak_key) or 0) / MIB for row in rows],
        "layer_ms": [row[time_key] for row in rows],
        "peak_label": "measured peak during the prefill" if gpu else "transient peak (gather + view buffers)",
        "memory_title": "rank 0 of C=8, 4 layers"
        if gpu
        else f"{result['check']['preset']} preset, rank 0 of C={result['check']['cp_size']}",
        "time_title": "warm, rank 0 of C=8, modeled 450 GB/s wire" if gpu else "CPU, cold: not a GPU figure",
        "title": f"{result['device']}: what each phase level buys",
    }


def plot_demo(result: dict[str, Any], path: Path) -> Path:
    """Memory per rank and time per layer, by level (two panels), drawn from :func:`demo_figure_data`,
    which the file carries (:mod:`reference_impl.figures`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reference_impl.figures import save

    data = demo_figure_data(result)
    levels = data["levels"]
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 3.8))
    mem.bar([lv - 0.2 for lv in levels], data["kv_mib"], width=0.4, label="KV at rest")
    mem.bar([lv + 0.2 for lv in levels], data["peak_mib"], width=0.4, label=data["peak_label"])
    mem.set_xlabel("phase level")
    mem.set_ylabel("MiB per rank")
    mem.set_title(data["memory_title"])
    mem.legend(fontsize=8, loc="lower right")
    time.plot(levels, data["layer_ms"], "o-")
    time.set_xlabel("phase level")
    time.set_ylabel("ms per layer")
    time.set_ylim(bottom=0)  # level-to-level differences at their true scale
    time.set_title(data["time_title"])
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    save(fig, path, data, dpi=110)
    plt.close(fig)
    return path


def materialized_per_layer(n_bytes: int, store_path: str, n_layers: int) -> str:
    """Materialized MiB per layer, or ``-`` where nothing is materialized: a replicated store (levels 0-1) reads
    its replica locally, and a sharded store without history gathers no page (docs/glossary.md, Metrics)."""
    return "-" if store_path == "replicated" or not n_bytes else f"{n_bytes / n_layers / MIB:,.1f} MiB"


def format_demo(result: dict[str, Any]) -> str:
    """The demo's table: one row per level, then where the files went."""
    gpu = result["per_rank"] is not None
    check = result["check"]
    lines = [
        f"{result['device']} | oracle check: {check['how']}, {check['preset']} ({check['n_layers']} layers, "
        f"{check['compute_dtype']}), requests {check['requests']}",
    ]
    if gpu:
        pr = result["per_rank"]
        lines.append(
            f"per rank: {pr['how']}; prefix {pr['workload']['prefix']} + {pr['workload']['extend']} new tokens"
        )
        # Two runs: the checked one (its store path beside the verdict) and the timed one (its own store path).
        header = [
            "level",
            "oracle (checked store)",
            "timed store",
            "KV at rest",
            "peak (measured)",
            "materialized / layer",
            "layer ms (warm)",
        ]
        n_layers = pr.get("n_layers", GPU_LAYERS)
        rows = [
            [
                str(r["level"]),
                f"{'match' if r['matches_oracle'] else 'DIFFERS'} ({r['store_path']})",
                r["per_rank_store_path"],
                f"{r['kv_at_rest_bytes'] / MIB:,.1f} MiB",
                f"{(r['measured_peak_bytes'] or 0) / MIB:,.0f} MiB",
                materialized_per_layer(r["materialized_bytes"], r["per_rank_store_path"], n_layers),
                f"{r['layer_ms']:.2f}",
            ]
            for r in result["levels"]
        ]
    else:
        lines.append("times: CPU, cold, a few hundred tokens: they say nothing about a GPU")
        header = ["level", "oracle", "store", "KV at rest", "transient peak", "tail gather", "layer ms (CPU, cold)"]
        rows = [
            [
                str(r["level"]),
                "match" if r["matches_oracle"] else "DIFFERS",
                r["store_path"],
                f"{r['check_kv_at_rest_bytes']:,} B",
                f"{r['check_transient_peak_bytes']:,} B",
                f"{r['check_tail_gather_bytes']:,} B",
                f"{r['check_layer_ms']:.2f}",
            ]
            for r in result["levels"]
        ]
    header.append("fallbacks")
    for row, level in zip(rows, result["levels"]):
        row.append("; ".join(level.get("fallbacks", [])) or "none")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) if i < len(header) - 1 else h for i, (h, w) in enumerate(zip(header, widths))))
    lines.extend(
        "  ".join(c.rjust(w) if i < len(row) - 1 else c for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    )
    prefetch = (result["per_rank"] or {}).get("prefetch")
    if prefetch:
        direct = prefetch["hidden_fraction_direct"]
        lines.append(
            f"phase 8: history payload {prefetch['payload_ms']:.2f} ms per layer; stall at the wait "
            f"{(prefetch['exposed_wait_ms_median'] or 0) * 1e3:.0f} us -> "
            f"{'n/a' if direct is None else f'{direct:.0%}'} hidden (direct measure)"
        )
    for r in result["levels"]:
        for problem in r["problems"][:3]:
            lines.append(f"  ! level {r['level']}: {problem}")
    lines.append(f"results: {result['out_dir']} (demo.json, demo.png)")
    return "\n".join(lines)
