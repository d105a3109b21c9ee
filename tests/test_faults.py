"""Faults: a signal, a dead rank or a hang ends a run cleanly, names the culprit, and leaves nothing.

Each test injects one fault (``tests/fault_driver.py`` holds the misbehaving rank functions and a
driver process) and checks what the run does, its exit code, and what is left: no rank process,
no ``/dev/shm`` semaphore, no ``pymp-*`` temp directory. ``docs/faults.md`` tabulates them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fault_driver import die_by_sigkill_on_rank2, exit_without_result_on_rank1, hang_before_the_gather_on_rank1

from reference_impl import runner
from reference_impl.cli import main
from reference_impl.errors import RankFailedError, RankTimeoutError
from reference_impl.launch import launch

DRIVER = Path(__file__).resolve().parent / "fault_driver.py"
ROOT = DRIVER.parent.parent


def _leftovers(tmpdir: Path, driver_pid: int) -> set[str]:
    """What the driver's run could leave behind: its semaphores (named after it, ``tests/fault_driver.py``)
    and multiprocessing's temp directories under its own ``TMPDIR``. Other pytest-xdist workers' runs
    make semaphores of their own meanwhile; the names keep them apart."""
    prefix = f"sem.mp-fault{driver_pid}-"
    shm = (
        {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(prefix)}
        if os.path.isdir("/dev/shm")
        else set()
    )
    return shm | {str(p) for p in tmpdir.glob("pymp-*")}


def _left_behind(tmpdir: Path, driver_pid: int, seconds: float = 5) -> set[str]:
    """:func:`_leftovers` once the resource tracker has had ``seconds`` to unlink what the ranks left."""
    deadline = time.monotonic() + seconds
    while (left := _leftovers(tmpdir, driver_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def run_tmp():
    """The driver's own ``TMPDIR``, so its multiprocessing folders are told apart from other workers'
    (short: the forkserver's socket lives there, and a Unix socket path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dsacp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start_driver(
    start_method: str, piddir: Path, tmpdir: Path, as_background_job: bool = False
) -> tuple[subprocess.Popen, list[int]]:
    """Start the fault driver with ``TMPDIR=tmpdir``; ``as_background_job``: with SIGINT ignored, as a
    shell starts ``cmd &``."""
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), start_method, str(piddir)],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if as_background_job else None,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    deadline = time.monotonic() + 60
    while len(list(piddir.glob("rank*"))) < 4:
        if proc.poll() is not None:
            pytest.fail(f"the driver exited {proc.returncode} before its ranks started: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    time.sleep(0.5)  # ranks 1-3 are in the all-gather now
    return proc, [int(p.read_text()) for p in sorted(piddir.glob("rank*"))]


def _exit_code(proc: subprocess.Popen, seconds: float = 60) -> int:
    """The driver's exit code; if it does not exit in time, fail with its threads' stacks (a loaded
    machine is slow, a deadlock never ends: the stacks say which)."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        pytest.fail(f"the driver did not exit within {seconds} s; its stacks:\n{proc.communicate()[1][-6000:]}")


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_sigterm_to_the_parent_stops_every_rank_and_leaves_nothing(
    tmp_path: Path, run_tmp: Path, start_method: str
) -> None:
    proc, pids = _start_driver(start_method, tmp_path, run_tmp)
    proc.send_signal(signal.SIGTERM)
    assert _exit_code(proc) == 128 + signal.SIGTERM
    assert _wait_gone(pids, 5) == []
    assert _left_behind(run_tmp, proc.pid) == set()


@pytest.mark.parametrize("as_background_job", [False, True])
def test_sigint_to_the_parent_stops_every_rank(tmp_path: Path, run_tmp: Path, as_background_job: bool) -> None:
    proc, pids = _start_driver("fork", tmp_path, run_tmp, as_background_job)
    proc.send_signal(signal.SIGINT)
    assert _exit_code(proc) == 128 + signal.SIGINT
    assert _wait_gone(pids, 5) == []
    assert _left_behind(run_tmp, proc.pid) == set()


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_a_killed_parent_takes_its_ranks_along(tmp_path: Path, run_tmp: Path, start_method: str) -> None:
    proc, pids = _start_driver(start_method, tmp_path, run_tmp)
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_gone(pids, 5) == []
    left = _left_behind(run_tmp, proc.pid)  # the resource tracker unlinks the semaphores once the ranks are gone
    assert {p for p in left if "sem.mp-" in p} == set()
    if start_method == "fork":
        assert left == set()


def test_a_killed_rank_is_named_with_its_signal_not_its_peers_error() -> None:
    for _ in range(3):  # the peers' "connection closed" must never win
        with pytest.raises(RankFailedError, match=r"^rank 2 was killed by SIGKILL \(exit -9\)") as info:
            launch(die_by_sigkill_on_rank2, 4, None, device="cpu", timeout_s=60)
        assert info.value.rank == 2


def test_a_rank_that_exits_without_a_result_is_named() -> None:
    with pytest.raises(RankFailedError, match=r"^rank 1 exited with code 5 without sending a result") as info:
        launch(exit_without_result_on_rank1, 3, None, device="cpu", timeout_s=60)
    assert info.value.rank == 1


def test_a_hang_names_the_rank_that_did_not_reach_the_collective() -> None:
    start = time.monotonic()
    with pytest.raises(
        RankTimeoutError,
        match=(
            r"rank\(s\) \[1\] did not reach collective #1 \(all_gather\[kv\]\), "
            r"which rank\(s\) \[0, 2\] are waiting in, "
            r"within 3 s"
        ),
    ) as info:
        launch(hang_before_the_gather_on_rank1, 3, None, device="cpu", timeout_s=3)
    assert info.value.rank == 1 and time.monotonic() - start < 10


def _failing_run_rank(group, run):  # noqa: ANN001
    if group.rank == 1:
        raise RuntimeError("boom on purpose")
    return ORIGINAL_RUN_RANK(group, run)


def _hanging_run_rank(group, run):  # noqa: ANN001
    if group.rank == 1:
        time.sleep(3600)
    return ORIGINAL_RUN_RANK(group, run)


ORIGINAL_RUN_RANK = runner.run_rank


def test_the_cli_exits_3_naming_the_failed_rank(forked_ranks, capsys) -> None:
    forked_ranks.setattr(runner, "run_rank", _failing_run_rank)  # forked ranks inherit the patch
    assert main(["run", "--requests", "0+40"]) == 3
    err = capsys.readouterr().err
    # One line; the rank's traceback goes to a log file that the line names.
    found = re.fullmatch(r"error: rank 1 raised RuntimeError: boom on purpose \(the rank's traceback: (\S+)\)\n", err)
    assert found, err
    log = Path(found.group(1))
    try:
        assert "Traceback" in log.read_text() and "boom on purpose" in log.read_text()
    finally:
        log.unlink()
    assert main(["run", "--requests", "0+40", "--debug"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: rank 1 raised RuntimeError: boom on purpose"
    assert err[1] == "traceback from rank 1:" and "Traceback" in err[2] and "boom on purpose" in err[-1]


def test_the_timeout_knob_ends_a_hang_with_exit_3(forked_ranks, capsys) -> None:
    forked_ranks.setattr(runner, "run_rank", _hanging_run_rank)
    forked_ranks.setenv("DSACP_TIMEOUT_S", "3")
    start = time.monotonic()
    assert main(["run", "--requests", "0+40"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: rank(s) [1] did not reach collective #1 (all_gather[kv])") and "within 3 s" in err
    assert time.monotonic() - start < 15


def _torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_torchrun_prints_one_report_from_rank_0() -> None:
    proc = _torchrun(
        "-m", "reference_impl", "run", "--cp-size", "2", "--requests", "0+40,9+30", "--device", "cpu", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # exactly one JSON document: nothing else on stdout
    assert report["matches_oracle"] is True and report["cp_size"] == 2 and len(report["per_rank"]) == 2


def test_torchrun_names_the_rank_that_hung_as_the_root_cause() -> None:
    proc = _torchrun(str(DRIVER), "torchrun-hang")
    assert proc.returncode != 0
    assert "error: rank 1: no result within 3 s: did not reach collective #1" in proc.stderr
    root_cause = proc.stderr[proc.stderr.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "exitcode  : 3" in root_cause


def test_a_rank_that_cannot_start_is_named_and_nothing_is_joined(tmp_path: Path) -> None:
    """The forkserver's socket in a ``TMPDIR`` too long for a Unix socket path (a fresh process: a
    forkserver already running would not need one): the start fails with one error naming the rank
    and the cause, not a traceback from stopping processes that never ran."""
    long_dir = Path(tempfile.mkdtemp(prefix="dsacp-")) / ("x" * 110)
    long_dir.mkdir()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from fault_driver import write_pid_then_wait; "
        "from reference_impl.rank_processes import run_rank_processes; "
        "run_rank_processes(write_pid_then_wait, sys.argv[2], 'gloo', ('cpu',) * 2, 'forkserver', 30, False, 1)"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TMPDIR": str(long_dir)},
        )
    finally:
        shutil.rmtree(long_dir.parent, ignore_errors=True)
    assert done.returncode == 1
    assert re.search(r"RankFailedError: rank 0 could not start \(forkserver\): .*too long", done.stderr), done.stderr[
        -2000:
    ]
    assert "can only join a started process" not in done.stderr
