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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from reference_impl.config import ConfigError, RunConfig, check_environment, compute_dtype
from reference_impl.cp.comm import CPGroup
from reference_impl.engine import RankResult, build_metadata, chunk_metadata, run_rank
from reference_impl.families import family_of
from reference_impl.footprint import check_fits
from reference_impl.launch import choose_backend, launch, plan_launch, rank_cpu_threads, under_torchrun
from reference_impl.report import build_report
from reference_impl.schedule import chunk_schedule
from reference_impl.workload import build_inputs, build_model, resolve_device

logger = logging.getLogger(__name__)


def _launch_plan_line(run: RunConfig) -> tuple[str, bool]:
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = choose_backend(
        run.cp_size,
        run.device,
        run.backend,
        cuda,
        cuda_initialized=torch.cuda.is_initialized(),
        fork_available="fork" in mp.get_all_start_methods(),
    )
    return plan.backend, plan.shared_gpu


Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: the run's stage (``"ranks"``: the slowest rank's steps, its model
then each layer of each chunk; ``"oracle"``) and how far it is."""


@dataclass
class PrefillResult:
    """A run's report and every rank's tensors: hidden states and top-k of its tokens, its
    collected output rows and logits, and the cache rows it stores (CPU tensors; see
    :class:`~reference_impl.engine.RankResult`), plus the oracle's result when ``run.check``."""

    report: dict[str, Any]
    ranks: list[RankResult]
    oracle: Any


@overload
def run_prefill(
    run: RunConfig,
    timeout_s: float | None = None,
    *,
    tensors: Literal[False] = False,
    progress: Progress | None = None,
) -> dict[str, Any]: ...
@overload
def run_prefill(
    run: RunConfig,
    timeout_s: float | None = None,
    *,
    tensors: Literal[True],
    progress: Progress | None = None,
) -> PrefillResult: ...


def run_prefill(
    run: RunConfig,
    timeout_s: float | None = None,
    *,
    tensors: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any] | PrefillResult:
    """Run ``run`` on ``run.cp_size`` ranks and return the report (a JSON-ready dict), or with
    ``tensors=True`` a :class:`PrefillResult` (the report, the ranks' tensors, the oracle's).

    Bad input raises :class:`~reference_impl.config.ConfigError` before any rank starts, a run
    that cannot fit the device too (:mod:`reference_impl.footprint`). ``timeout_s`` (default:
    ``run.timeout_s``) bounds the whole run. A rank that fails, dies or hangs raises
    :class:`~reference_impl.rank_processes.RankFailedError` naming it. Under torchrun every rank
    calls this; rank 0 gets the report and the others ``None``. ``progress`` hears how far the run
    is (:data:`Progress`; the CLI draws it; the library prints nothing).
    """
    if not isinstance(run, RunConfig):
        raise ConfigError(f"run={run!r}: need a RunConfig, got {type(run).__name__}")
    if timeout_s is not None and not (
        isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and 0 < timeout_s < float("inf")
    ):
        raise ConfigError(f"timeout_s={timeout_s!r}: need a positive, finite number of seconds")
    if not isinstance(tensors, bool):
        raise ConfigError(f"tensors={tensors!r}: need a bool, got {type(tensors).__name__}")
    _check_progress(progress)
    result = _run_all([run], timeout_s, progress)[0]
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return None  # type: ignore[return-value]
    return result if tensors else result.report


