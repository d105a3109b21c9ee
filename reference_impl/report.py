"""The run report: one JSON object per run (its table form is :mod:`reference_impl.tables`).

Byte figures are the sizes of buffers the rank really holds or moves (pool storage, gathered
buffers including padding, full-view tensors); see ``docs/report.md`` for each field.
"""

from __future__ import annotations

import platform
import statistics
import sys
from typing import Any

import torch

from reference_impl.check import Agreement
from reference_impl.config import RunConfig, compute_dtype, env_flag
from reference_impl.cp.split import SplitMetadata
from reference_impl.engine import RankResult
from reference_impl.families import family_of
from reference_impl.workload import resolve_device

PER_RANK_FIELDS = (
    "kv_bytes",
    "index_bytes",
    "transient_peak_bytes",
    "gather_bytes",
    "materialized_bytes",
    "output_gather_bytes",
    "collectives",
)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def attention_kernel(run: RunConfig, device: torch.device) -> str:
    """The attention path the dispatch takes for this run's inputs (the DSA family's ``"gluon_ws"``,
    ``"gluon"``, ``"triton"`` or ``"torch"``; DeepSeek-V4's with a ``v4-`` prefix)."""
    return family_fields(run, device)["attention_kernel"]


def family_fields(run: RunConfig, device: torch.device) -> dict[str, Any]:
    """The run's family's report fields (:meth:`~reference_impl.families.base.ModelFamily.report_fields`)."""
    return family_of(run.model).report_fields(run, device, compute_dtype(run, device))


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency, but the report must not need it
        out["triton"] = "absent"
    return out


def build_report(
    run: RunConfig,
    meta: SplitMetadata,
    results: list[RankResult],
    agreement: Agreement | None,
    backend: str,
    shared_gpu: bool,
) -> dict[str, Any]:
    device = resolve_device(run)
    fields = family_fields(run, device)
    selects = fields["selects"]  # a top-k agreement is over the layers that select keys; none selects: no figure
    per_rank = []
    for r in results:
        entry: dict[str, Any] = {"rank": r.rank, **{k: r.stats[k] for k in PER_RANK_FIELDS}}
        # The optional counts (CUDA's peak, phase 6's syncs) and the family's own bytes (its store's breakdown).
        entry.update({k: v for k, v in r.stats.items() if k not in entry})
        entry["tokens"] = len(r.token_ids)
        entry["layer_ms_median"] = statistics.median(r.timings["layer_ms"])
        entry["tail_ms"] = r.timings["tail_ms"]
        entry["tail_collective_ms"] = r.timings["tail_collective_ms"]
        entry["total_ms"] = r.timings["total_ms"]
        per_rank.append(entry)
    report: dict[str, Any] = {
        "config": {
            "preset": run.preset,
            "requests": [[r.prefix, r.extend] for r in run.requests],
            "kv_dtype": run.kv_dtype,
            "split_mode": run.split_mode,
            "page_size": run.page_size,
            "batch_sizes": list(run.batch_sizes) if run.batch_sizes else None,
            "kv_interleave": run.interleave if run.phases.sharded_kv or run.kv_design == "dcp-gather" else None,
            "kv_design": run.kv_design,
            "n_layers": run.model.n_layers,
            "compute_dtype": str(compute_dtype(run, device)).removeprefix("torch."),
            "seed": run.seed,
            "mla_scale_fmt": run.mla_scale_fmt,
            "index_topk_pattern": fields["index_topk_pattern"],
            "cpu_widths": run.cpu_widths,
            "fp8_projections": env_flag("fp8_projections"),
            "chunk_size": run.chunk_size,
            "chunks": results[0].timings.get("chunks", 1),
            "debug": run.debug,
            "input_logprobs": run.input_logprobs,
            "return_hidden_states": run.return_hidden_states,
        },
        "cp_size": run.cp_size,
        "phases": sorted(run.phases.enabled),
        "phase_level": run.phases.max_level,
        "device": device_name(device),
        "attention_kernel": fields["attention_kernel"],
        "backend": backend,
        "ranks_share_device": shared_gpu or (device.type == "cuda" and run.cp_size > 1 and backend == "gloo"),
        "host_sync_audit": results[0].host_sync_audit or None,
        "kernel_fallbacks": {k: v for r in results for k, v in r.kernel_fallbacks.items()},
        "tail_mode": results[0].tail_mode,
        "store_path": results[0].store_path,
        "matches_oracle": agreement.matches_oracle if agreement else None,
        "max_abs_err": agreement.max_abs_err if agreement else None,
        "logits_max_abs_err": agreement.logits_max_abs_err if agreement else None,
        "topk_agreement": agreement.topk_agreement if agreement and selects else None,
        "topk_boundary_ties": agreement.topk_ties if agreement and selects else None,
        "cache_equal": agreement.cache_equal if agreement else None,
        "cache_max_abs_err": agreement.cache_max_abs_err if agreement else None,
        "problems": agreement.problems if agreement else [],
        "collectives_identical": len({tuple(r.collectives) for r in results}) == 1,
        "store_path_identical": len({r.store_path for r in results}) == 1,
        "pool_occupancy": results[0].pool_occupancy,
        "prefix_cache": results[0].prefix_cache,
        "per_rank": per_rank,
        "timings": {
            "layer_ms_median": max(p["layer_ms_median"] for p in per_rank),
            "tail_ms": max(p["tail_ms"] for p in per_rank),
            "total_ms": max(p["total_ms"] for p in per_rank),
            "note": "one run; per-layer median over layers; max over ranks",
        },
        "versions": versions(),
    }
    return report
