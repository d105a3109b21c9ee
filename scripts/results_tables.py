"""Render the benchmark JSON files under docs/results/ as markdown tables (no number typed by hand).

python3 scripts/results_tables.py compute docs/results/compute_bench.json
python3 scripts/results_tables.py kernels docs/results/kernels_bench.json
python3 scripts/results_tables.py layer docs/results/layer_bench.json
python3 scripts/results_tables.py demo docs/results/demo_h200.json
python3 scripts/results_tables.py fused_profile docs/results/fused_kernels_ncu_h200.json
python3 scripts/results_tables.py glm53 docs/results/glm53_bench.json
"""

from __future__ import annotations

import re
import statistics

from reference_impl.bench.compute_sweep import ATTENTION_KEYS, GLUON_KEYS
from reference_impl.errors import ConfigError
from reference_impl.tool_args import ToolParser, choice_arg, input_json, refusing


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _torch_topk_ms(row: dict) -> float | None:
    """torch.topk's time of an indexer row; runs from before the selection kernel had only that one."""
    if "torch_topk_ms" in row:
        return row["torch_topk_ms"]
    return row["topk_ms"] if row.get("topk_selector", "torch") == "torch" else None


def _ok(check: dict | None) -> str:
    return "-" if check is None else "ok" if check["ok"] else "FAIL"


