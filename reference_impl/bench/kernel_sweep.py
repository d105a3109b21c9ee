"""Launch-config sweep of the phase-7 fused kernels (``python -m reference_impl.bench.kernels --sweep``).

For each kernel row of :data:`SWEPT` the sweep runs every candidate config of
:data:`GPU_CANDIDATES` (on ``--device cpu``: the two of :data:`CPU_CANDIDATES`, a test of the
harness) at each sweep token count. A candidate that raises (out of shared memory or registers,
a compile error) is recorded with its error and skipped; the others' output bytes are compared with
the torch path's, and every candidate whose bytes equal torch's (or, see below, the default
config's) is timed as the benchmark's rows are, over 60 calls. The best config is
the one with the highest fraction of the copy bandwidth, averaged over the sweep token counts.

The default config (:mod:`reference_impl.kernels.fused_configs`) is always a candidate, so the best
is never slower than the default by more than the timing noise. If no candidate equals torch
(the FP8 MLA store differed from torch on the GPU once), the best is chosen among the candidates
whose bytes equal the default config's, and ``best_basis`` says so: the configs still agree with
each other, which is what choosing between them needs.

A config is the keyword arguments of the kernel's public function; ``one_pass`` and ``fast_div``
are the alternative code paths of :mod:`reference_impl.kernels.fused_store` and
:mod:`reference_impl.kernels.fused_materialize` (same bytes, different instruction streams).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from reference_impl.kernels.fused_configs import LaunchConfig, default_config

if TYPE_CHECKING:
    from reference_impl.bench.kernel_cases import Case

logger = logging.getLogger(__name__)

SWEPT: tuple[str, ...] = (
    "store_mla_fp8",
    "store_mla_bf16",
    "store_index",
    "rerange_kv",
    "rerange_index",
    "materialize_fp8",
)
SWEEP_REPS = 60


def _configs(keys: tuple[str, ...], rows: Iterable[tuple[int | bool, ...]], **fixed: int | bool) -> list[LaunchConfig]:
    return [dict(zip(keys, row)) | fixed for row in rows]


_FP8_STORE = ("block_m", "num_warps", "one_pass", "fast_div")
_STORE = ("block_m", "num_warps")
_INDEX = ("block_m", "num_warps", "fast_div")
_RERANGE = ("block_t", "block_c", "num_warps", "one_pass")
_MATERIALIZE = ("block_m", "num_warps", "one_pass")

# Pruned offline with ptxas for sm_90 (Triton 3.7): every candidate compiles without spills. The
# one-pass FP8 tile holds BLOCK_M * 512 values, so it keeps <= 64 fp32 values per thread (<= ~120
# registers); the block loop holds BLOCK_M * 128 per step. Rerange: 288 words per KV row (BLOCK_C
# 32 divides it: no masked lanes, fewest instructions, but 9 load -> store steps; one_pass: 256 +
# 32 words, all loads first; BLOCK_C 512, one step with 224 masked lanes, costs 3x the
# instructions and is left out), 64 per index row (one step at BLOCK_C >= 64: one_pass adds nothing).
GPU_CANDIDATES: dict[str, list[LaunchConfig]] = {
    "store_mla_fp8": _configs(
        _FP8_STORE,
        [
            (16, 4, False, False),
            (64, 8, False, False),
            (8, 1, False, True),
            (16, 2, False, True),
            (16, 4, False, True),
            (32, 4, False, True),
            (32, 8, False, True),
            (64, 8, False, True),
            (16, 4, True, False),
            (8, 2, True, True),
            (8, 4, True, True),
            (16, 4, True, True),
            (16, 8, True, True),
            (32, 8, True, True),
        ],
    ),
    "store_mla_bf16": _configs(
        _STORE, [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 8), (64, 4), (64, 8), (128, 8)]
    ),
    "store_index": _configs(
        _INDEX,
        [
            (8, 1, True),
            (16, 1, True),
            (16, 2, True),
            (32, 2, True),
            (32, 4, True),
            (64, 4, True),
            (64, 8, True),
            (128, 4, True),
            (128, 8, True),
            (256, 8, True),
        ],
    ),
    "rerange_kv": _configs(
        _RERANGE,
        [
            (8, 32, 2, False),
            (16, 32, 4, False),
            (32, 32, 4, False),
            (32, 32, 8, False),
            (64, 32, 8, False),
            (16, 64, 4, False),
            (32, 64, 4, False),
            (16, 128, 4, False),
            (32, 256, 8, False),
            (8, 0, 2, True),
            (16, 0, 4, True),
            (32, 0, 4, True),
            (32, 0, 8, True),
            (64, 0, 8, True),
        ],
    ),
    "rerange_index": _configs(
        _RERANGE,
        [(8, 64, 1), (16, 64, 1), (16, 64, 2), (32, 64, 2), (32, 64, 4), (64, 64, 4), (64, 64, 8), (128, 64, 4)]
        + [(128, 64, 8), (256, 64, 8), (32, 32, 4), (64, 32, 4)],
        one_pass=False,
    ),
    "materialize_fp8": _configs(
        _MATERIALIZE,
        [
            (16, 2, False),
            (16, 4, False),
            (32, 8, False),
            (64, 8, False),
            (8, 2, True),
            (8, 4, True),
            (16, 4, True),
            (16, 8, True),
            (32, 4, True),
            (32, 8, True),
        ],
    ),
}
# The interpreter: the default plus one other config per kernel (the one-pass paths included).
CPU_CANDIDATES: dict[str, list[LaunchConfig]] = {
    "store_mla_fp8": [{"block_m": 8, "num_warps": 1, "one_pass": True, "fast_div": False}],
    "store_mla_bf16": [{"block_m": 8, "num_warps": 1}],
    "store_index": [{"block_m": 8, "num_warps": 1, "fast_div": False}],
    "rerange_kv": [{"block_t": 8, "block_c": 128, "num_warps": 1, "one_pass": True}],
    "rerange_index": [{"block_t": 8, "block_c": 128, "num_warps": 1, "one_pass": False}],
    "materialize_fp8": [{"block_m": 8, "num_warps": 1, "one_pass": True}],
}


def candidates(kernel: str, device: torch.device) -> list[LaunchConfig]:
    """``kernel``'s sweep candidates on ``device``, the default config first (once)."""
    default = default_config(kernel, device)
    listed = (GPU_CANDIDATES if device.type == "cuda" else CPU_CANDIDATES)[kernel]
    return [default] + [dict(c) for c in listed if c != default]


