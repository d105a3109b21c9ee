"""Paired, interleaved repeats and the rule that calls one variant faster than another.

A benchmark that compares variants (KV designs, our kernel and a production one) runs them
**interleaved**: each repeat runs every variant once, in an order rotated per repeat
(:func:`rotations`: ``ABC``, ``BCA``, ``CAB``, ...) so that no variant always runs first, right after
a warm-up or a cache flush. Repeat ``r`` of variant ``a`` and repeat ``r`` of variant ``b`` then ran
back to back under the same conditions (clocks, temperature, the other tenants of the machine), and
their **paired difference** ``a[r] - b[r]`` cancels the drift that the two medians alone would carry.

**The rule** (:func:`compare`): ``a`` is called faster than ``b`` only when every paired difference
has the same sign, i.e. their min-max range excludes zero. With no true difference each sign is a
coin toss, so ``n`` repeats agree by chance with probability ``2 * 0.5**n`` (a two-sided sign test):
3.1% at the default of 6 repeats, 0.2% at 10. Anything else is **within noise**, whatever the
medians say. Fewer than :data:`MIN_REPEATS` repeats never call a winner (the sign test cannot reach
5%: ``2 * 0.5**4 = 12.5%``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

MIN_REPEATS = 5
"""Fewest paired repeats that can call a variant faster: ``2 * 0.5**5 = 6.25%``, the first count
whose chance agreement is near the 5% a reader expects; six (3.1%) is the benchmarks' default."""
RULE = (
    "faster only when every paired difference has the same sign (their min-max range excludes zero; "
    f"chance agreement 2 x 0.5^n, a sign test) and n >= {MIN_REPEATS} repeats; else within noise"
)
WITHIN_NOISE = "within noise"


def rotations(items: Sequence[T], repeats: int) -> list[list[T]]:
    """The order of ``items`` in each of ``repeats`` repeats: rotated by one per repeat."""
    n = len(items)
    return [[items[(r + i) % n] for i in range(n)] for r in range(repeats)] if n else [[] for _ in range(repeats)]


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles (``statistics.quantiles``, inclusive method; the value itself for one)."""
    if len(values) < 2:
        return float(values[0]), float(values[0])
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"n", "median", "min", "max", "q1", "q3"}`` of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread of no values")
    q1, q3 = quartiles(values)
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "q1": q1,
        "q3": q3,
    }


def chance_agreement(n: int) -> float:
    """Probability that ``n`` paired differences share a sign when neither variant is faster."""
    return 2 * 0.5**n if n else 1.0


def compare(a: str, a_values: Sequence[float], b: str, b_values: Sequence[float]) -> dict[str, Any]:
    """The paired comparison of variants ``a`` and ``b`` (times: lower is faster), repeat by repeat.

    ``difference`` is the spread of ``a[r] - b[r]``; ``ratio`` that of ``a[r] / b[r]``; ``faster``
    names the faster variant under :data:`RULE`, or is ``None``; ``verdict`` says it in words."""
    if len(a_values) != len(b_values) or not a_values:
        raise ValueError(f"paired comparison of {a} and {b} needs the same number of repeats, at least one")
    diffs = [x - y for x, y in zip(a_values, b_values)]
    ratios = [x / y for x, y in zip(a_values, b_values) if y > 0]
    n = len(diffs)
    faster = None
    if n >= MIN_REPEATS:
        if max(diffs) < 0:
            faster = a
        elif min(diffs) > 0:
            faster = b
    return {
        "a": a,
        "b": b,
        "difference": spread(diffs),
        "ratio": spread(ratios) if len(ratios) == n else None,
        "chance_agreement": chance_agreement(n),
        "faster": faster,
        "verdict": f"{faster} faster" if faster else WITHIN_NOISE,
    }


def ranking(medians: dict[str, float], comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The variants by median, each with the verdict against the next one (the last has none)."""
    order = sorted(medians, key=lambda name: medians[name])
    by_pair = {(c["a"], c["b"]): c for c in comparisons}
    out = []
    for i, name in enumerate(order):
        row: dict[str, Any] = {"name": name, "median": medians[name]}
        if i + 1 < len(order):
            nxt = order[i + 1]
            c = by_pair.get((name, nxt)) or by_pair.get((nxt, name))
            row["next"] = nxt
            row["verdict_vs_next"] = c["verdict"] if c else None
        out.append(row)
    return out