def run_prefills(
    runs: Sequence[RunConfig],
    timeout_s: float | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Run several configurations and return their reports, in order.

    Runs that share ``cp_size``, ``device`` and ``backend`` share one launch: the ranks start once
    (and on a GPU compile their kernels once) and run the configurations one after another, each
    with its own CP group view (collective records, debug recorder). The oracle runs once per
    distinct model, batch and cache layout, whatever the phases. ``timeout_s`` bounds each launch
    (default: the sum of its runs' ``timeout_s``); ``progress`` as in :func:`run_prefill`.
    """
    if isinstance(runs, (str, bytes, RunConfig)) or not isinstance(runs, Sequence):
        raise ConfigError(f"runs={runs!r:.80}: need a list of RunConfig (one run: run_prefill)")
    for position, run in enumerate(runs):
        if not isinstance(run, RunConfig):
            raise ConfigError(f"runs[{position}]={run!r:.80}: need a RunConfig, got {type(run).__name__}")
    _check_progress(progress)
    return [None if result is None else result.report for result in _run_all(runs, timeout_s, progress)]  # type: ignore[misc]


def _check_progress(progress: object) -> None:
    """``progress`` is ``None`` or a callable (:data:`Progress`), refused by name before any rank starts."""
    if progress is not None and not callable(progress):
        raise ConfigError(
            f"progress={progress!r:.80}: need a callable progress(stage, done, total) or None, "
            f"got {type(progress).__name__}"
        )


def preflight(run: RunConfig, extra_process: int = 0) -> None:
    """Everything refused before any rank starts, cheapest first, so that nothing proportional to a
    bad size is built: the library's environment variables, the device and ranks this machine can
    run (:func:`~reference_impl.launch.plan_launch`), the memory (:func:`~reference_impl.footprint.check_fits`,
    arithmetic), then every chunk's split (host metadata, proportional to the tokens that fit).
    ``extra_process``: the bytes of a process beside the ranks (a PD decode)."""
    check_environment()
    device = resolve_device(run) if run.device != "cuda" or torch.cuda.is_available() else None
    if under_torchrun():
        if device is None:
            raise ConfigError("device='cuda' but no CUDA device is visible; use --device cpu")
        check_fits(run, device.type, "spawn", cuda_devices=run.cp_size, extra_process=extra_process)
    else:
        plan = plan_launch(run.cp_size, run.device, run.backend)  # refuses --device cuda without CUDA
        cuda = torch.cuda.device_count() if plan.device_per_rank[0] != "cpu" else 1
        check_fits(run, resolve_device(run).type, plan.start_method, cuda_devices=cuda, extra_process=extra_process)
    for chunk in chunk_schedule(run):
        chunk_metadata(run, chunk)


def _steps(run: RunConfig) -> int:
    """Progress steps of one rank's run: its model, then each layer of each chunk."""
    return 1 + len(chunk_schedule(run)) * run.model.n_layers


def _run_all(
    runs: Sequence[RunConfig],
    timeout_s: float | None,
    progress: Progress | None = None,
) -> list[PrefillResult | None]:
    for run in runs:
        preflight(run)
    launches: dict[tuple[int, str, str], list[int]] = {}
    for i, run in enumerate(runs):
        launches.setdefault((run.cp_size, run.device, run.backend), []).append(i)
    reports: list[PrefillResult | None] = [None] * len(runs)
    oracles: dict[tuple[Any, ...], tuple[torch.nn.Module, Any]] = {}
    for (cp_size, device, backend), indices in launches.items():
        batch = [runs[i] for i in indices]
        limit = timeout_s if timeout_s is not None else sum(run.timeout_s for run in batch)
        on_steps = None
        if progress is not None:
            total = sum(_steps(run) for run in batch)
            progress("ranks", 0, total)
            on_steps = lambda done, total=total: progress("ranks", done, total)  # noqa: E731
        per_rank = launch(
            _run_each, cp_size, batch, device=device, backend=backend, timeout_s=limit, debug=False, on_steps=on_steps
        )
        if on_steps is not None:
            on_steps(total)  # every rank is done
        if per_rank is None:  # under torchrun, on a rank other than 0: rank 0 runs the oracle and reports
            continue
        launch_backend, shared_gpu = _launch_plan_line(batch[0])
        for k, i in enumerate(indices):
            ranks = [results[k] for results in per_rank]
            if progress is not None and runs[i].check:
                progress("oracle", k, len(indices))
            report, oracle = _report(runs[i], ranks, launch_backend, shared_gpu, oracles)
            reports[i] = PrefillResult(report, ranks, oracle)
    return reports


def _run_each(group: CPGroup, runs: list[RunConfig]) -> list[RankResult]:
    """One rank's results for every run of a launch (each run gets its own view of the group)."""
    out = []
    for run in runs:
        view = (
            CPGroup.single(group.device, debug=run.debug)
            if group.is_trivial
            else CPGroup(device=group.device, debug=run.debug)
        )
        out.append(run_rank(view, run))
    return out


def _oracle_threads(run: RunConfig, device: torch.device) -> int | None:
    """CPU intra-op threads for the oracle: the ranks' count, so reductions split alike (bitwise-equal caches)."""
    return rank_cpu_threads(run.cp_size) if device.type == "cpu" and run.cp_size > 1 else None


def _oracle_key(run: RunConfig, device: torch.device) -> tuple[Any, ...]:
    """What the oracle's bits depend on (not the phases, split or debug)."""
    return (
        run.model,
        run.requests,
        run.kv_dtype,
        run.page_size,
        run.chunk_size,
        run.seed,
        compute_dtype(run, device),
        str(device),
        _oracle_threads(run, device),
    )


def _report(
    run: RunConfig,
    results: list[RankResult],
    backend: str,
    shared_gpu: bool,
    oracles: dict[tuple[Any, ...], tuple[torch.nn.Module, Any]],
) -> tuple[dict[str, Any], Any]:
    meta = build_metadata(run)  # the whole batch's token numbering
    if under_torchrun():
        backend, shared_gpu = ("nccl" if torch.cuda.is_available() else "gloo"), False
    agreement, oracle = None, None
    if run.check:
        device = resolve_device(run)
        key = _oracle_key(run, device)
        if key not in oracles:
            threads, oracle_threads = torch.get_num_threads(), _oracle_threads(run, device)
            if oracle_threads is not None:
                torch.set_num_threads(oracle_threads)
            try:
                model = build_model(run, device)
                prefixes = [r.prefix for r in run.requests]
                result = family_of(run.model).oracle(
                    model,
                    prefixes,
                    build_inputs(run, device),
                    run.kv_dtype,
                    run.page_size,
                    run.chunk_size,
                    torch.bfloat16,
                )
                oracles[key] = (model, result)
            finally:
                torch.set_num_threads(threads)
        model, oracle = oracles[key]
        agreement = family_of(run.model).compare(run, meta, model, oracle, results, compute_dtype(run, device))
        if not agreement.matches_oracle:
            logger.error("CP run disagrees with the oracle: %s", "; ".join(agreement.problems))
    return build_report(run, meta, results, agreement, backend=backend, shared_gpu=shared_gpu), oracle
