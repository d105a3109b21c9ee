"""Supervise the rank processes of one launch: start them, collect their results, and end every way
a run can end cleanly, naming the rank at fault.

How each ending is handled (``docs/faults.md`` has the table, ``tests/test_faults.py`` injects each):

* **a rank raises**: it sends the error; the parent stops the others and re-raises it
  (:class:`RankFailedError` naming the rank, with its traceback).
* **a rank dies** (killed by a signal, or exits without a result): the parent notices the exit and
  blames that rank, with the signal. A peer's error that arrives first (gloo's "connection closed
  by peer", which the death caused) is held for a short grace, then reported as the consequence.
* **a hang**: at ``timeout_s`` the parent reads every rank's progress (the collectives it entered
  and left, in shared memory) and names the rank(s) that did not reach the collective the others
  wait in (:class:`RankTimeoutError`).
* **the parent gets SIGTERM** (or SIGINT): an orderly stop (:class:`RunStopped`); every rank is
  terminated, then killed, and the result queue is closed.
* **the parent dies** (even by SIGKILL): every rank exits too. On Linux the kernel signals the rank
  (``PR_SET_PDEATHSIG``); everywhere a watchdog thread in the rank polls its parent.

Nothing is left behind: no process, no ``/dev/shm`` semaphore (the queue's are unlinked when the
parent closes it, or by multiprocessing's resource tracker once the last rank is gone), no port
(the rendezvous store lives in rank 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError
from reference_impl.cp.comm import CollectiveMismatchError, CPGroup, report_progress_to
from reference_impl.errors import RankFailedError, RankTimeoutError, RunStopped

RANK_ENV_DEFAULTS: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_EXIT_GRACE_S = 2.0  # how long a rank that exited may take to have its result read
_BLAME_GRACE_S = 1.0  # how long a peer's error waits for the death that may have caused it
_TAG_BYTES = 48
# Blocked while the ranks start: each rank installs its own handling first (rank_main), so a stop
# (the parent's timeout, SIGTERM, Ctrl-C) that lands during a rank's start prints nothing from it.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_PARENT_POLL_S = 0.5
EXIT_PARENT_DIED = 86  # a rank's exit code when it leaves because its parent died


def set_rank_env() -> None:
    """The environment every rank needs (NVLink multicast off on the multi-GPU boxes)."""
    for key, value in RANK_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def to_cpu(obj: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) moved to CPU, so results pickle without CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ---- progress: which collective each rank is in ------------------------------------------------


class SharedProgress:
    """Per rank, in shared memory: collectives entered, collectives left, the last one's tag, and
    the steps of work done (:func:`~reference_impl.cp.comm.note_step`)."""

    def __init__(self, ctx: Any, world: int) -> None:
        self.world = world
        self.counts = ctx.Array(ctypes.c_int64, 2 * world, lock=False)  # [entered, left] per rank
        self.steps = ctx.Array(ctypes.c_int64, world, lock=False)
        self.tags = ctx.Array(ctypes.c_char, _TAG_BYTES * world, lock=False)
        self.rank = -1

    def bind(self, rank: int) -> SharedProgress:
        self.rank = rank
        return self

    def enter(self, op: str, tag: str) -> None:
        label = f"{op}[{tag}]".encode()[: _TAG_BYTES - 1]
        start = _TAG_BYTES * self.rank
        self.tags[start : start + _TAG_BYTES] = label.ljust(_TAG_BYTES, b"\0")
        self.counts[2 * self.rank] += 1

    def leave(self) -> None:
        self.counts[2 * self.rank + 1] += 1

    def step(self) -> None:
        self.steps[self.rank] += 1

    def slowest_steps(self) -> int:
        """Steps done by the rank that is furthest behind."""
        return min(self.steps[r] for r in range(self.world))

    def state(self, rank: int) -> tuple[int, int, str]:
        """``(entered, left, last tag)`` of ``rank``."""
        start = _TAG_BYTES * rank
        tag = bytes(self.tags[start : start + _TAG_BYTES]).rstrip(b"\0").decode(errors="replace")
        return self.counts[2 * rank], self.counts[2 * rank + 1], tag


def describe_hang(states: dict[int, tuple[int, int, str]], unfinished: list[int]) -> tuple[str, list[int]]:
    """Which ranks a hang left behind, from every rank's ``(entered, left, tag)`` -> ``(message, culprits)``."""
    furthest = max(entered for entered, _, _ in states.values())
    waiting = [r for r in unfinished if states[r][0] == furthest and states[r][0] > states[r][1]]
    behind = [r for r in unfinished if states[r][0] < furthest]
    if waiting and behind:
        tag = states[waiting[0]][2]
        return (
            f"rank(s) {behind} did not reach collective #{furthest} ({tag}), which rank(s) {waiting} are waiting in"
        ), behind
    inside = {r: states[r] for r in unfinished if states[r][0] > states[r][1]}
    if inside:
        where = "; ".join(f"rank {r} in collective #{e} ({t})" for r, (e, _, t) in inside.items())
        return f"rank(s) {unfinished} did not finish: {where}", unfinished
    return f"rank(s) {unfinished} did not finish (computing after collective #{furthest})", unfinished


