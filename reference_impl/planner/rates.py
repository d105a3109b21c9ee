"""Planner inputs: the measured rates the time model divides by, and where each one comes from.

:class:`PlannerRates` holds every rate with a built-in H200 default; :func:`load_rates` replaces the
defaults with the values in ``docs/results/compute_bench.json``, ``kernels_bench.json``,
``elementwise_rate.json``, ``glue_h200.json`` and ``topk_select_h200.json`` (where they exist), then
with each ``--rates`` file in order. ``sources`` records each value's origin: a
JSON path, a built-in copy, a file given on the command line, or an assumption (the interconnect).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference_impl.config import ConfigError

RESULTS_DIR = Path(__file__).resolve().parent.parent.parent / "docs" / "results"

_COMPUTE, _KERNELS, _ELEMENTWISE, _GLUE = (
    "compute_bench.json",
    "kernels_bench.json",
    "elementwise_rate.json",
    "glue_h200.json",
)
_TOPK = "topk_select_h200.json"  # a bench.compute run after the top-k selection kernel became the default
# Where each measured rate lives in the benchmark JSONs. "list[k=v,T=max]" picks, among the list's
# entries with k == v, the one with the largest T (the longest measured sequence); any key can be
# the maximized one ("tokens=max").
_RATE_PATHS: dict[str, tuple[str, str]] = {
    "attention_tflops": (_COMPUTE, "per_rank.attention.engine_tflops"),  # the kernel the engine runs
    "indexer_logits_tflops": (_COMPUTE, "per_rank.indexer.logits_tflops"),
    # The top-k of the selector the engine runs (the selection kernel by default).
    "topk_ms": (_TOPK, "compute_bench.per_rank.indexer.topk_ms"),
    "topk_ref_queries": (_TOPK, "compute_bench.per_rank.indexer.T"),
    "topk_ref_keys": (_TOPK, "compute_bench.per_rank.indexer.S"),
    "matmul_tflops": (_COMPUTE, "bf16_matmul_8192_tflops"),
    "copy_gbps": (_KERNELS, "copy.gbps"),
    **{
        f"{op}_{impl}_gbps": (_KERNELS, f"kernels[op={bench_op},T=max].{bench_impl}_gbps")
        for op, bench_op in (
            ("store_mla_fp8", "store_mla_fp8"),
            ("store_mla_bf16", "store_mla_bf16"),
            ("store_index", "store_index"),
            ("rerange_kv", "rerange_kv"),
            ("rerange_index", "rerange_index"),
            ("materialize", "materialize_fp8"),
        )
        for impl, bench_impl in (("torch", "torch"), ("fused", "triton"))
    },
    "remap_sort_ms": (_KERNELS, "remap[T=max].sorted_ms"),
    "remap_page_inverse_ms": (_KERNELS, "remap[T=max].page_inverse_ms"),
    "remap_ref_tokens": (_KERNELS, "remap[T=max].T"),
    "elementwise_us_per_token": (_ELEMENTWISE, "elementwise_us_per_token"),
    "fill_current_fused_gbps": (_GLUE, "bench.rows[op=fill_current,tokens=max].kernel_gbps"),
}
# Rates a second kind of file holds too: a bench.compute run times the default top-k selector as
# well (a topk_select_h200.json, loaded after it, holds the run the defaults come from).
_ALSO_IN: dict[str, dict[str, str]] = {
    _COMPUTE: {
        "topk_ms": "per_rank.indexer.topk_ms",
        "topk_ref_queries": "per_rank.indexer.T",
        "topk_ref_keys": "per_rank.indexer.S",
    },
}
_ASSUMED = {
    "interconnect_gbps": "assumption: NVLink 4, 450 GB/s per direction per GPU (peak, not measured; "
    "NCCL all-gathers reach less)",
}


@dataclass(frozen=True)
class PlannerRates:
    """Rates the time model divides by. Defaults: H200 values (rounded copies of the JSONs).

    TFLOPS are 1e12 FLOP/s, GB/s are 1e9 B/s, ms are milliseconds. ``sources`` maps each field to
    where its value came from (``file: json path``, a built-in copy, or an assumption).
    """

    attention_tflops: float = (
        485.0  # sparse MLA (the engine's kernel: warp-specialized Gluon on an H200), rank 0 of C=8 at 128K
    )
    indexer_logits_tflops: float = 903.9
    topk_ms: float = 4.88  # the top-k selection kernel over [topk_ref_queries, topk_ref_keys] logits
    topk_ref_queries: float = 16384
    topk_ref_keys: float = 131072
    matmul_tflops: float = 723.6  # bf16 8192^3
    copy_gbps: float = 4221.2  # device copy, read + write
    store_mla_fp8_torch_gbps: float = 160.3
    store_mla_fp8_fused_gbps: float = 3637.3
    store_mla_bf16_torch_gbps: float = 732.0
    store_mla_bf16_fused_gbps: float = 3478.5
    store_index_torch_gbps: float = 121.3
    store_index_fused_gbps: float = 2682.3
    rerange_kv_torch_gbps: float = 3365.0
    rerange_kv_fused_gbps: float = 3803.8
    rerange_index_torch_gbps: float = 802.3
    rerange_index_fused_gbps: float = 3104.6
    materialize_torch_gbps: float = 161.8
    materialize_fused_gbps: float = 3688.4
    fill_current_fused_gbps: float = (
        2887.9  # phase 7's current-rows fill (bench.glue), its bytes as fill_bytes counts them
    )
    remap_sort_ms: float = 0.1141  # one sort + searchsorted call over remap_ref_tokens locs
    remap_page_inverse_ms: float = 0.0297
    remap_ref_tokens: float = 131072
    elementwise_us_per_token: float = 0.110  # planner.elementwise: profiled device time per local token
    interconnect_gbps: float = 450.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "sources" and not getattr(self, f.name) > 0:
                raise ConfigError(f"rate {f.name}={getattr(self, f.name)!r} must be a positive number")
        sources = {
            f.name: _ASSUMED.get(f.name) or "built-in copy of the H200 value in {}: {}".format(*_RATE_PATHS[f.name])
            if getattr(self, f.name) == f.default
            else "given in code"
            for f in dataclasses.fields(self)
            if f.name != "sources"
        }
        sources.update(self.sources)
        object.__setattr__(self, "sources", sources)

    def gbps(self, op: str, fused: bool) -> float:
        """GB/s of a memory-bound op (``store_mla_fp8``, ``rerange_kv``, ...) on the chosen path."""
        return float(getattr(self, f"{op}_{'fused' if fused else 'torch'}_gbps"))

    def values(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}

    def override(self, values: dict[str, Any], source: str) -> PlannerRates:
        """Replace some rates (``{field: number}``), recording ``source: field`` as their origin."""
        unknown = sorted(set(values) - set(self.values()))
        if unknown:
            raise ConfigError(f"{source}: unknown rate(s) {unknown}; known: {', '.join(sorted(self.values()))}")
        booleans = sorted(k for k, v in values.items() if isinstance(v, bool))
        if booleans:  # float(True) is 1.0: a boolean is no rate
            raise ConfigError(f"{source}: rate(s) {booleans} are booleans; a rate is a number")
        try:
            sourced = {k: (float(v), f"{source}: {k}") for k, v in values.items()}
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: rates must be numbers") from None
        bad = [k for k, (v, _) in sourced.items() if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ConfigError(f"{source}: rate(s) {bad} must be positive, finite numbers")
        return self.with_sourced(sourced)

    def with_sourced(self, sourced: dict[str, tuple[float, str]]) -> PlannerRates:
        """Replace rates from ``{field: (value, source)}``."""
        values = {k: v for k, (v, _) in sourced.items()}
        return dataclasses.replace(self, **values, sources={**self.sources, **{k: s for k, (_, s) in sourced.items()}})


def _lookup(doc: Any, path: str) -> tuple[Any, str]:
    """Resolve a ``_RATE_PATHS`` path in a benchmark JSON -> ``(value, path with T=max resolved)``."""
    resolved = []
    for part in path.split("."):
        key, _, flt = part.partition("[")
        doc = doc[key]
        if flt:
            conds = dict(c.split("=") for c in flt.rstrip("]").split(","))
            rows = [r for r in doc if all(str(r.get(k)) == v for k, v in conds.items() if v != "max")]
            top = next(k for k, v in conds.items() if v == "max")
            doc = max(rows, key=lambda r: r[top])
            part = part.replace(f"{top}=max", f"{top}={doc[top]}")
        resolved.append(part)
    return doc, ".".join(resolved)


def rates_from_bench(doc: dict[str, Any], file: str, label: str) -> dict[str, tuple[float, str]]:
    """The rates a benchmark JSON (``file`` is its kind, by name) provides -> ``{field: (value, source)}``."""
    out = {}
    paths = [(name, path) for name, (kind, path) in _RATE_PATHS.items() if kind == file]
    for name, path in paths + list(_ALSO_IN.get(file, {}).items()):
        try:
            value, where = _lookup(doc, path)
        except (KeyError, TypeError, ValueError, IndexError):
            raise ConfigError(f"{label}: no {path} in this {file}") from None
        out[name] = (float(value), f"{label}: {where}")
    return out


def load_rates(
    paths: str | Path | Sequence[str | Path] | None = None,
    results_dir: Path | None = RESULTS_DIR,
    *,
    what: str = "rates",
) -> PlannerRates:
    """Defaults from ``results_dir`` (where the files exist), then each of ``paths`` in order: one
    path, or a list of them.

    A file in ``paths`` is a ``compute_bench.json`` (has ``per_rank``), a ``kernels_bench.json``
    (has ``kernels``), a ``glue_h200.json`` (has ``bench``, a ``bench.glue`` run), a
    ``topk_select_h200.json`` (has ``compute_bench``), or a flat ``{field: value}`` object of
    :class:`PlannerRates` fields. A file that cannot be read is a
    :class:`~reference_impl.config.ConfigError` naming ``what`` (the CLI passes its flag or variable).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if paths is not None and (not isinstance(paths, Sequence) or not all(isinstance(p, (str, Path)) for p in paths)):
        raise ConfigError(f"{what}={paths!r}: need a path or a list of paths to JSON files")
    if results_dir is not None and not isinstance(results_dir, Path):
        results_dir = Path(results_dir)
    rates = PlannerRates()
    found: dict[str, tuple[float, str]] = {}
    for name in (_COMPUTE, _KERNELS, _ELEMENTWISE, _GLUE, _TOPK) if results_dir is not None else ():
        path = results_dir / name
        if path.is_file():
            label = f"docs/results/{name}" if results_dir == RESULTS_DIR else str(path)
            found.update(rates_from_bench(json.loads(path.read_text()), name, label))
    rates = rates.with_sourced(found)
    for path in paths or []:
        path_str = str(path)
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{what} {path_str}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            where = f" ({exc.msg} at line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
            raise ConfigError(f"{what} {path_str}: not JSON{where}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{what} {path_str}: expected a JSON object")
        kind = (
            _COMPUTE
            if "per_rank" in doc
            else _KERNELS
            if "kernels" in doc
            else _GLUE
            if "bench" in doc
            else _TOPK
            if "compute_bench" in doc
            else None
        )
        if kind is None:
            rates = rates.override(doc, path_str)
        else:
            rates = rates.with_sourced(rates_from_bench(doc, kind, path_str))
    return rates