def _sweep_case(
    case: Case,
    entries: list[dict[str, Any]],
    tokens: int,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
) -> None:
    """Check and time every candidate of ``entries`` (the default first) on ``case``; results under ``by_T``."""
    want = case.reference_bytes()
    default_bytes: list[torch.Tensor] | None = None
    for entry in entries:
        if "error" in entry:  # failed at an earlier token count
            continue
        config = entry["config"]
        try:
            differing, got = case.kernel_bytes(config, want)
        except Exception as exc:  # noqa: BLE001  # out of resources, compile errors: recorded, the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            logger.info("%s %s: %s", case.op, config, entry["error"])
            continue
        if entry is entries[0]:  # the default config
            default_bytes = got
        same_as_default = default_bytes is not None and all(map(_same_bytes, got, default_bytes))
        del got
        result: dict[str, Any] = {"differing_bytes": differing, "equal_to_default": same_as_default}
        if differing == 0 or same_as_default:
            ms = time_ms(lambda config=config: case.run(config))
            gbps = case.payload / ms / 1e6
            result |= {"ms": ms, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
        entry.setdefault("by_T", {})[str(tokens)] = result
        print(
            f"  sweep {case.op:<16}{_describe(config):<44}"
            + (f"{result['ms']:>9.4f} ms{result['fraction_of_copy']:>6.0%}" if "ms" in result else f"{'':>17}")
            + ("  ok" if differing == 0 else f"  DIFF {differing} B"),
            flush=True,
        )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _describe(config: LaunchConfig) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in config.items())


