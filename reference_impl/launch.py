"""Run one function on the ranks of a CP group: in-process, as local processes, or under torchrun.

``launch(fn, cp_size, payload)`` runs ``fn(group, payload)`` on ``cp_size`` ranks and returns the
per-rank results ordered by rank:

* ``cp_size == 1``: in this process, on a trivial :class:`~reference_impl.cp.comm.CPGroup` (no
  process group, no timeout).
* CPU (``device="cpu"``, or ``"auto"`` without CUDA): gloo. Processes are forked (fast, and ``fn``
  may be a closure) when each rank computes on one thread and CUDA is not initialized here; a rank
  of several threads starts from a fork server instead, because GNU OpenMP's thread pool does not
  survive ``fork``: a forked child that computes on several threads after this process used the
  pool deadlocks (seen on a 16-core box: 8 threads per rank). With CUDA initialized, spawned.
* CUDA with at least ``cp_size`` GPUs: NCCL, rank ``r`` on ``cuda:r``, spawned.
* CUDA with fewer GPUs: gloo with CUDA tensors, ranks sharing GPUs round-robin (``cuda:r % n``),
  because NCCL refuses two ranks on one device; logged as a warning and visible in the plan.

:func:`choose_backend` makes that decision as a pure function. Spawned ranks need ``fn`` and the
payload to be picklable (a module-level function). Results travel back pickled through a queue,
tensors moved to CPU first. A rank that raises makes the launcher kill the others and re-raise in
this process (``ConfigError`` and ``CollectiveMismatchError`` keep their type and message; others
become :class:`~reference_impl.rank_processes.RankFailedError`), with the rank and its traceback
attached (``.rank``, ``.remote_traceback``). A rank killed by a signal is named as such, a hang
names the rank(s) that did not reach the collective the others wait in
(:class:`~reference_impl.rank_processes.RankTimeoutError`), SIGTERM stops every rank, and the ranks
die with this process: :mod:`reference_impl.rank_processes` supervises them. Nothing waits forever.

**torchrun.** The same call works in processes that ``torchrun`` started (one per GPU, any number
of nodes): when ``RANK``/``WORLD_SIZE`` are set (``MASTER_ADDR``/``MASTER_PORT`` too, or the
run is refused naming the one missing), ``launch`` initializes from
``env://`` (NCCL on CUDA, rank on ``cuda:LOCAL_RANK``; gloo on CPU), runs ``fn`` on this rank only,
and returns every rank's result on rank 0 (``gather_object``) and ``None`` on the others, so one
process reports. ``cp_size`` must equal ``WORLD_SIZE``. :func:`run_under_torchrun` returns just this
rank's result. At ``timeout_s`` a rank that is not waiting in a collective (the one a hang left
behind) exits first with code 3 and a message naming the collective it did not reach; the ranks
waiting for it follow a few seconds later, so torchrun names the right rank as the root cause. A script that calls
``launch(fn, 8, payload)`` runs unchanged as ``python my_script.py`` (local processes) or as
``torchrun --nnodes 2 --nproc-per-node 4 ... my_script.py`` (one rank per GPU, any nodes).

Every rank's environment gets ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
unless already set: the multi-GPU box requires NVLink multicast off.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError, ascii_int, check_environment, env_knob
from reference_impl.cp.comm import CPGroup, report_progress_to
from reference_impl.errors import RankFailedError, RankTimeoutError, RunStopped
from reference_impl.machine import cpu_cores
from reference_impl.machine import fd_limit as machine_fd_limit
from reference_impl.rank_processes import (
    run_rank_processes,
    set_rank_env,
    to_cpu,
)

__all__ = [
    "LaunchSpec",
    "RankFailedError",
    "RankTimeoutError",
    "RunStopped",
    "check_machine",
    "check_torchrun_env",
    "choose_backend",
    "launch",
    "plan_launch",
    "rank_cpu_threads",
    "run_under_torchrun",
    "under_torchrun",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")

EXIT_RANK_FAILED = 3  # the exit code of a torchrun rank that a timeout found behind
_TORCHRUN_FOLLOW_S = 5.0  # how long ranks waiting in a collective outlive the one that hung


@dataclass(frozen=True)
class LaunchSpec:
    """How the ranks run: ``backend`` ("none" in-process, "gloo", "nccl"), one device per rank,
    ``start_method`` ("inline", "fork", "forkserver", "spawn"), and whether ranks share GPUs."""

    backend: str
    device_per_rank: tuple[str, ...]
    start_method: str
    shared_gpu: bool

    def describe(self) -> str:
        """One line for logs and reports."""
        devices = ", ".join(self.device_per_rank)
        shared = " (ranks share GPUs round-robin: NCCL refuses two ranks on one device)" if self.shared_gpu else ""
        return f"{len(self.device_per_rank)} rank(s), backend={self.backend}, {self.start_method}, [{devices}]{shared}"


def choose_backend(
    cp_size: int,
    device: str,
    backend: str,
    cuda_count: int,
    *,
    cuda_initialized: bool = False,
    fork_available: bool = True,
    rank_threads: int = 1,
) -> LaunchSpec:
    """Decide backend, per-rank devices and start method; pure (the caller passes the machine's facts).

    ``device`` is "auto" | "cpu" | "cuda"; ``backend`` is "auto" | "gloo" | "nccl"; ``rank_threads`` is
    how many intra-op threads each CPU rank will use (:func:`rank_cpu_threads`).
    Raises ConfigError for an impossible request (NCCL on CPU or with fewer GPUs than ranks,
    CUDA without GPUs).
    """
    if cp_size < 1:
        raise ConfigError(f"cp_size={cp_size}: need at least one rank")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'")
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend={backend!r}: use 'auto', 'gloo' or 'nccl'")
    kind = ("cuda" if cuda_count > 0 else "cpu") if device == "auto" else device
    if kind == "cuda" and cuda_count < 1:
        raise ConfigError("device='cuda' but no CUDA device is visible; use --device cpu")
    if backend == "nccl" and kind == "cpu":
        raise ConfigError("NCCL needs CUDA devices; use --backend gloo for CPU ranks")
    if backend == "nccl" and cuda_count < cp_size:
        raise ConfigError(
            f"NCCL needs one GPU per rank: cp_size={cp_size} but {cuda_count} CUDA device(s); "
            "use --backend gloo to let ranks share GPUs, or a smaller --cp-size"
        )

    if kind == "cpu":
        devices = ("cpu",) * cp_size
        chosen, shared = "gloo", False
        if not fork_available or cuda_initialized:
            start = "spawn"
        elif in_jupyter_kernel():
            # Forking a Jupyter kernel copies its ZMQ sockets into the ranks; seen killing the kernel
            # (ENOTSOCK) on the GPU box. A fork server starts clean and then forks cheaply.
            start = "forkserver"
        elif rank_threads > 1:
            # GNU OpenMP's pool does not survive fork: a child that runs a parallel region after the
            # parent used the pool deadlocks. A fork server never ran one.
            start = "forkserver"
        else:
            start = "fork"
    else:
        devices = tuple(f"cuda:{r % cuda_count}" for r in range(cp_size))
        chosen = "nccl" if backend != "gloo" and cuda_count >= cp_size else "gloo"
        shared = cp_size > cuda_count
        start = "spawn"  # a forked child cannot use CUDA once the parent touched it
    if cp_size == 1:
        return LaunchSpec("none", devices, "inline", False)
    return LaunchSpec(chosen, devices, start, shared)


def rank_cpu_threads(world: int) -> int:
    """Intra-op threads each of ``world`` CPU ranks uses (the oracle uses the same, for bitwise-equal
    math): ``DSACP_RANK_THREADS`` when set (the CPU test tier pins 1, as on a 2-core CI machine),
    else the machine's cores shared among the ranks."""
    threads = env_knob("rank_threads")  # refused by name unless 1 .. this machine's cores
    if threads is not None:
        return int(threads)
    return max(1, cpu_cores() // world)


THREADS_PER_CORE = 16  # the most rank threads a core is asked to carry (ranks mostly wait in collectives)
FDS_PER_PEER = 4  # file descriptors one rank process holds per rank of its group (gloo's sockets, measured ~3)
FDS_BASE = 64  # and besides (libraries, pipes, the rendezvous store)


def check_machine(plan: LaunchSpec, rank_threads: int, cores: int | None = None, fd_limit: int | None = None) -> None:
    """Refuse, before any starts, ranks this machine cannot run (a :class:`ConfigError` naming the rule).

    The rules, from the machine's facts (``cores``: :func:`~reference_impl.machine.cpu_cores`; ``fd_limit``: the soft
    ``RLIMIT_NOFILE`` every rank inherits):

    * **threads**: ranks x their intra-op threads at most :data:`THREADS_PER_CORE` per core; ranks
      mostly wait in collectives, but past that they only queue for the cores (512 CPU ranks on 2
      cores start, print socket warnings, and finish nothing in minutes).
    * **file descriptors**: each rank holds about :data:`FDS_PER_PEER` per rank of the group (gloo's
      full mesh of sockets) plus :data:`FDS_BASE`; that must stay within ``fd_limit``.

    Memory is :mod:`reference_impl.footprint`'s; the threads of one rank (``DSACP_RANK_THREADS``,
    at most the cores) are :func:`rank_cpu_threads`'s.
    """
    world = len(plan.device_per_rank)
    if plan.start_method == "inline":
        return
    cores = cores or cpu_cores()
    threads = world * (rank_threads if plan.device_per_rank[0] == "cpu" else 1)
    if threads > THREADS_PER_CORE * cores:
        per_rank = f" x {rank_threads} threads" if plan.device_per_rank[0] == "cpu" and rank_threads > 1 else ""
        raise ConfigError(
            f"cp_size={world}: {world} ranks{per_rank} on {cores} core{'s' * (cores != 1)}; this machine runs at most "
            f"{THREADS_PER_CORE * cores // max(1, threads // world)} ({THREADS_PER_CORE} rank threads per core): "
            "use a smaller --cp-size"
        )
    limit = fd_limit if fd_limit is not None else machine_fd_limit()
    need = FDS_BASE + FDS_PER_PEER * world
    if limit is not None and need > limit:
        raise ConfigError(
            f"cp_size={world}: each rank holds about {need} file descriptors ({FDS_PER_PEER} per rank of the group), "
            f"over this process's limit of {limit} (ulimit -n): raise the limit or use a smaller --cp-size"
        )


def plan_launch(cp_size: int, device: str = "auto", backend: str = "auto") -> LaunchSpec:
    """How :func:`launch` would run ``cp_size`` ranks here (:func:`choose_backend` with this
    machine's facts), after :func:`check_machine` accepted them; nothing starts."""
    plan = choose_backend(
        cp_size,
        device,
        backend,
        torch.cuda.device_count() if torch.cuda.is_available() else 0,
        cuda_initialized=torch.cuda.is_initialized(),
        fork_available="fork" in mp.get_all_start_methods(),
        rank_threads=rank_cpu_threads(cp_size),
    )
    check_machine(plan, rank_cpu_threads(cp_size))
    return plan


def in_jupyter_kernel() -> bool:
    """True inside a running Jupyter kernel (the walkthrough notebooks), not merely with ipykernel imported."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what an env:// rendezvous reads


def under_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started: ``RANK`` or ``WORLD_SIZE`` is
    set. Then the rest of the env:// rendezvous is checked at once (:func:`check_torchrun_env`), so that a
    partial or malformed one is refused by name instead of failing inside ``torch.distributed``."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return False
    check_torchrun_env()
    return True


def check_torchrun_env() -> None:
    """A :class:`ConfigError` naming the variable unless ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are all set and valid (``LOCAL_RANK`` too, when set): what an env:// rendezvous reads.
    A process group that already exists is reused as it is (its rendezvous is done)."""
    if dist.is_available() and dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_ENV if not os.environ.get(name, "").strip()]
    if missing:
        raise ConfigError(
            f"a torchrun-style environment without {', '.join(missing)}: an env:// launch sets "
            f"{', '.join(TORCHRUN_ENV)} (unset RANK and WORLD_SIZE to run local ranks)"
        )
    world = _env_int("WORLD_SIZE", 1)
    _env_int("RANK", 0, world - 1)
    if "LOCAL_RANK" in os.environ:
        _env_int("LOCAL_RANK", 0, world - 1)
    _env_int("MASTER_PORT", 1, 65535)


def _env_int(name: str, minimum: int, maximum: int | None = None) -> int:
    """The integer in environment variable ``name``, within ``[minimum, maximum]``, or a ConfigError naming it."""
    text = os.environ[name].strip()
    try:
        value = ascii_int(text)
    except ValueError:
        raise ConfigError(f"{name}={os.environ[name]!r}: need an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum} <= {name} <= {maximum}" if maximum is not None else f"{name} >= {minimum}"
        raise ConfigError(f"{name}={value}: need {bound}")
    return value


def launch(
    fn: Callable[[CPGroup, Any], R],
    cp_size: int,
    payload: Any = None,
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 300,
    debug: bool | None = None,
    on_steps: Callable[[int], None] | None = None,
) -> list[R]:
    """Run ``fn(group, payload)`` on ``cp_size`` ranks; return the results ordered by rank.

    ``debug`` (default: ``DSACP_DEBUG``) turns on the CP group's collective recorder, and each rank
    checks the whole sequence once more after ``fn`` returns. See the module docstring for the
    backend choice, error propagation and torchrun. Ranks this machine cannot run are refused
    first (:func:`check_machine`), and so is a bad library environment variable
    (:func:`~reference_impl.config.check_environment`). ``on_steps`` hears, about ten times a
    second, the steps of work (:func:`~reference_impl.cp.comm.note_step`) the slowest rank has done.
    """
    check_environment()
    if under_torchrun():
        world = _env_int("WORLD_SIZE", 1)
        if cp_size != world:
            raise ConfigError(f"cp_size={cp_size} but torchrun started WORLD_SIZE={world} ranks")
        return _run_torchrun_rank(fn, payload, device, backend, timeout_s, debug, gather=True)

    plan = plan_launch(cp_size, device, backend)
    if plan.shared_gpu:
        logger.warning("launch: %s", plan.describe())
    else:
        logger.info("launch: %s", plan.describe())
    if plan.start_method == "inline":
        group = CPGroup.single(plan.device_per_rank[0], debug=debug)
        reporter = _InlineSteps(on_steps) if on_steps is not None else None
        report_progress_to(reporter)
        try:
            return [fn(group, payload)]
        finally:
            report_progress_to(None)
    return run_rank_processes(
        fn,
        payload,
        plan.backend,
        plan.device_per_rank,
        plan.start_method,
        timeout_s,
        debug,
        rank_cpu_threads(len(plan.device_per_rank)),
        on_poll=None if on_steps is None else lambda progress: on_steps(progress.slowest_steps()),
    )


class _InlineSteps:
    """One in-process rank's steps, told to ``on_steps`` as they happen."""

    def __init__(self, on_steps: Callable[[int], None]) -> None:
        self.on_steps, self.steps = on_steps, 0

    def enter(self, op: str, tag: str) -> None:
        pass

    def leave(self) -> None:
        pass

    def step(self) -> None:
        self.steps += 1
        self.on_steps(self.steps)


def run_under_torchrun(
    fn: Callable[[CPGroup, Any], R],
    payload: Any = None,
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 1800,
    debug: bool | None = None,
) -> R:
    """Run ``fn`` on this torchrun-started rank (env:// rendezvous) and return this rank's result.

    Initializes the default process group unless one exists (then it is reused and left alone).
    """
    if not under_torchrun():
        raise ConfigError("run_under_torchrun: RANK and WORLD_SIZE are not set; start with torchrun")
    return _run_torchrun_rank(fn, payload, device, backend, timeout_s, debug, gather=False)


# ------------------------------------------------------------------------------------ torchrun


class _TorchrunWatchdog:
    """The torchrun rank's side of a timeout: the rank a hang left behind (not waiting in a
    collective) reports first and exits; the ranks waiting for it follow a few seconds later."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.entered, self.left, self.tag = rank, 0, 0, ""
        self._done = threading.Event()
        self._timeout_s = timeout_s
        threading.Thread(target=self._watch, name="dsacp-timeout", daemon=True).start()

    def enter(self, op: str, tag: str) -> None:
        self.entered, self.tag = self.entered + 1, f"{op}[{tag}]"

    def leave(self) -> None:
        self.left += 1

    def finish(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self._timeout_s):
            return
        waiting = self.entered > self.left
        if waiting and self._done.wait(_TORCHRUN_FOLLOW_S):
            return
        last = f"last entered: #{self.entered} {self.tag}" if self.entered else "none entered yet"
        where = (
            f"waiting in collective #{self.entered} ({self.tag}) for a rank that did not reach it"
            if waiting
            else f"did not reach collective #{self.entered + 1} ({last})"
        )
        print(f"error: rank {self.rank}: no result within {self._timeout_s:g} s: {where}", file=sys.stderr, flush=True)
        os._exit(EXIT_RANK_FAILED)


def _run_torchrun_rank(
    fn: Callable[[CPGroup, Any], Any],
    payload: Any,
    device: str,
    backend: str,
    timeout_s: float,
    debug: bool | None,
    gather: bool,
) -> Any:
    set_rank_env()
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is visible; use --device cpu")
    rank_device = "cpu"
    if device != "cpu" and torch.cuda.is_available():
        local_rank = _env_int("LOCAL_RANK", 0) if "LOCAL_RANK" in os.environ else 0
        rank_device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        chosen = backend if backend != "auto" else ("nccl" if rank_device != "cpu" else "gloo")
        if chosen == "nccl" and rank_device == "cpu":
            raise ConfigError("NCCL needs CUDA devices; use --backend gloo for CPU ranks")
        # The group's own timeout comes after the watchdog's decision (see _TorchrunWatchdog).
        limit = datetime.timedelta(seconds=timeout_s + 3 * _TORCHRUN_FOLLOW_S)
        dist.init_process_group(chosen, init_method="env://", timeout=limit)
    watchdog = _TorchrunWatchdog(dist.get_rank(), timeout_s)
    report_progress_to(watchdog)
    try:
        # On failure the exception leaves without teardown: torchrun stops the other ranks, and a
        # destroy while a peer sits in a collective could hang.
        group = CPGroup(device=rank_device, debug=debug)
        result = fn(group, payload)
        group.check_consistent()
        if gather:
            results: list[Any] | None = [None] * group.size if group.rank == 0 else None
            dist.gather_object(to_cpu(result), results, dst=0)
            result = results
    finally:
        watchdog.finish()
        report_progress_to(None)
    if owns_group:
        dist.destroy_process_group()
    return result
