"""Launch-config sweep of the two compute kernels, and the rule that picks their GPU defaults.

``python -m reference_impl.bench.compute --sweep`` times every candidate below at the per-rank
shape (rank 0's zigzag queries of one ``C = 8`` request against all its keys: the shape the engine
runs) before the benchmark's rows; ``scripts/apply_sweep.py`` then writes the pick into the
kernels' ``GPU_DEFAULT_CONFIG``. Both use :func:`pick_attention` / :func:`pick_indexer`, so the
rows of a benchmark are timed with the configuration the engine will run.

A candidate that fails to compile or run (for example, out of shared memory) is recorded with its
error, not fatal; only candidates that pass the reference check can be picked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (BLOCK_H, BLOCK_K, num_warps, num_stages, DEFER_PV, LAZY_RESCALE, WARP_SPECIALIZE, RELOAD_PREV);
# the switches are described in reference_impl/kernels/sparse_mla_triton.py.
ATTN_SWEEP: list[tuple[int, int, int, int, bool, bool, bool, bool]] = [
    (64, 64, 8, 2, False, False, False, False),
    (64, 32, 8, 3, True, False, False, False),
    (64, 32, 8, 3, True, True, False, False),
    (64, 64, 8, 2, False, True, False, False),
    (64, 32, 8, 3, False, False, False, False),
    (64, 64, 16, 2, False, False, False, False),
    (64, 64, 8, 2, False, False, True, False),
    (32, 64, 4, 2, False, False, False, False),
    (64, 64, 8, 2, True, False, False, False),
    (64, 64, 8, 2, True, False, False, True),
    (64, 32, 8, 3, True, False, False, True),
    (64, 64, 8, 1, True, False, False, True),
]
ATTENTION_KEYS = (
    "block_h",
    "block_k",
    "num_warps",
    "num_stages",
    "defer_pv",
    "lazy_rescale",
    "warp_specialize",
    "reload_prev",
)
# (OVERLAP_PV, EVICT_LAST) of the Gluon kernel (sm_90 only), described in
# reference_impl/kernels/sparse_mla_gluon.py.
GLUON_SWEEP: list[tuple[bool, bool]] = [(False, False), (True, False), (False, True)]
GLUON_KEYS = ("overlap_pv", "evict_last")
# (BLOCK_T, BLOCK_S, num_warps, num_stages, dot dtype)
INDEXER_SWEEP: list[tuple[int, int, int, int, str]] = [
    (64, 128, 4, 3, "fp8"),
    (128, 128, 8, 3, "bf16"),
]
INDEXER_KEYS = ("block_t", "block_s", "num_warps", "num_stages", "dot_dtype")
# A candidate replaces the current default only if it is faster by more than this: the sweep's
# run-to-run noise is about 1%, and a default that flips on noise makes measurements incomparable.
MIN_GAIN = 0.01

Row = dict[str, Any]


def attention_config(values: tuple[Any, ...]) -> dict[str, Any]:
    """``ATTN_SWEEP`` tuple (or ``GPU_DEFAULT_CONFIG``) -> the launcher's keyword arguments."""
    return dict(zip(ATTENTION_KEYS, values, strict=True))


def gluon_config(values: tuple[Any, ...]) -> dict[str, Any]:
    """``GLUON_SWEEP`` tuple (or the Gluon ``GPU_DEFAULT_CONFIG``) -> the launcher's keyword arguments."""
    return dict(zip(GLUON_KEYS, values, strict=True))


def indexer_config(values: tuple[Any, ...]) -> dict[str, Any]:
    """``INDEXER_SWEEP`` tuple (or ``GPU_DEFAULT_CONFIG``) -> the launcher's keyword arguments."""
    return dict(zip(INDEXER_KEYS, values, strict=True))


def _passed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if "error" not in r and r["check"]["ok"]]


def _pick(candidates: list[tuple[tuple[Any, ...], float]], current: tuple[Any, ...]) -> tuple[Any, ...]:
    """The fastest of ``(config, rate)`` candidates, unless ``current`` is among them within ``MIN_GAIN``."""
    if not candidates:
        return tuple(current)
    best, best_rate = max(candidates, key=lambda c: c[1])
    incumbent = [rate for config, rate in candidates if config == tuple(current)]
    if incumbent and best_rate <= incumbent[0] * (1 + MIN_GAIN):
        return tuple(current)
    return best


def pick_attention(rows: list[Row], current: tuple[Any, ...]) -> tuple[Any, ...]:
    """The fastest passing attention config, unless ``current`` was measured within ``MIN_GAIN`` of it.

    Rows from a sweep that predates an option read it as off. With no passing row: ``current``.
    """
    as_tuple = lambda row: tuple(row["config"].get(k, False) for k in ATTENTION_KEYS)  # noqa: E731
    return _pick([(as_tuple(r), r["triton_tflops"]) for r in _passed(rows)], current)


def pick_gluon(rows: list[Row], current: tuple[Any, ...]) -> tuple[Any, ...]:
    """The fastest passing Gluon config (rows carry a ``gluon`` entry), by :func:`pick_attention`'s rule."""
    entries = [r["gluon"] for r in rows if "gluon" in r and r["gluon"]["check"]["ok"]]
    return _pick([(tuple(e["config"][k] for k in GLUON_KEYS), e["tflops"]) for e in entries], current)


def pick_indexer(rows: list[Row], current: tuple[Any, ...]) -> tuple[Any, ...]:
    """The passing indexer config with the fastest logits (``current`` if none passed)."""
    passed = _passed(rows)
    if not passed:
        return tuple(current)
    best = min(passed, key=lambda r: r["triton_logits_ms"])["config"]
    return tuple(best[k] for k in INDEXER_KEYS)


def run_sweep(
    time_attention: Callable[[dict[str, Any]], Row],
    time_indexer: Callable[[dict[str, Any]], Row],
    time_gluon: Callable[[dict[str, Any]], Row] | None = None,
) -> tuple[list[Row], list[Row], list[Row]]:
    """Time every candidate with the given section functions -> (attention, indexer, Gluon rows).

    ``time_gluon`` is ``None`` where the Gluon kernel cannot run: its list stays empty.
    """
    out: tuple[list[Row], list[Row], list[Row]] = ([], [], [])
    sections = [
        (out[0], ATTN_SWEEP, attention_config, time_attention, lambda row: row.get("triton_tflops")),
        (out[1], INDEXER_SWEEP, indexer_config, time_indexer, lambda row: row.get("triton_logits_ms")),
    ]
    if time_gluon is not None:
        sections.append((out[2], GLUON_SWEEP, gluon_config, time_gluon, lambda row: row.get("gluon", {}).get("tflops")))
    for rows, table, to_config, timer, metric in sections:
        for values in table:
            config = to_config(values)
            try:
                rows.append(timer(config))
            except Exception as exc:  # a config that fails to compile or run is recorded, not fatal
                rows.append({"config": config, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print("sweep", config, metric(rows[-1]), rows[-1].get("error", ""), flush=True)
    return out