def _summarize(entry: dict[str, Any], tokens: list[int]) -> None:
    """Fold one candidate's per-T results: top-level numbers at the largest T, equality over all T."""
    by_t = entry.get("by_T", {})
    if "error" in entry or len(by_t) != len(tokens):
        entry.setdefault("error", "did not run at every sweep token count")
        return
    entry["bytes_equal"] = all(r["differing_bytes"] == 0 for r in by_t.values())
    entry["equal_to_default"] = all(r["equal_to_default"] for r in by_t.values())
    if all("ms" in r for r in by_t.values()):
        last = by_t[str(max(tokens))]
        entry |= {"ms": last["ms"], "gbps": last["gbps"], "fraction_of_copy": last["fraction_of_copy"]}
        entry["mean_fraction_of_copy"] = sum(r["fraction_of_copy"] for r in by_t.values()) / len(by_t)
    if len(tokens) == 1:
        del entry["by_T"]  # the same numbers as at top level


def _pick_best(result: dict[str, Any]) -> None:
    timed = [e for e in result["candidates"] if "mean_fraction_of_copy" in e]
    for basis, key in (("torch bytes", "bytes_equal"), ("default config bytes", "equal_to_default")):
        pool = [e for e in timed if e[key]]
        if pool:
            best = max(pool, key=lambda e: e["mean_fraction_of_copy"])
            result |= {"best": best["config"], "best_basis": basis}
            result |= {k: best[k] for k in ("ms", "gbps", "fraction_of_copy", "mean_fraction_of_copy")}
            return
    result |= {"best": None, "best_basis": None}


def sweep(
    cases_at: Callable[[int], list[Case]],
    tokens: list[int],
    device: torch.device,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
    progress: Callable[[dict[str, dict[str, Any]]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{kernel: {default, candidates: [{config, ms, gbps, fraction_of_copy, ...}], best, ...}}`` for :data:`SWEPT`.

    ``cases_at(T)`` builds the benchmark cases at ``T`` tokens (inputs allocated once per ``T``).
    ``progress`` gets the raw results (per-T numbers, no best yet) after each kernel at each ``T``,
    e.g. to save them in case the run is cut short.
    """
    results = {
        kernel: {
            "default": default_config(kernel, device),
            "candidates": [{"config": c} for c in candidates(kernel, device)],
        }
        for kernel in SWEPT
    }
    for t in tokens:
        print(f"sweep T={t}", flush=True)
        cases = {case.op: case for case in cases_at(t)}
        for kernel in SWEPT:
            _sweep_case(cases[kernel], results[kernel]["candidates"], t, time_ms, copy_gbps)
            if progress is not None:
                progress(results)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for result in results.values():
        for entry in result["candidates"]:
            _summarize(entry, tokens)
        _pick_best(result)
        default = result["candidates"][0]
        result["default_fraction_of_copy"] = default.get("mean_fraction_of_copy")
    return results


def format_sweep(results: dict[str, dict[str, Any]]) -> str:
    """One line per kernel: default and best config, their mean fraction of the copy bandwidth."""
    lines = [f"{'sweep':<18}{'ok/total':>9}  {'default /copy':>13}  {'best /copy':>10}  best config (basis)"]
    for kernel, r in results.items():
        ok = sum(1 for e in r["candidates"] if "mean_fraction_of_copy" in e)
        default = r["default_fraction_of_copy"]
        best = r.get("mean_fraction_of_copy")
        lines.append(
            f"{kernel:<18}{ok:>4}/{len(r['candidates']):<4}  "
            + (f"{default:>13.0%}" if default is not None else f"{'-':>13}")
            + "  "
            + (f"{best:>10.0%}" if best is not None else f"{'-':>10}")
            + f"  {_describe(r['best']) if r['best'] else 'none'} ({r['best_basis']})"
        )
    return "\n".join(lines)