def compute(doc: dict) -> str:
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}, triton {doc['triton']}; timer: {doc['timing']}.",
        (
            f"Command: `{doc['command']}`. bf16 matmul 8192^3 on the same device: "
            f"{doc['bf16_matmul_8192_tflops']:.0f} TFLOPS."
        ),
        "",
        (
            "Engine: the kernel the dispatch runs on this device (the warp-specialized Gluon kernel, `gluon_ws`, "
            "on sm_90); speed-up: torch ms / engine ms."
        ),
        "",
        "| kernel | T queries | S keys | Triton ms | TFLOPS | / 640 | check | Gluon ms | TFLOPS | / 640 | check "
        "| WS Gluon ms | TFLOPS | / 640 | check | engine | torch ms | speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [("sparse MLA", a) for a in doc["attention"]] + [("sparse MLA, rank 0 of C=8", doc["per_rank"]["attention"])]
    for name, a in rows:
        torch_ms = f"{a['torch_ms']:.1f}" if a.get("torch_ms") else "-"
        speed = f"{a['speedup']:.1f}x" if a.get("speedup") else "-"
        g, w = a.get("gluon"), a.get("gluon_ws")
        gluon, ws = (
            f"{x['ms']:.2f} | {x['tflops']:.0f} | {x['fraction_of_flashmla_640']:.0%}" if x else "- | - | -"
            for x in (g, w)
        )
        lines.append(
            f"| {name} | {a['T']} | {a['S']} | {a['triton_ms']:.2f} | {a['triton_tflops']:.0f} | "
            f"{a['fraction_of_flashmla_640']:.0%} | {_ok(a['check'])} | {gluon} | {_ok(g and g['check'])} | "
            f"{ws} | {_ok(w and w['check'])} | {a.get('engine_kernel', 'triton')} | {torch_ms} | {speed} |"
        )
    rows = [("indexer top-k", i) for i in doc["indexer"]] + [
        ("indexer top-k, rank 0 of C=8", doc["per_rank"]["indexer"])
    ]
    lines += [
        "",
        "| kernel | T queries | S keys | Triton ms (logits + top-k) | logits TFLOPS | top-k: `torch.topk` ms "
        "| top-k: selection kernel ms | torch ms | speed-up | check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, i in rows:
        torch_ms = f"{i['torch_ms']:.1f}" if i.get("torch_ms") else "-"
        speed = f"{i['speedup']:.1f}x" if i.get("speedup") else "-"
        lines.append(
            f"| {name} | {i['T']} | {i['S']} | "
            f"{i['triton_ms']:.2f} ({i['triton_logits_ms']:.2f} + {i['topk_ms']:.2f}) | "
            f"{i['logits_tflops']:.0f} | {_ms(_torch_topk_ms(i))} | {_ms(i.get('select_kernel_topk_ms'))} | "
            f"{torch_ms} | {speed} | {'ok' if i['check']['ok'] else 'FAIL'} |"
        )
    sweep = doc.get("sweep")
    if sweep:
        where = sweep.get("what", f"T = {sweep['T']}")
        lines += [
            "",
            f"Sparse MLA launch-config sweep, {where}:",
            "",
            "| BLOCK_H | BLOCK_K | warps | stages | defer PV | lazy rescale | warp specialize | reload prev "
            "| TFLOPS | / 640 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for a in sweep["attention"]:
            cfg = " | ".join(str(a["config"].get(k, "-")) for k in ATTENTION_KEYS)
            rate = (
                f"{a['triton_tflops']:.0f} | {a['fraction_of_flashmla_640']:.0%}"
                if "triton_tflops" in a
                else "error | -"
            )
            lines.append(f"| {cfg} | {rate} |")
        gluon_rows = [r["gluon"] for r in sweep.get("gluon", []) if "gluon" in r]
        if gluon_rows:
            lines += [
                "",
                "Gluon kernel switches, same shape:",
                "",
                "| overlap PV | evict last | TFLOPS | / 640 | check |",
                "| --- | --- | --- | --- | --- |",
            ]
            for g in gluon_rows:
                cfg = " | ".join(str(g["config"][k]) for k in GLUON_KEYS)
                lines.append(f"| {cfg} | {g['tflops']:.0f} | {g['fraction_of_flashmla_640']:.0%} | {_ok(g['check'])} |")
    return "\n".join(lines)


def kernels(doc: dict) -> str:
    copy = doc["copy"]
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}, triton {doc['triton']}; timer: {doc['timing']}.",
        (
            f"Command: `{doc['command']}`. Device copy bandwidth: {copy['gbps']:.0f} GB/s (read + write). "
            f"Bar: {doc['bar']}."
        ),
        "",
        "| op | T | Triton ms | GB/s | / copy | / same-size copy | torch ms | GB/s | speed-up | bytes equal to torch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in doc["kernels"]:
        check = (
            "yes"
            if k["check"].get("bytes_equal", k["check"].get("ok", False))
            else f"no ({k['check'].get('differing_bytes')} B differ)"
        )
        same = k.get("triton_fraction_of_same_size_copy")  # runs before it was measured have none
        lines.append(
            f"| {k['op']} | {k['T']} | {k['triton_ms']:.3f} | {k['triton_gbps']:.0f} | "
            f"{k['triton_fraction_of_copy']:.0%} | {'-' if same is None else f'{same:.0%}'} | "
            f"{k['torch_ms']:.3f} | {k['torch_gbps']:.0f} | {k['speedup']:.1f}x | {check} |"
        )
    if doc.get("sweep"):
        settings = doc["sweep_settings"]
        lines += [
            "",
            f"Launch-config sweep ({', '.join(map(str, settings['tokens']))} tokens; {settings['timing']}; best: "
            f"{settings['best']}). Fractions of copy bandwidth are means over the sweep tokens.",
            "",
            "| kernel | candidates (bytes equal to torch) | default config | / copy | best config | / copy |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, sw in doc["sweep"].items():
            ok = sum(1 for c in sw["candidates"] if c.get("bytes_equal"))
            fmt = lambda c: " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c.items())  # noqa: E731
            default = next(c for c in sw["candidates"] if c["config"] == sw["default"])
            lines.append(
                f"| {name} | {ok}/{len(sw['candidates'])} | {fmt(sw['default'])} | "
                f"{default['mean_fraction_of_copy']:.0%} | "
                f"{fmt(sw['best'])} | {sw['mean_fraction_of_copy']:.0%} |"
            )
    lines += [
        "",
        (
            "| remap (phase 6) | T | sort + searchsorted ms | page-inverse ms | per call | per layer "
            "| per forward (61 layers) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["remap"]:
        lines.append(
            f"| {'equal' if r['equal'] else 'DIFFER'} | {r['T']} | {r['sorted_ms']:.4f} | {r['page_inverse_ms']:.4f} | "
            f"{r['per_call_ratio']:.1f}x | {r['per_layer_ratio']:.1f}x | {r['per_forward_ratio']:.0f}x |"
        )
    return "\n".join(lines)


def fused_profile(doc: dict) -> str:
    """``scripts/profile_fused_kernels.py``: each phase-7 kernel under Nsight Compute next to a copy
    kernel of its bytes (the rows come in pairs: the kernel, then its copy)."""
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}, triton {doc['triton']}, {doc['ncu']}; {doc['what']}.",
        f"Command: `{doc['command']}`.",
        "",
        (
            "| kernel | T | payload MB | µs | payload GB/s | DRAM bytes / payload | DRAM % of peak | occupancy "
            "| copy kernel µs | copy DRAM % of peak | copy time / kernel time |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kernel, copy in zip(doc["rows"][::2], doc["rows"][1::2]):
        us, copy_us = kernel["duration_ns"] / 1e3, copy["duration_ns"] / 1e3
        lines.append(
            f"| {kernel['op']} | {kernel['T']} | {kernel['payload'] / 1e6:.1f} | {us:.1f} | "
            f"{kernel['payload'] / kernel['duration_ns']:.0f} | {kernel['dram_bytes_over_payload']:.2f} | "
            f"{kernel['dram_pct_of_peak']:.0f}% | {kernel['achieved_occupancy_pct']:.0f}% | {copy_us:.1f} | "
            f"{copy['dram_pct_of_peak']:.0f}% | {copy_us / us:.0%} |"
        )
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


#: What a table shows where a metric does not exist (docs/glossary.md#metrics).
NONE = "—"


def per_layer_mib(n_bytes: float, n_layers: int = 1) -> str:
    """``n_bytes`` over ``n_layers`` layers, in MiB per layer (docs/glossary.md#metrics)."""
    return f"{n_bytes / n_layers / 2**20:,.1f}"


def materialized_mib(n_bytes: float, store_path: str | None = None, n_layers: int = 1) -> str:
    """Materialized MiB per layer, or ``—`` where nothing is materialized: a replicated store (levels 0-1) reads
    its replica locally (its ``materialized_bytes`` counts those reads), and a sharded store with no history
    to gather materializes no byte."""
    return NONE if store_path == "replicated" or not n_bytes else per_layer_mib(n_bytes, n_layers)


def layer(doc: dict) -> str:
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}; {doc['preset']}, {doc['n_layers']} layers; "
        f"how CP runs: {doc['how_cp_runs']}; timer: {doc['timing']}.",
        f"Command: `{doc['command']}`.",
    ]
    if doc.get("planner_replanned"):
        lines.append(f"Planner columns: {doc['planner_replanned']}.")
    if not any(w.get("comparisons") for w in doc["workloads"]):
        runs = doc.get("level_repeats", 1)
        lines.append(
            f"Level against level: *{NOT_REMEASURED}*: the levels ran one after another, "
            + ("one run each." if runs == 1 else f"{runs} runs each.")
        )
    for w in doc["workloads"]:
        wl = w["workload"]
        planner = "planner" in w["levels"][0]
        rounds = "run_ms" in w["levels"][0]  # a paired run: each level's per-round times
        split = f", {w['split_mode']} split" if "split_mode" in w else ""
        lines += [
            "",
            f"**{wl['name']}**{split}: one request, {wl['prefix']:,} cached + {wl['extend']:,} new tokens.",
            "",
        ]
        head = (
            "| level | layer time ms | store path | KV at rest MiB | transient MiB | measured peak MiB "
            "| gathered MiB / layer | materialized MiB / layer |"
        )
        rule = "| --- | --- | --- | --- | --- | --- | --- | --- |"
        if rounds:
            head += " rounds ms: median (min-max) |"
            rule += " --- |"
        if planner:
            head += " planner ms (err) | planner peak MiB (err) |"
            rule += " --- | --- |"
        lines += [head, rule]
        for p in w["levels"]:
            row = (
                f"| {p['level']} | {p['layer_ms_median']:.2f} | {p['store_path']} | {_mib(p['kv_bytes'])} | "
                f"{_mib(p['transient_peak_bytes'])} | {_mib(p['measured_peak_bytes'] or 0)} | "
                f"{per_layer_mib(p['gather_bytes'], doc['n_layers'])} | "
                f"{materialized_mib(p['materialized_bytes'], p['store_path'], doc['n_layers'])} |"
            )
            if rounds:
                row += " {median:.2f} ({min:.2f}-{max:.2f}) |".format(**p["run_ms_spread"])
            if planner:
                e, pl = p["planner_error"], p["planner"]
                row += (
                    f" {pl['layer_ms']:.2f} ({e['layer_ms']:+.0%}) | "
                    f"{_mib(pl['peak_bytes'])} ({e.get('peak_bytes', 0):+.0%}) |"
                )
            lines.append(row)
        if w.get("comparisons"):
            lines += ["", *level_comparisons(doc, w)]
        if "prefetch" in w:
            pf = w["prefetch"]
            lines += [
                "",
                f"Phase 8 at {doc['wire_gbps']:g} GB/s, measured apart from the rows above (which are one run "
                f"per level): {pf['repeats']} alternating runs per level, median of "
                f"{pf['samples_per_level']} layers each: level 7 {pf['level7_ms']:.3f} ms, "
                f"level 8 {pf['level8_ms']:.3f} ms per layer; prefetch payload alone {pf['payload_ms']:.3f} ms; "
                "hidden by layer difference: "
                f"**{pf['hidden_fraction']:.0%}**"
                + (
                    f" (paired per repeat: {pf['hidden_fraction_paired']:.0%}); hidden by the stall at the wait "
                    f"(median {pf['exposed_wait_ms_median'] * 1e3:.0f} us): **{pf['hidden_fraction_direct']:.1%}**"
                    if "hidden_fraction_paired" in pf
                    else f"; hidden by the stall at the wait (median {pf['exposed_wait_ms_median'] * 1e3:.0f} us): "
                    f"**{pf['hidden_fraction_direct']:.1%}**"
                    if pf.get("hidden_fraction_direct") is not None
                    else ""
                )
                + ".",
            ]
    return "\n".join(lines)


def demo_timed_layers(per_rank: dict) -> int:
    """The layer count of the main job's timed run: its ``n_layers``, or, in a record from before that field,
    the count its ``how`` states ("..., 4 layers, ...")."""
    if "n_layers" in per_rank:
        return int(per_rank["n_layers"])
    found = re.search(r"(\d+) layers", per_rank["how"])
    if found is None:
        raise ValueError(f"the timed run states no layer count: {per_rank['how']!r}")
    return int(found.group(1))


def demo(doc: dict) -> str:
    """The main job's result (``python -m reference_impl demo``) on a CUDA machine."""
    check, per_rank, versions = doc["check"], doc["per_rank"], doc["versions"]
    wl, pf = per_rank["workload"], per_rank["prefetch"]
    lines = [
        (
            f"Device: {doc['device']}, torch {versions['torch']}, triton {versions['triton']}. "
            f"Command: `{doc['command']}`."
        ),
        f"Oracle check: {check['how']}, {check['preset']}, {check['n_layers']} layers, {check['compute_dtype']}, "
        f"requests (prefix, new) {', '.join(f'({p:,}, {e:,})' for p, e in check['requests'])}. "
        f"Per rank: {per_rank['how']}; {wl['prefix']:,} cached + {wl['extend']:,} new tokens; {per_rank['timing']}.",
        "",
        "| level | oracle check (its store path) | timed run: store path | KV at rest MiB | measured peak MiB "
        "| materialized MiB / layer | layer time ms (warm) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    n_layers = demo_timed_layers(per_rank)
    for row in doc["levels"]:
        lines.append(
            f"| {row['level']} | {'match' if row['matches_oracle'] else 'DIFFERS'} ({row['store_path']}) "
            f"| {row['per_rank_store_path']} | {row['kv_at_rest_bytes'] / 2**20:,.1f} "
            f"| {_mib(row['measured_peak_bytes'])} "
            f"| {materialized_mib(row['materialized_bytes'], row['per_rank_store_path'], n_layers)} "
            f"| {row['layer_ms']:.2f} |"
        )
    lines += [
        "",
        "The oracle check and the timed run are two runs: the oracle column names the store path of the run "
        "that was compared with the oracle; the timed run's store path is the one its memory and time measured.",
    ]
    lines += [
        "",
        f"Phase 8: history payload {pf['payload_ms']:.2f} ms per layer; the main stream stalls "
        f"{pf['exposed_wait_ms_median'] * 1e3:.0f} us at the wait (median), "
        f"{pf['hidden_fraction_direct']:.0%} of the payload hidden.",
    ]
    return "\n".join(lines)


def _level_noise(level: dict) -> float:
    """The spread (max - min) of a level's per-layer times, the first layer left out (it often carries warm-up)."""
    samples = level["layer_ms"][1:] or level["layer_ms"]
    return max(samples) - min(samples)


def run_to_run_spread(doc: dict) -> float:
    """The typical run-to-run spread of a ``bench.layer`` file run with ``--level-repeats``: per level, the
    range of the runs' median layer times over their median; the median of that over the levels."""
    spreads = []
    for w in doc["workloads"]:
        for level in w["levels"]:
            runs = [
                statistics.median(level["layer_ms"][i : i + doc["n_layers"]])
                for i in range(0, len(level["layer_ms"]), doc["n_layers"])
            ]
            spreads.append((max(runs) - min(runs)) / statistics.median(runs))
    return statistics.median(spreads)


def level_change(levels: list[dict], k: int, run_spread: float, workload: dict | None = None) -> str:
    """Level ``k`` against level ``k - 1``: the difference of their median layer times and a verdict. From a
    paired run (``workload`` with ``comparisons``), ``bench.paired``'s verdict over its interleaved rounds; from
    an older run, noise when the difference is smaller than the layer-to-layer spread of either level or than
    ``run_spread`` (a fraction) of the time: with one run per level, the run-to-run spread is taken from a run
    that repeated each level."""
    if k == 0:
        return "-"
    a, b = levels[k - 1], levels[k]
    delta = b["layer_ms_median"] - a["layer_ms_median"]
    c = level_pair(workload, b["level"], a["level"]) if workload is not None else None
    if c is not None:
        verdict = {level_name(b["level"]): "faster", level_name(a["level"]): "slower"}.get(c["faster"], "within noise")
    else:
        noise = max(_level_noise(a), _level_noise(b), run_spread * a["layer_ms_median"])
        verdict = "noise" if abs(delta) < noise else ("slower" if delta > 0 else "faster")
    return f"{delta:+.1f} ({delta / a['layer_ms_median']:+.0%}, {verdict})"


def phases(doc: dict) -> str:
    """What each phase level buys: the planner's capacity per rank (``doc["capacity"]``, a
    ``scripts/capacity_plan.py`` file) beside one rank's measured layer (``doc["layer"]``, a ``bench.layer``
    file) at the largest current-only workload; ``doc["repeats"]``: a ``bench.layer`` file with several runs per
    level, for the run-to-run noise."""
    plan, bench = doc["capacity"]["plan"], doc["layer"]
    run_spread = run_to_run_spread(doc["repeats"])
    work = max((w for w in bench["workloads"] if not w["workload"]["prefix"]), key=lambda w: w["workload"]["extend"])
    tokens, n_layers = work["workload"]["extend"], bench["n_layers"]
    levels = work["levels"]
    inputs = plan["inputs"]
    lines = [
        "| level | adds | KV at rest, GiB | max context, tokens | gathered, MiB per layer "
        "| materialized, MiB per layer | tail wall time, ms | layer time, ms | change, ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, (row, planned) in enumerate(zip(levels, plan["levels"])):
        at = next(c for c in planned["contexts"] if c["context"] == tokens)
        lines.append(
            f"| {row['level']} | {planned['adds']} | {at['kv_bytes_per_rank'] / 2**30:.2f} "
            f"| {planned['max_context']:,} "
            f"| {per_layer_mib(row['gather_bytes'], n_layers)} "
            f"| {materialized_mib(row['materialized_bytes'], row['store_path'], n_layers)} "
            f"| {row['tail_ms']:.1f} | {row['layer_ms_median']:.1f} | {level_change(levels, k, run_spread, work)} |"
        )
    beyond = [
        f"level {levels[k]['level']} ({level_change(levels, k, run_spread, work).split(' ')[0]} ms)"
        for k in range(1, len(levels))
        if not level_change(levels, k, run_spread, work).endswith("noise)")
    ]
    repeats = len(doc["repeats"]["workloads"][0]["levels"][0]["layer_ms"]) // doc["repeats"]["n_layers"]
    paired_run = bool(work.get("comparisons"))
    if paired_run:
        how = (
            f"{work['rounds']} interleaved rounds (each running every level once, the order rotated per round), "
            f"layer time the median over every round's layers. Change: against the level before, the difference "
            f"of the medians; the verdict is paired round by round: {bench['rule']}."
        )
    else:
        how = (
            f"one run per level. Change: against the level before; noise when smaller than the spread between "
            f"either level's layers or than {run_spread:.0%} of the layer, the median spread between runs of a run "
            f"that repeated every level {repeats} times. The levels ran one after another, so these verdicts are "
            f"*{NOT_REMEASURED}*."
        )
    lines += [
        "",
        "Layer time changes beyond noise: "
        + (", ".join(beyond) if beyond else "none")
        + ("" if paired_run else f" ({NOT_REMEASURED})")
        + ".",
        "",
        f"Per rank, {bench['preset']}, one request of {tokens:,} new tokens. KV at rest and max context: the "
        f"planner's arithmetic for all {inputs['n_layers']} layers, KV budget {inputs['budget_rule']}. Gathered (the "
        f"padded buffers of all-gather #1 and materialize), materialized ({NONE}: nothing is; levels 0-1 read a local "
        f"replica), tail wall time (once per forward, host clock to a device sync, so it holds layer work still "
        f"queued; not the collective alone) and layer time, as the glossary defines them: rank {bench['rank']} of "
        f"C={bench['cp_size']} on an {bench['device']} alone in one process with a modeled {bench['wire_gbps']:g} GB/s "
        f"wire, {n_layers} layers, {how}",
    ]
    return "\n".join(lines)


def pd_stream(doc: dict) -> str:
    """``bench/pd_stream.py``: the layer-wise send against the prefill, per workload."""
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}; {doc['preset']}, {doc['n_layers']} layers; "
        f"how CP runs: {doc['how_cp_runs']}; wire: {doc['wire']}; timer: {doc['timing']}.",
        f"Command: `{doc['command']}`.",
        "",
        "| workload | layer ms, no send | layer ms, streamed | added per layer, paired ms | MiB sent per layer "
        "| staging ms per layer (GB/s) | staged before the loop ended | last block after the loop, ms "
        "| completion wait, ms | received = rows at rest |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in doc["workloads"]:
        wl = w["workload"]
        staging = (
            "-" if w["staging_ms_per_layer"] is None else f"{w['staging_ms_per_layer']:.3f} ({w['staging_gbps']:.1f})"
        )
        hidden = "-" if w["hidden_fraction"] is None else f"{w['hidden_fraction']:.0%}"
        exposed = "-" if w["exposed_after_loop_ms"] is None else f"{w['exposed_after_loop_ms']:.3f}"
        lines.append(
            f"| {wl['name']} ({wl['prefix']:,} + {wl['extend']:,}) | {w['layer_ms_plain']:.2f} "
            f"| {w['layer_ms_streamed']:.2f} | {w['layer_ms_added_paired']:+.3f} "
            f"| {w['bytes_sent_per_layer'] / 2**20:.1f} | {staging} | {hidden} | {exposed} "
            f"| {w['completion_wait_ms']:.3f} | {w['received_equal_rows_at_rest']} |"
        )
    return "\n".join(lines)


def kv_designs(doc: dict) -> str:
    """``bench/designs.py`` (measured) or ``planner/designs.py`` (modeled): one row per workload and design."""
    measured = doc.get("kind") == "measured"
    if measured:
        head = (
            f"Measured on {doc['device']}, torch {doc['torch']}; {doc['preset']}, {doc['n_layers']} layers run; "
            f"how CP runs: {doc['how_cp_runs']}; timer: {doc['timing']}; min-max: every layer of every timed run. "
            f"Command: `{doc['command']}`. Shared VMM is the planner's row "
            "(modeled; peer reads assumed at the wire's rate), its time in the planner column."
        )
    else:
        head = (
            f"**Modeled** by the planner, nothing ran: {doc['preset']}, rank {doc['rank']} of C={doc['cp_size']}, "
            f"{doc['n_layers']} layers, wire {doc['wire_gbps']:g} GB/s (assumed), shared VMM peer reads "
            f"{doc['peer_gbps']:g} GB/s (assumed), kernel rates from `docs/results`. Command: `{doc['source']}`."
        )
    lines = [
        head,
        "",
        "| workload | design | layer ms |"
        + (" min-max ms |" if measured else "")
        + " KV at rest per rank, GiB (whole model) | received MiB / layer | of it history "
        "| materialized MiB / layer | collectives / layer | host syncs / layer | peak MiB |"
        + (" planner ms |" if measured else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if measured else ""),
    ]
    for w in doc["workloads"]:
        for r in w["designs"]:
            modeled = "" if r["status"] == "measured" or not measured else " (modeled)"
            at_rest = r["kv_bytes_at_rest"]
            if modeled:  # the planner's row covers the layers run: scale it to the whole model as the measured rows are
                at_rest = at_rest * doc["model_layers"] // doc["n_layers"]
            peak = "-" if r.get("peak_bytes") is None else _mib(r["peak_bytes"])
            spread = ""
            if measured:
                samples = r.get("layer_ms_all") or []
                spread = f"| {min(samples):.2f}-{max(samples):.2f} " if samples else "| - "
            shown_ms = "-" if modeled else f"{r['layer_ms']:.2f}"  # a modeled time goes in the planner column only
            row = (
                f"| {w['name']} {w['prefix']:,}+{w['extend']:,} | {r['design']}{modeled} | {shown_ms} {spread}"
                f"| {at_rest / 2**30:.2f} | {_mib(r['bytes_moved_per_layer'])} "
                f"| {_mib(r['history_bytes_moved_per_layer'])} "
                f"| {materialized_mib(r['bytes_materialized_per_layer'])} "
                f"| {r['collectives_per_layer']:g} | {r['host_syncs_per_layer']:g} | {peak} |"
            )
            if measured:
                planned = r["planner"]["layer_ms"] if "planner" in r else r["layer_ms"] if modeled else None
                row += f" {planned:.2f} |" if planned is not None else " - |"
            lines.append(row)
    return "\n".join(lines)


NOT_REMEASURED = "not re-measured with paired repeats"


def _pair(workload: dict, a: str, b: str) -> dict | None:
    """The paired comparison of designs ``a`` and ``b`` in one workload, oriented ``a - b``; None where the
    workload has none (a results file from before the paired protocol, or a design not run)."""
    for c in workload.get("comparisons") or []:
        if (c["a"], c["b"]) == (a, b):
            return c
        if (c["a"], c["b"]) == (b, a):
            d = c["difference"]
            flipped = {**d, "median": -d["median"], "min": -d["max"], "max": -d["min"], "q1": -d["q3"], "q3": -d["q1"]}
            return {**c, "a": a, "b": b, "difference": flipped}
    return None


def design_verdict(doc: dict, a: str, b: str, prefix: int | None = None, extend: int | None = None) -> str:
    """The verdict of design ``a`` against ``b`` (``bench.paired``'s rule) in the workload with ``prefix`` and
    ``extend`` tokens, or over every workload when neither is given: "within noise", "X faster", "X faster
    at ..., within noise at ..." or, for a results file from before the paired protocol, that it was not
    re-measured."""
    chosen = [
        w
        for w in doc["workloads"]
        if (prefix is None or w["prefix"] == prefix) and (extend is None or w["extend"] == extend)
    ]
    if not chosen:
        raise LookupError(f"no workload with prefix {prefix} and extend {extend}")
    verdicts = {}
    for w in chosen:
        c = _pair(w, a, b)
        verdicts[f"{w['prefix']:,}+{w['extend']:,}"] = c["verdict"] if c else NOT_REMEASURED
    if len(set(verdicts.values())) == 1:
        (only,) = set(verdicts.values())
        return only + (" at every workload" if len(verdicts) > 1 and only != NOT_REMEASURED else "")
    return ", ".join(f"{v} at {k}" for k, v in verdicts.items())


def level_name(level: int) -> str:
    """A level as ``bench.layer`` names it in its comparisons (``reference_impl.bench.layer.level_name``)."""
    return f"level {level}"


def _level_workload(doc: dict, prefix: int, extend: int, split_mode: str | None = None) -> dict:
    """The one ``bench.layer`` workload of ``prefix`` cached + ``extend`` new tokens (and ``split_mode``)."""
    hits = [
        w
        for w in doc["workloads"]
        if (w["workload"]["prefix"], w["workload"]["extend"]) == (prefix, extend)
        and (split_mode is None or w.get("split_mode", "in-seq") == split_mode)
    ]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} workloads with prefix {prefix} and extend {extend}, need exactly one")
    return hits[0]


def level_pair(workload: dict, a: int, b: int) -> dict | None:
    """``bench.layer``'s paired comparison of level ``a`` against level ``b`` in one workload, oriented ``a - b``;
    None for a results file from before the paired protocol. A paired file without this pair raises: the
    benchmark records the pairs the pages draw (``reference_impl.bench.layer.level_pairs``), and a page asking
    for another would otherwise read as not re-measured."""
    c = _pair(workload, level_name(a), level_name(b))
    if c is None and workload.get("comparisons"):
        raise LookupError(f"the run compared no level {a} with level {b} (see bench.layer.level_pairs)")
    return c


def level_verdict(doc: dict, prefix: int, extend: int, a: int, b: int, split_mode: str | None = None) -> str:
    """The verdict of level ``a`` against level ``b`` (``bench.paired``'s rule) in the ``bench.layer`` workload of
    ``prefix`` cached + ``extend`` new tokens: "level A faster", "level B faster", "within noise", or, for a results
    file from before the paired protocol, that it was not re-measured."""
    c = level_pair(_level_workload(doc, prefix, extend, split_mode), a, b)
    return NOT_REMEASURED if c is None else c["verdict"]


def level_comparisons(doc: dict, workload: dict) -> list[str]:
    """The lines under a paired ``bench.layer`` workload's table: its comparisons, round by round."""
    lines = [
        f"Paired over {workload['rounds']} interleaved rounds (each round runs every level once, the order rotated "
        f"per round); difference: the first level's run time minus the second's in the same round, per layer, ms. "
        f"Verdict: {doc['rule']}.",
        "",
        "| levels | paired difference, ms: median (min-max) | verdict |",
        "| --- | --- | --- |",
    ]
    for c in workload["comparisons"]:
        diff = "{median:+.2f} ({min:+.2f} to {max:+.2f})".format(**c["difference"])
        lines.append(f"| {c['a']} against {c['b']} | {diff} | {c['verdict']} |")
    return lines


def kv_design_verdicts(doc: dict) -> str:
    """``bench/designs.py``: per workload, each design against the phases, repeat by repeat (``bench.paired``)."""
    paired_run = any(w.get("comparisons") for w in doc["workloads"])
    if paired_run:
        head = (
            f"Paired over {doc['repeats']} interleaved rounds (each round runs every design once, the order rotated "
            f"per round); difference: the design's run time minus the phases' in the same round, per layer, ms. "
            f"Verdict: {doc['rule']}."
        )
    else:
        head = (
            f"The committed results predate the paired protocol: {doc['repeats']} run(s) per design, one design "
            "after another, no round in which they ran side by side. Their medians are not ranked here: every "
            f"comparison reads *{NOT_REMEASURED}* until the benchmark runs again."
        )
    lines = [
        head,
        "",
        "| workload | design against phases | paired difference, ms: median (min-max) | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for w in doc["workloads"]:
        names = {r["design"] for r in w["designs"] if r.get("status") == "measured"}
        for design in ("layer-split", "rotated-shard", "dcp-gather"):
            if design not in names or "phases" not in names:
                continue
            c = _pair(w, design, "phases")
            diff = "-" if c is None else "{median:+.2f} ({min:+.2f} to {max:+.2f})".format(**c["difference"])
            verdict = NOT_REMEASURED if c is None else c["verdict"]
            lines.append(f"| {w['name']} {w['prefix']:,}+{w['extend']:,} | {design} | {diff} | {verdict} |")
    return "\n".join(lines)


def kv_capacity(doc: dict) -> str:
    """The longest request each design's KV fits in the planner's budget (``capacity`` of the modeled results)."""
    lines = [
        f"| design | max context per request, {doc['kv_budget_gib']:g} GiB of KV per GPU, C={doc['cp_size']} |",
        "| --- | --- |",
    ]
    lines += [f"| {c['design']} | {c['max_context']:,} |" for c in doc["capacity"]]
    return "\n".join(lines)


def pd_mooncake(doc: dict) -> str:
    """``bench/pd_mooncake.py``: the layer time per variant, then the Mooncake network leg per decode pool."""
    mc = doc["mooncake"]
    lines = [
        f"Device: {doc['device']}, torch {doc['torch']}; {doc['preset']}, {doc['n_layers']} layers, level "
        f"{doc['workloads'][0]['level']}; how CP runs: {doc['how_cp_runs']}; timer: {doc['timing']}. Mooncake: "
        f"`{mc['distribution']}`, protocol `{mc['protocol']}`. Command: `{doc['command']}`.",
        "",
        "| workload | layer ms, prefill alone | + torch send | + Mooncake, host pool | + Mooncake, GPU pool "
        "| added per layer, paired ms: torch / host / GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for w in doc["workloads"]:
        wl, ms, add = w["workload"], w["layer_ms"], w["added_paired_ms"]
        added = " / ".join(f"{add[v]:+.3f}" if v in add else "-" for v in ("torch", "mooncake_host", "mooncake_gpu"))
        lines.append(
            f"| {wl['name']} ({wl['prefix']:,} + {wl['extend']:,}) | {ms['plain']:.2f} | {_ms(ms.get('torch'))} "
            f"| {_ms(ms.get('mooncake_host'))} | {_ms(ms.get('mooncake_gpu'))} | {added} |"
        )
    lines += [
        "",
        "| workload | decode pool | MiB per layer | pieces per layer | network ms per layer | GB/s "
        "| ended before the loop did | last write after the loop, ms | completion after the loop, ms "
        "| decode's wait after the prefill returned, ms | decode rows = rows at rest |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in doc["workloads"]:
        for variant, pool in (("mooncake_host", "host"), ("mooncake_gpu", "GPU")):
            m = w.get(variant)
            if m is None:
                continue
            lines.append(
                f"| {w['workload']['name']} | {pool} | {m['bytes_per_layer'] / 2**20:.1f} "
                f"| {m['pieces_per_layer']:.0f} "
                f"| {m['network_ms_per_layer']:.1f} | {m['network_gbps']:.2f} | {m['network_hidden_fraction']:.0%} "
                f"| {m['last_write_after_loop_ms']:.1f} | {m['completion_after_loop_ms']:.1f} "
                f"| {m['wait_after_prefill_ms']:.1f} | {m['received_equal_rows_at_rest']} |"
            )
    return "\n".join(lines)


def v4(doc: dict) -> str:
    """``bench/v4.py``: per workload and level, layer time by type, peak, bytes at rest by part, bytes moved;
    the planner's layer times beside where it modeled the same workload (one chunk, no prefix)."""
    types = doc["layer_types"]
    count = {t: types.count(t) for t in set(types)}
    lines = [
        f"Measured on {doc['device']}, torch {doc['torch']}; {doc['preset']}, the first {doc['n_layers']} layers "
        f"({', '.join(types)}); how CP runs: {doc['how_cp_runs']}; timer: {doc['timing']}. "
        f"Command: `{doc['command']}`.",
        "",
        "| workload | level | sliding ms, each layer | CSA ms | HCA ms | planner ms: sliding / CSA / HCA | peak GiB "
        "| CSA at rest, MiB per layer | HCA at rest, MiB per layer | window + state, KiB (all layers) "
        "| gathered MiB (all layers) | of it materialized |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in doc["workloads"]:
        wl = w["workload"]
        same = w.get("planner") is not None and wl["prefix"] == 0  # the planner models one chunk from position 0
        for p in w["levels"]:
            t = {
                k: " / ".join(f"{ms:.2f}" for ms, kind in zip(p["layer_ms"], types) if kind == k) or "-"
                for k in ("sliding", "csa", "hca")
            }
            planned = "-"
            if same:
                point = next(q for q in w["planner"]["points"] if q["level"] == p["level"])
                planned = " / ".join(f"{point['layer_ms'][k]:.1f}" for k in ("sliding", "csa", "hca"))
            peak = "-" if p["measured_peak_bytes"] is None else f"{p['measured_peak_bytes'] / 2**30:.2f}"
            lines.append(
                f"| {wl['name']} ({wl['prefix']:,} + {wl['extend']:,}) | {p['level']} | {t['sliding']} "
                f"| {t['csa']} | {t['hca']} | {planned} | {peak} "
                f"| {p['csa_bytes'] / count.get('csa', 1) / 2**20:.1f} "
                f"| {p['hca_bytes'] / count.get('hca', 1) / 2**20:.1f} "
                f"| {(p['window_bytes'] + p['compressor_state_bytes']) / 2**10:,.0f} "
                f"| {p['gather_bytes'] / 2**20:.1f} | {p['materialized_bytes'] / 2**20:.1f} |"
            )
    return "\n".join(lines)


def _ms_spread(side: dict) -> str:
    spread = side["spread"]
    return f"{side['ms']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"


def anchors(doc: dict | None) -> str:
    """``bench/anchors.py``: per case, ours and the production kernel side by side, or where the
    results file does not exist yet, a line that says so (``doc`` ``None``)."""
    if doc is None:
        return (
            "**Not measured on the H200 yet**: no `docs/results/anchors_h200.json`. Until it exists, this "
            "site's kernels are compared with the figures their authors published (the table above, marked "
            "published), not with the production kernels run beside them."
        )
    if doc.get("kind") != "measured":
        return f"A {doc.get('kind', 'unknown')} run (its numbers mean nothing): `{doc['command']}`."
    avail = "; ".join(
        f"{name} at `{rec['pin']['commit'][:7]}`: "
        + ("imported" + (f" ({rec['version']})" if rec.get("version") else "") if rec["available"] else rec["why"])
        for name, rec in doc["anchors"].items()
    )
    lines = [
        f"Measured on {doc['device']}, torch {doc['torch']}, CUDA {doc['cuda']}; anchors: {avail}. "
        f"Timing: {doc['timing']}; ms columns: median (min-max) over the rounds. Verdict: {doc['rule']}. "
        f"Command: `{doc['command']}`.",
        "",
        "| case | T x S, heads, top-k | ours: kernel, ms, TFLOPS | theirs: kernel, ms, TFLOPS "
        "| ours / theirs, paired (min-max) | verdict | outputs agree |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["cases"]:
        if "error" in row:
            lines.append(f"| {row['case']} | - | error: {row['error'][:120]} | - | - | - | - |")
            continue
        shape, ours, theirs = row["shape"], row["ours"], row["theirs"]
        size = f"{shape['T']:,} x {shape['S']:,}, {shape['heads']}, {shape['topk']:,}"
        ours_cell = f"{ours['kernel']}, {_ms_spread(ours)}, {ours['tflops']:.0f}"
        if "ms" in theirs:
            theirs_cell = f"`{theirs['kernel']}`, {_ms_spread(theirs)}, {theirs['tflops']:.0f}"
            ratio = row["comparison"]["ratio"]
            ratio_cell = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
            verdict = row["comparison"]["verdict"]
        else:
            theirs_cell = f"not run: {theirs['why'][:120]}"
            ratio_cell, verdict = "-", "-"
            pub = row.get("published")
            if pub is not None:
                theirs_cell += (
                    f"; **published** {pub['published_tflops']:g} TFLOPS ({pub['hardware']}, {pub['source']}), "
                    f"not measured here: ours at {pub.get('ours_fraction', 0):.0%} of it"
                )
        check = row.get("check")
        agree = "-" if check is None else ("yes" if check["ok"] else "**no**")
        lines.append(f"| {row['case']} | {size} | {ours_cell} | {theirs_cell} | {ratio_cell} | {verdict} | {agree} |")
    return "\n".join(lines)


def glm53(doc: dict) -> str:
    """``bench.glm53``: per workload and level, the KDA and indexed layer times (median, min-max), the state-map
    all-gather (a local copy on one device) and compose with the modeled wire beside, bytes at rest per layer."""
    lines = [
        f"Measured on {doc['device']}, torch {doc['torch']}; {doc['preset']}; how CP runs: {doc['how_cp_runs']}; "
        f"timer: {doc['timing']}. Command: `{doc['command']}`.",
        "",
        "| workload | level | KDA layer ms (min-max) | indexed layer ms (min-max) | map all-gather, local copy ms "
        "| compose ms | maps received, MiB | modeled wire ms | KDA at rest, MiB per layer "
        "| indexed at rest, MiB per layer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ms(t: dict) -> str:
        return f"{t['median_ms']:.2f} ({t['min_ms']:.2f}-{t['max_ms']:.2f})"

    for w in doc["workloads"]:
        wl = w["workload"]
        for p in w["levels"]:
            ex, rest = p["kda_state_exchange"], p["bytes_at_rest_per_layer"]
            lines.append(
                f"| {wl['name']} ({wl['prefix']:,} + {wl['extend']:,}) | {p['level']} | {ms(p['layer_ms']['kda'])} "
                f"| {ms(p['layer_ms']['indexed'])} | {ex['all_gather_local_copy']['median_ms']:.3f} "
                f"| {ex['compose']['median_ms']:.3f} | {ex['received_bytes'] / 2**20:.1f} "
                f"| {ex['modeled_wire_ms']:.3f} "
                f"| {rest['kda'] / 2**20:.2f} | {rest['indexed'] / 2**20:.1f} |"
            )
    return "\n".join(lines)


PROG = "python3 scripts/results_tables.py"


@refusing
def main(argv: list[str] | None = None) -> int:
    tables = {
        "compute": compute,
        "kernels": kernels,
        "layer": layer,
        "demo": demo,
        "fused_profile": fused_profile,
        "glm53": glm53,
    }
    parser = ToolParser(PROG, __doc__.splitlines()[0])
    parser.add_argument("kind", type=choice_arg(tuple(tables), "table"), help=", ".join(tables))
    parser.add_argument("path", help="the benchmark's results JSON")
    args = parser.parse_args(argv)
    doc = input_json(args.path, "path")
    try:
        print(tables[args.kind](doc))
    except (KeyError, TypeError, IndexError) as exc:  # a field the table reads is missing or of another kind
        raise ConfigError(f"path {args.path!r}: not a {args.kind} results file ({type(exc).__name__}: {exc})") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
