"""The plan as text: three tables (memory, time, per-layer terms), then the inputs and assumptions."""

from __future__ import annotations

from typing import Any

from reference_impl.planner.plan import GIB


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _rule(n_cells: int) -> str:
    return "|" + " --- |" * n_cells


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text: memory, time and a per-term breakdown (one row per level), then the inputs."""
    inp, levels = plan["inputs"], plan["levels"]
    ctxs = [f"{c:,}" for c in inp["contexts"]]
    lines = [
        (
            f"Capacity plan: {inp['preset']}, C={inp['cp_size']}, {inp['kv_dtype']} KV, page {inp['page_size']}, "
            f"{inp['n_layers']} layers. Scenario: {plan['scenario']}."
        ),
        (
            f"KV budget per GPU: {inp['budget_rule']} = {_gib(inp['kv_budget_bytes'])} GiB. "
            "Every figure is a prediction from the inputs listed at the end."
        ),
        "",
        (
            "Memory per rank (GiB): KV at rest, all layers (* = KV + one layer's transient exceed the budget); "
            "transient of one layer; max context = longest request whose KV fits (tokens)"
        ),
        _row(
            "level", "adds", "status", *(f"KV @ {c}" for c in ctxs), *(f"transient @ {c}" for c in ctxs), "max context"
        ),
        _rule(4 + 2 * len(ctxs)),
    ]
    for lv in levels:
        kv = [_gib(p["kv_bytes_per_rank"]) + ("" if p["fits"] else " *") for p in lv["contexts"]]
        tr = [_gib(p["transient_bytes_per_layer"]) for p in lv["contexts"]]
        lines.append(_row(lv["level"], lv["adds"], lv["status"], *kv, *tr, f"{lv['max_context']:,}"))
    lines += [
        "",
        (
            "Time (ms): one layer on the slowest rank (attention slice + CP data movement); "
            "all-gather #2 (tail) once per forward"
        ),
        _row("level", "status", *(f"layer @ {c}" for c in ctxs), *(f"tail @ {c}" for c in ctxs)),
        _rule(2 + 2 * len(ctxs)),
    ]
    for lv in levels:
        layer = [f"{p['layer_ms']:.2f}" for p in lv["contexts"]]
        tail = [f"{p['tail_ms_per_forward']:.3g}" for p in lv["contexts"]]
        lines.append(_row(lv["level"], lv["status"], *layer, *tail))
    last = inp["contexts"][-1]
    names = list(levels[0]["contexts"][-1]["terms_ms"])
    lines += [
        "",
        f"Per-layer terms at {last:,} tokens (ms, slowest rank)",
        _row("level", *names),
        _rule(1 + len(names)),
    ]
    for lv in levels:
        terms = lv["contexts"][-1]["terms_ms"]
        lines.append(_row(lv["level"], *(f"{terms[n]:.3f}" for n in names)))
    lines += ["", "Inputs (rate = value: source)"]
    lines += [f"  {k} = {v['value']:g}: {v['source']}" for k, v in plan["rates"].items()]
    lines += ["Assumptions"] + [f"  {a}" for a in plan["assumptions"]]
    return "\n".join(lines)
