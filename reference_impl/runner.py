"""Run one CP prefill end to end: launch the ranks, run the oracle, compare, and report.

This is what ``python -m reference_impl run`` and the notebooks call::

    from reference_impl.config import RunConfig, PhaseSet
    from reference_impl.runner import run_prefill
    report = run_prefill(RunConfig(preset="tiny", cp_size=4, phases=PhaseSet.level(1)))
    assert report["matches_oracle"]
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import Any

import torch

from reference_impl.check import compare
from reference_impl.config import RunConfig
from reference_impl.engine import RankResult, build_metadata, chunk_metadata, run_rank
from reference_impl.schedule import chunk_schedule
from reference_impl.launch import choose_backend, launch, rank_cpu_threads, under_torchrun
from reference_impl.model.oracle import run_oracle
from reference_impl.report import build_report
from reference_impl.workload import build_inputs, build_model, compute_dtype, resolve_device

logger = logging.getLogger(__name__)


def _launch_plan_line(run: RunConfig) -> tuple[str, bool]:
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = choose_backend(
        run.cp_size, run.device, run.backend, cuda,
        cuda_initialized=torch.cuda.is_initialized(), fork_available="fork" in mp.get_all_start_methods(),
    )
    return plan.backend, plan.shared_gpu


def run_prefill(run: RunConfig, timeout_s: float = 600) -> dict[str, Any]:
    """Run ``run`` on ``run.cp_size`` ranks and return the report (a JSON-ready dict).

    Bad input raises :class:`~reference_impl.config.ConfigError` before any rank starts.
    """
    meta = build_metadata(run)  # the whole batch's token numbering
    for chunk in chunk_schedule(run):
        chunk_metadata(run, chunk)  # validates every chunk's split in this process, before any rank starts
    backend, shared_gpu = ("nccl" if torch.cuda.is_available() else "gloo", False) if under_torchrun() else _launch_plan_line(run)
    results: list[RankResult] = launch(
        run_rank, run.cp_size, run, device=run.device, backend=run.backend, timeout_s=timeout_s, debug=run.debug
    )
    agreement = None
    if run.check:
        device = resolve_device(run)
        threads = torch.get_num_threads()
        if device.type == "cpu" and run.cp_size > 1:
            torch.set_num_threads(rank_cpu_threads(run.cp_size))  # same reduction splits as the ranks
        try:
            model = build_model(run, device)
            prefixes = [r.prefix for r in run.requests]
            oracle = run_oracle(
                model, prefixes, build_inputs(run, device), run.kv_dtype, run.page_size, chunk_size=run.chunk_size
            )
        finally:
            torch.set_num_threads(threads)
        agreement = compare(run, meta, model, oracle, results, compute_dtype(run, device))
        if not agreement.matches_oracle:
            logger.error("CP run disagrees with the oracle: %s", "; ".join(agreement.problems))
    return build_report(run, meta, results, agreement, backend=backend, shared_gpu=shared_gpu)
