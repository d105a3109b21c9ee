"""Rank functions that misbehave on purpose, and a driver process for the fault tests.

``python tests/fault_driver.py START_METHOD PIDDIR`` starts 4 CPU ranks that write their pids into
PIDDIR and then wait forever in an all-gather; it exits with the CLI's codes (143 on SIGTERM).
Under torchrun (``torchrun --nproc-per-node 2 tests/fault_driver.py torchrun-hang``) rank 1 hangs
before the first collective while rank 0 waits in it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference_impl.cp.comm import CPGroup  # noqa: E402
from reference_impl.errors import RunStopped  # noqa: E402


def write_pid_then_wait(group: CPGroup, piddir: str) -> None:
    Path(piddir, f"rank{group.rank}").write_text(str(os.getpid()))
    if group.rank == 0:
        time.sleep(3600)  # the others wait for it in the all-gather
    group.all_gather_padded(torch.ones(1, 2), [1] * group.size, tag="kv")


def die_by_sigkill_on_rank2(group: CPGroup, payload: Any) -> None:
    if group.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    group.all_gather_padded(torch.ones(1, 2), [1] * group.size, tag="kv")


def exit_without_result_on_rank1(group: CPGroup, payload: Any) -> None:
    if group.rank == 1:
        os._exit(5)
    group.all_gather_padded(torch.ones(1, 2), [1] * group.size, tag="kv")


def hang_before_the_gather_on_rank1(group: CPGroup, payload: Any) -> None:
    if group.rank == 1:
        time.sleep(3600)
    group.all_gather_padded(torch.ones(1, 2), [1] * group.size, tag="kv")


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits in vain asks where it is stuck
    # A shell starts background jobs with SIGINT ignored, and children inherit that (scripts/test.sh
    # runs the CPU tier in the background on a CUDA machine): the SIGINT test sends it on purpose.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if argv[0] == "torchrun-hang":
        from reference_impl.launch import launch

        launch(hang_before_the_gather_on_rank1, int(os.environ["WORLD_SIZE"]), None, device="cpu", timeout_s=3)
        return 0
    from reference_impl.rank_processes import run_rank_processes

    # Name this run's semaphores after this process (multiprocessing's prefix for SemLock names), so the
    # test tells them apart from other pytest-xdist workers' runs: ``/dev/shm/sem.mp-fault<pid>-*``.
    multiprocessing.current_process()._config["semprefix"] = f"/mp-fault{os.getpid()}"

    start_method, piddir = argv
    try:
        run_rank_processes(write_pid_then_wait, piddir, "gloo", ("cpu",) * 4, start_method, 600, False, 1)
    except RunStopped as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