# ---- the rank side ------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Exit when the launching process dies.

    Where the launcher is this process's parent (fork, spawn) the kernel sends the parent-death
    signal (Linux, ``PR_SET_PDEATHSIG``); a watchdog thread covers every start method, forkserver
    included (there the parent is the fork server): multiprocessing's sentinel of the launching
    process reads end-of-file when it dies.
    """
    libc_name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and libc_name and os.getppid() == parent:
        pr_set_pdeathsig = 1
        ctypes.CDLL(libc_name, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    launcher = mp.parent_process()

    def watch() -> None:
        while launcher is None or launcher.is_alive():
            time.sleep(_PARENT_POLL_S)
        os._exit(EXIT_PARENT_DIED)

    if launcher is not None:
        threading.Thread(target=watch, name="dsacp-parent-watch", daemon=True).start()


def rank_main(
    rank: int,
    parent: int,
    backend: str,
    devices: tuple[str, ...],
    init_method: str,
    fn: Callable[[CPGroup, Any], Any],
    payload: Any,
    results: Any,
    progress: SharedProgress,
    timeout_s: float,
    debug: bool | None,
    cpu_threads: int,
) -> None:
    """Body of one rank's process: init, run, send ``("ok", rank, pickled)`` or ``("error", rank, info)``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked rank must not inherit the parent's orderly stop
    # Ctrl-C reaches every process of the terminal's group: the parent stops the ranks (SIGTERM), so
    # a rank ignores it rather than print a KeyboardInterrupt of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The launcher started this process with SIGTERM and SIGINT blocked (:data:`_STOP_SIGNALS`): a
    # stop that came while it was starting ends it here, quietly, not as a traceback out of
    # multiprocessing's bootstrap.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _die_with_parent(parent)
    world = len(devices)
    try:
        set_rank_env()
        device = devices[rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        else:
            torch.set_num_threads(cpu_threads)  # ranks share the cores; oversubscription slows everyone
        report_progress_to(progress.bind(rank))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
        )
        group = CPGroup(device=device, debug=debug)
        result = fn(group, payload)
        group.check_consistent()  # catches a rank that issued fewer collectives than the others
        results.put(("ok", rank, pickle.dumps(to_cpu(result))))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        info = {
            "type": type(exc).__qualname__,
            "kind": "config"
            if isinstance(exc, ConfigError)
            else "mismatch"
            if isinstance(exc, CollectiveMismatchError)
            else "other",
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
        results.put(("error", rank, info))
        return  # no destroy: a peer may be stuck in a collective; the parent stops the rest
    # Every rank has its result out; leave together so no peer sees a closed connection mid-collective.
    if backend == "nccl":
        dist.barrier(device_ids=[torch.device(devices[rank]).index or 0])
    else:
        dist.barrier()
    dist.destroy_process_group()


# ---- the parent side ----------------------------------------------------------------------------


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
    if isinstance(exc, RankFailedError):  # its constructor set ``rank`` and ``remote_traceback``
        return exc
    # ConfigError and CollectiveMismatchError keep their types (callers catch them by type); the
    # rank and its traceback ride along as attributes, as on RankFailedError.
    vars(exc).update(rank=rank, remote_traceback=tb)
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # BaseException.add_note is 3.11+; 3.10 would raise AttributeError here
        vars(exc).update(__notes__=[note])
    return exc


def _death(rank: int, exitcode: int) -> RankFailedError:
    if exitcode < 0:
        return RankFailedError(f"rank {rank} was killed by {signal.Signals(-exitcode).name} (exit {exitcode})", rank)
    return RankFailedError(f"rank {rank} exited with code {exitcode} without sending a result", rank)


def _first_death(processes: list[Any], reported: set[int]) -> tuple[int, int] | None:
    """A rank that exited abnormally without reporting anything (no result, no error)."""
    for rank, p in enumerate(processes):
        if rank not in reported and p.exitcode is not None and p.exitcode != 0:
            return rank, p.exitcode
    return None


def _drain(results: Any, done: dict[int, Any], errors: dict[int, Any]) -> None:
    """Read what is waiting in the result queue without blocking."""
    while True:
        try:
            status, rank, body = results.get_nowait()
        except queue_module.Empty:
            return
        if status == "error":
            errors.setdefault(rank, body)
        else:
            done[rank] = pickle.loads(body)


def _stop(processes: list[Any]) -> None:
    processes = [p for p in processes if p.pid is not None]  # those that started
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


class _OrderlyStop:
    """While active (main thread only), SIGTERM raises :class:`RunStopped` so cleanup runs."""

    def __enter__(self) -> _OrderlyStop:
        self.previous = None
        if threading.current_thread() is threading.main_thread():

            def stop(signum: int, frame: Any) -> None:
                raise RunStopped(signum)

            self.previous = signal.signal(signal.SIGTERM, stop)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def run_rank_processes(
    fn: Callable[[CPGroup, Any], Any],
    payload: Any,
    backend: str,
    devices: tuple[str, ...],
    start_method: str,
    timeout_s: float,
    debug: bool | None,
    cpu_threads: int,
    on_poll: Callable[[SharedProgress], None] | None = None,
) -> list[Any]:
    """Run ``fn`` on one process per entry of ``devices``; results by rank (see the module docstring).

    ``on_poll`` is called with the ranks' progress about ten times a second while they run.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The server imports torch and this package once; each rank is then a cheap fork of it.
        ctx.set_forkserver_preload(["reference_impl.runner"])
    world = len(devices)
    results = ctx.Queue()
    progress = SharedProgress(ctx, world)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    # The process group's own timeout comes later than ours, so the parent decides who hung.
    group_timeout = timeout_s + 30.0
    processes = [
        ctx.Process(
            target=rank_main,
            name=f"dsacp-rank{r}",
            daemon=True,
            args=(
                r,
                os.getpid(),
                backend,
                devices,
                init_method,
                fn,
                payload,
                results,
                progress,
                group_timeout,
                debug,
                cpu_threads,
            ),
        )
        for r in range(world)
    ]
    done: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with _OrderlyStop():
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                for rank, p in enumerate(processes):
                    try:
                        p.start()
                    except OSError as exc:  # e.g. a TMPDIR too long for the forkserver's Unix socket
                        raise RankFailedError(f"rank {rank} could not start ({start_method}): {exc}", rank) from exc
            finally:  # a stop that came meanwhile is delivered here, to this process's handler
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            while len(done) < world:
                if on_poll is not None:
                    on_poll(progress)
                now = time.monotonic()
                if now >= deadline:
                    unfinished = sorted(set(range(world)) - set(done))
                    message, culprits = describe_hang({r: progress.state(r) for r in range(world)}, unfinished)
                    raise RankTimeoutError(f"{message}, within {timeout_s:g} s; all ranks stopped", culprits[0])
                try:
                    status, rank, body = results.get(timeout=min(0.1, deadline - now))
                except queue_module.Empty:
                    for r, p in enumerate(processes):
                        if r in done or p.exitcode is None:
                            continue
                        if p.exitcode < 0:  # killed by a signal: it cannot have sent anything
                            raise _death(r, p.exitcode) from None
                        if now - exited_at.setdefault(r, now) > _EXIT_GRACE_S:
                            raise _death(r, p.exitcode) from None
                    continue
                if status == "error":
                    # A peer's death causes errors in the ranks waiting for it: blame the death. Read
                    # what else the ranks sent first, so a rank that reported is never taken for dead.
                    errors = {rank: body}
                    until = time.monotonic() + _BLAME_GRACE_S
                    while time.monotonic() < until:
                        _drain(results, done, errors)
                        if _first_death(processes, set(done) | set(errors)) is not None:
                            break
                        time.sleep(0.05)
                    death = _first_death(processes, set(done) | set(errors))
                    if death is not None:
                        consequence = f"; then rank {rank} raised {body['type']}: {body['message']}"
                        raise RankFailedError(str(_death(*death)) + consequence, death[0]) from None
                    raise _rank_error(rank, body)
                done[rank] = pickle.loads(body)
            for p in processes:  # let them leave the barrier and exit on their own before the cleanup
                p.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(processes)
        results.close()
        results.cancel_join_thread()
    return [done[r] for r in range(world)]
