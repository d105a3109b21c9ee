"""Run one function on the ranks of a CP group: in-process, as local processes, or under torchrun.

``launch(fn, cp_size, payload)`` runs ``fn(group, payload)`` on ``cp_size`` ranks and returns the
per-rank results ordered by rank:

* ``cp_size == 1``: in this process, on a trivial :class:`~reference_impl.cp.comm.CPGroup` (no
  process group, no timeout).
* CPU (``device="cpu"``, or ``"auto"`` without CUDA): gloo; processes are forked when CUDA is not
  initialized in this process (fast, and ``fn`` may be a closure), else spawned.
* CUDA with at least ``cp_size`` GPUs: NCCL, rank ``r`` on ``cuda:r``, spawned.
* CUDA with fewer GPUs: gloo with CUDA tensors, ranks sharing GPUs round-robin (``cuda:r % n``),
  because NCCL refuses two ranks on one device; logged as a warning and visible in the plan.

:func:`choose_backend` makes that decision as a pure function. Spawned ranks need ``fn`` and the
payload to be picklable (a module-level function). Results travel back pickled through a queue,
tensors moved to CPU first. A rank that raises makes the launcher kill the others and re-raise in
this process (``ConfigError`` and ``CollectiveMismatchError`` keep their type and message; others
become :class:`RankFailedError`), with the rank and its traceback attached (``.rank``,
``.remote_traceback``, and an exception note). A rank still running after ``timeout_s`` gets every
rank killed and a ``TimeoutError`` naming the unfinished ranks. Nothing waits forever.

**torchrun.** The same call works in processes that ``torchrun`` started (one per GPU, any number
of nodes): when ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` are set, ``launch`` initializes from
``env://`` (NCCL on CUDA, rank on ``cuda:LOCAL_RANK``; gloo on CPU), runs ``fn`` on this rank only,
and returns every rank's result on every rank (``all_gather_object``). ``cp_size`` must equal
``WORLD_SIZE``. :func:`run_under_torchrun` returns just this rank's result. A script that calls
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
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError
from reference_impl.cp.comm import CollectiveMismatchError, CPGroup

logger = logging.getLogger(__name__)

R = TypeVar("R")

RANK_ENV_DEFAULTS: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_EXIT_GRACE_S = 2.0  # how long a rank that exited may take to have its result read


class RankFailedError(RuntimeError):
    """A rank raised (or died); the message holds the rank, the original error and its traceback."""

    def __init__(self, message: str, rank: int = -1, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class LaunchSpec:
    """How the ranks run: ``backend`` ("none" in-process, "gloo", "nccl"), one device per rank,
    ``start_method`` ("inline", "fork", "forkserver" inside a Jupyter kernel, "spawn"), and whether
    ranks share GPUs."""

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
) -> LaunchSpec:
    """Decide backend, per-rank devices and start method; pure (the caller passes the machine's facts).

    ``device`` is "auto" | "cpu" | "cuda"; ``backend`` is "auto" | "gloo" | "nccl".
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
    """Intra-op threads each of ``world`` CPU ranks uses (the oracle uses the same, for bitwise-equal math)."""
    return max(1, (os.cpu_count() or 1) // world)


def in_jupyter_kernel() -> bool:
    """True inside a running Jupyter kernel (the walkthrough notebooks), not merely with ipykernel imported."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def under_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launch(
    fn: Callable[[CPGroup, Any], R],
    cp_size: int,
    payload: Any = None,
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 300,
    debug: bool | None = None,
) -> list[R]:
    """Run ``fn(group, payload)`` on ``cp_size`` ranks; return the results ordered by rank.

    ``debug`` (default: ``DSACP_DEBUG``) turns on the CP group's collective recorder, and each rank
    checks the whole sequence once more after ``fn`` returns. See the module docstring for the
    backend choice, error propagation and torchrun.
    """
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if cp_size != world:
            raise ConfigError(f"cp_size={cp_size} but torchrun started WORLD_SIZE={world} ranks")
        return _run_torchrun_rank(fn, payload, device, backend, timeout_s, debug, gather=True)

    plan = choose_backend(
        cp_size,
        device,
        backend,
        torch.cuda.device_count() if torch.cuda.is_available() else 0,
        cuda_initialized=torch.cuda.is_initialized(),
        fork_available="fork" in mp.get_all_start_methods(),
    )
    if plan.shared_gpu:
        logger.warning("launch: %s", plan.describe())
    else:
        logger.info("launch: %s", plan.describe())
    if plan.start_method == "inline":
        group = CPGroup.single(plan.device_per_rank[0], debug=debug)
        return [fn(group, payload)]
    return _run_processes(fn, payload, plan, timeout_s, debug)


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
        raise ConfigError("run_under_torchrun: RANK, WORLD_SIZE and MASTER_ADDR are not set; start with torchrun")
    return _run_torchrun_rank(fn, payload, device, backend, timeout_s, debug, gather=False)


# ------------------------------------------------------------------------------------ internals


def _set_rank_env() -> None:
    for key, value in RANK_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _run_torchrun_rank(
    fn: Callable[[CPGroup, Any], Any], payload: Any, device: str, backend: str, timeout_s: float,
    debug: bool | None, gather: bool,
) -> Any:
    _set_rank_env()
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is visible; use --device cpu")
    rank_device = "cpu"
    if device != "cpu" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        rank_device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        chosen = backend if backend != "auto" else ("nccl" if rank_device != "cpu" else "gloo")
        if chosen == "nccl" and rank_device == "cpu":
            raise ConfigError("NCCL needs CUDA devices; use --backend gloo for CPU ranks")
        dist.init_process_group(chosen, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    # On failure the exception leaves without teardown: torchrun stops the other ranks, and a
    # destroy while a peer sits in a collective could hang.
    group = CPGroup(device=rank_device, debug=debug)
    result = fn(group, payload)
    group.check_consistent()
    if gather:
        results: list[Any] = [None] * group.size
        dist.all_gather_object(results, _to_cpu(result))
        result = results
    if owns_group:
        dist.destroy_process_group()
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_cpu(obj: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) moved to CPU, so results pickle without CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _rank_main(
    rank: int, plan: LaunchSpec, init_method: str, fn: Callable[[CPGroup, Any], Any], payload: Any,
    results: Any, timeout_s: float, debug: bool | None,
) -> None:
    """Body of one rank's process: init, run, send ``("ok", rank, pickled)`` or ``("error", rank, info)``."""
    world = len(plan.device_per_rank)
    try:
        _set_rank_env()
        device = plan.device_per_rank[rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        else:
            # Ranks share this machine's cores; oversubscribed intra-op threads only slow everyone.
            torch.set_num_threads(rank_cpu_threads(world))
        dist.init_process_group(
            plan.backend, init_method=init_method, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
        )
        group = CPGroup(device=device, debug=debug)
        result = fn(group, payload)
        group.check_consistent()  # catches a rank that issued fewer collectives than the others
        results.put(("ok", rank, pickle.dumps(_to_cpu(result))))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        info = {
            "type": type(exc).__qualname__,
            "kind": "config" if isinstance(exc, ConfigError)
            else "mismatch" if isinstance(exc, CollectiveMismatchError) else "other",
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
        results.put(("error", rank, info))
        return  # no destroy: a peer may be stuck in a collective; the parent kills the rest
    # Every rank has its result out; leave together so no peer sees a closed connection mid-collective.
    if plan.backend == "nccl":
        dist.barrier(device_ids=[torch.device(plan.device_per_rank[rank]).index or 0])
    else:
        dist.barrier()
    dist.destroy_process_group()


def _rank_error(rank: int, info: dict[str, str]) -> BaseException:
    message, tb = info["message"], info["traceback"]
    note = f"raised on rank {rank}; traceback from that rank:\n{tb}"
    exc: BaseException
    if info["kind"] == "config":
        exc = ConfigError(message)
    elif info["kind"] == "mismatch":
        exc = CollectiveMismatchError(message)
    else:
        exc = RankFailedError(f"rank {rank} raised {info['type']}: {message}\n\n{note}", rank, tb)
    exc.rank = rank  # type: ignore[attr-defined]
    exc.remote_traceback = tb  # type: ignore[attr-defined]
    if not isinstance(exc, RankFailedError):
        exc.add_note(note)
    return exc


def _stop(processes: list[Any]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _run_processes(
    fn: Callable[[CPGroup, Any], Any], payload: Any, plan: LaunchSpec, timeout_s: float, debug: bool | None
) -> list[Any]:
    ctx = mp.get_context(plan.start_method)
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    world = len(plan.device_per_rank)
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(r, plan, init_method, fn, payload, results, timeout_s, debug),
            name=f"dsacp-rank{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    done: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in processes:
            p.start()
        while len(done) < world:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world)) - set(done))
                raise TimeoutError(
                    f"rank(s) {missing} did not finish within {timeout_s:g} s "
                    f"(finished: {sorted(done)}); all ranks killed"
                )
            try:
                status, rank, body = results.get(timeout=min(0.1, deadline - now))
            except queue_module.Empty:
                for r, p in enumerate(processes):
                    if r in done or p.exitcode is None:
                        continue
                    first_seen = exited_at.setdefault(r, now)
                    if now - first_seen > _EXIT_GRACE_S:
                        raise RankFailedError(
                            f"rank {r} exited with code {p.exitcode} without sending a result", r
                        ) from None
                continue
            if status == "error":
                raise _rank_error(rank, body)
            done[rank] = pickle.loads(body)
        for p in processes:  # let them leave the barrier and exit on their own before the cleanup
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(processes)
        results.close()
    return [done[r] for r in range(world)]
