"""CPGroup collectives and the launcher, on CPU ranks (gloo, fork)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference_impl.config import ConfigError
from reference_impl.cp.comm import CollectiveEntry, CollectiveMismatchError, CollectiveRecorder, CPGroup, first_mismatch
from reference_impl.launch import LaunchSpec, RankFailedError, choose_backend, launch

DTYPES = (torch.bfloat16, torch.float32, torch.uint8)


def rank_rows(rank: int, n: int, width: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rows that identify their rank and position, exactly representable in every tested dtype."""
    base = torch.arange(n * max(1, torch.Size(width).numel()), dtype=torch.float32).reshape(n, *width)
    return ((base + 37 * rank + salt) % 200).to(dtype)


def make_cases(cp_size: int, seed: int) -> list[tuple[list[int], tuple[int, ...], str]]:
    rng = random.Random(seed)
    cases: list[tuple[list[int], tuple[int, ...], str]] = []
    for i in range(12):
        lengths = [rng.randint(0, 9) for _ in range(cp_size)]
        width = rng.choice([(3,), (2, 5), ()])
        cases.append((lengths, width, str(DTYPES[i % 3]).removeprefix("torch.")))
    cases.append(([4] * cp_size, (6,), "bfloat16"))  # equal lengths: no padding
    cases.append(([0] * cp_size, (6,), "float32"))  # nothing to move
    cases.append(([0] * (cp_size - 1) + [5], (2,), "uint8"))  # all rows on the last rank
    return cases


def gather_cases(group: CPGroup, cases: list[tuple[list[int], tuple[int, ...], str]]) -> list[Any]:
    out = []
    for salt, (lengths, width, dtype_name) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        local = rank_rows(group.rank, lengths[group.rank], width, dtype, salt)
        before = len(group.stats)
        got = group.all_gather_padded(local, lengths, tag=f"case{salt}")
        out.append((got, group.stats[before:]))
    return out


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_all_gather_padded_rank_major(cp_size: int) -> None:
    cases = make_cases(cp_size, seed=cp_size)
    per_rank = launch(gather_cases, cp_size, cases, device="cpu", timeout_s=60)
    assert len(per_rank) == cp_size
    for rank, results in enumerate(per_rank):
        for salt, ((lengths, width, dtype_name), (got, records)) in enumerate(zip(cases, results)):
            dtype = getattr(torch, dtype_name)
            expected = torch.cat([rank_rows(r, n, width, dtype, salt) for r, n in enumerate(lengths)])
            assert got.dtype == dtype and got.shape == (sum(lengths), *width), (rank, salt)
            assert torch.equal(got, expected), (rank, salt)
            padded = max(lengths) * torch.Size(width).numel() * dtype.itemsize
            if cp_size == 1 or padded == 0:
                assert records == []  # no collective runs
            else:
                (rec,) = records
                assert (rec.op, rec.tag, rec.shape) == ("all_gather", f"case{salt}", (max(lengths), *width))
                assert rec.bytes_sent == padded
                assert rec.bytes_received == (cp_size - 1) * padded
                assert rec.buffer_bytes == cp_size * padded


def raw_gather(group: CPGroup, lengths: list[int]) -> tuple[torch.Tensor, dict[str, int]]:
    local = torch.full((lengths[group.rank], 2), float(group.rank + 1))
    raw = group.all_gather_rows_padded_raw(local, lengths, tag="raw")
    group.barrier()
    return raw, group.stats_summary()


def test_raw_gather_keeps_padded_slots() -> None:
    lengths = [1, 3]
    (raw0, summary), (raw1, _) = launch(raw_gather, 2, lengths, device="cpu", timeout_s=30)
    assert raw0.shape == (2, 3, 2) and torch.equal(raw0, raw1)
    assert torch.equal(raw0[0, :1], torch.ones(1, 2)) and torch.equal(raw0[1], torch.full((3, 2), 2.0))
    assert torch.equal(raw0[0, 1:], torch.zeros(2, 2))  # this rank's own padding is zeroed
    assert summary == {"collectives": 2, "bytes_sent": 24, "bytes_received": 24, "buffer_bytes": 48}


def test_single_rank_group_needs_no_process_group() -> None:
    group = CPGroup.single()
    x = torch.randn(5, 3)
    assert (group.rank, group.size, group.device) == (0, 1, torch.device("cpu"))
    assert group.all_gather_padded(x, [5], tag="kv") is x
    assert group.all_gather_rows_padded_raw(x, [5], tag="kv").shape == (1, 5, 3)
    with pytest.raises(ConfigError, match="2 lengths for a CP group of 1"):
        group.all_gather_padded(x, [5, 1], tag="kv")
    with pytest.raises(ConfigError, match="lengths\\[0\\]=4"):
        group.all_gather_padded(x, [4], tag="kv")


# ------------------------------------------------------------------------------- backend choice


def test_choose_backend_cpu() -> None:
    assert choose_backend(4, "auto", "auto", 0) == LaunchSpec("gloo", ("cpu",) * 4, "fork", False)
    assert choose_backend(2, "cpu", "auto", 8, cuda_initialized=True).start_method == "spawn"
    assert choose_backend(1, "cpu", "auto", 0) == LaunchSpec("none", ("cpu",), "inline", False)
    # Ranks of several threads never fork: GNU OpenMP's pool does not survive it.
    assert choose_backend(2, "cpu", "auto", 0, rank_threads=8).start_method == "forkserver"
    assert choose_backend(2, "cpu", "auto", 0, rank_threads=1).start_method == "fork"
    with pytest.raises(ConfigError, match="NCCL needs CUDA"):
        choose_backend(2, "cpu", "nccl", 0)


def test_choose_backend_shared_gpu() -> None:
    plan = choose_backend(4, "auto", "auto", 1)
    assert plan == LaunchSpec("gloo", ("cuda:0",) * 4, "spawn", True)
    assert "share GPUs" in plan.describe()
    assert choose_backend(3, "cuda", "auto", 2).device_per_rank == ("cuda:0", "cuda:1", "cuda:0")


def test_choose_backend_nccl() -> None:
    plan = choose_backend(8, "auto", "auto", 8)
    assert plan == LaunchSpec("nccl", tuple(f"cuda:{r}" for r in range(8)), "spawn", False)
    assert choose_backend(2, "cuda", "gloo", 8).backend == "gloo"


def test_choose_backend_nccl_too_few_gpus() -> None:
    with pytest.raises(
        ConfigError, match=r"NCCL needs one GPU per rank: cp_size=4 but 1 CUDA device\(s\); use --backend gloo"
    ):
        choose_backend(4, "auto", "nccl", 1)
    with pytest.raises(ConfigError, match="no CUDA device"):
        choose_backend(2, "cuda", "auto", 0)
    with pytest.raises(ConfigError, match="device='tpu'"):
        choose_backend(2, "tpu", "auto", 0)


@given(
    cp_size=st.integers(1, 16),
    device=st.sampled_from(["auto", "cpu", "cuda"]),
    backend=st.sampled_from(["auto", "gloo", "nccl"]),
    cuda_count=st.integers(0, 8),
)
def test_choose_backend_invariants(cp_size: int, device: str, backend: str, cuda_count: int) -> None:
    try:
        plan = choose_backend(cp_size, device, backend, cuda_count)
    except ConfigError:
        assert (
            backend == "nccl"
            and cuda_count < cp_size
            or device == "cuda"
            and cuda_count == 0
            or (backend == "nccl" and device == "cpu")
        )
        return
    assert len(plan.device_per_rank) == cp_size
    assert plan.shared_gpu == (len(set(plan.device_per_rank)) < cp_size and plan.device_per_rank[0] != "cpu")
    if plan.backend == "nccl":
        assert not plan.shared_gpu and plan.start_method == "spawn"
    if plan.device_per_rank[0] == "cpu":
        assert plan.backend in ("gloo", "none") and plan.start_method in ("fork", "inline")
    threaded = choose_backend(cp_size, device, backend, cuda_count, rank_threads=2)
    assert threaded.start_method in ("forkserver", "spawn", "inline")
    assert (plan.backend == "none") == (cp_size == 1)


def threaded_matmul(group: CPGroup, payload: Any) -> tuple[int, float]:
    a = torch.ones(512, 512)
    return torch.get_num_threads(), float((a @ a).sum() + torch.softmax(a, -1).sum())


def test_rank_threads_knob() -> None:
    import os

    from reference_impl.config import ConfigError
    from reference_impl.launch import rank_cpu_threads
    from reference_impl.machine import cpu_cores

    saved = os.environ.get("DSACP_RANK_THREADS")
    try:
        os.environ["DSACP_RANK_THREADS"] = str(cpu_cores())
        assert rank_cpu_threads(4) == cpu_cores()
        del os.environ["DSACP_RANK_THREADS"]
        assert rank_cpu_threads(1) == cpu_cores()
        for bad in ("0", "many", "", str(cpu_cores() + 1)):  # a thread per core at most
            os.environ["DSACP_RANK_THREADS"] = bad
            with pytest.raises(ConfigError, match="DSACP_RANK_THREADS"):
                rank_cpu_threads(2)
    finally:
        os.environ.pop("DSACP_RANK_THREADS", None)
        if saved is not None:
            os.environ["DSACP_RANK_THREADS"] = saved


def test_ranks_of_several_threads_run_after_the_parent_used_its_thread_pool(monkeypatch) -> None:
    """The hang the H200 box showed: ranks forked after the parent ran an OpenMP parallel region
    deadlock in their first parallel region. The launcher must start them another way."""
    monkeypatch.setenv("DSACP_RANK_THREADS", "2")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.ones(512, 512)
        assert float((a @ a).sum()) == 512.0**3  # the parent's pool is now up
        results = launch(threaded_matmul, 2, None, device="cpu", timeout_s=60)
    finally:
        torch.set_num_threads(threads)
    assert [r[0] for r in results] == [2, 2]
    assert all(r[1] == pytest.approx(512.0**3 + 512.0) for r in results)


# ------------------------------------------------------------------------------------ failures


def raise_config_on_rank1(group: CPGroup, payload: Any) -> int:
    if group.rank == 1:
        raise ConfigError("page_size=3: must be a power of two")
    group.barrier()  # rank 0 would wait here forever: the launcher must kill it
    return group.rank


def test_rank_config_error_propagates() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        launch(raise_config_on_rank1, 2, None, device="cpu", timeout_s=20)
    assert str(info.value) == "page_size=3: must be a power of two"
    assert info.value.rank == 1  # type: ignore[attr-defined]
    assert "raise_config_on_rank1" in info.value.remote_traceback  # type: ignore[attr-defined]
    assert time.monotonic() - start < 10


def raise_value_error(group: CPGroup, payload: Any) -> None:
    if group.rank == payload:
        raise KeyError("boom")


def test_rank_other_error_names_rank_and_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"rank 2 raised KeyError: 'boom'") as info:
        launch(raise_value_error, 3, 2, device="cpu", timeout_s=20)
    assert info.value.rank == 2 and "raise_value_error" in str(info.value)


def mismatched_sequence(group: CPGroup, mode: str) -> str:
    try:
        if mode == "tag":
            group.all_gather_padded(torch.zeros(2, 4), [2] * group.size, tag="kv" if group.rank == 0 else "index")
        else:  # rank 1 issues one collective fewer; the launcher's closing check catches it
            group.all_gather_padded(torch.zeros(1, 4), [1, 1], tag="kv")
            if group.rank == 0:
                group.barrier(tag="extra")
    except CollectiveMismatchError as exc:
        group.recorder = CollectiveRecorder()  # start over, so the launcher's closing check passes
        return str(exc)
    return "no error"


def test_debug_mismatch_raises_on_all_ranks() -> None:
    messages = launch(mismatched_sequence, 3, "tag", device="cpu", timeout_s=20, debug=True)
    for msg in messages:
        assert "collective #0: rank 0: all_gather[kv]" in msg and "rank 1: all_gather[index]" in msg


def gather_with_tag_per_rank(group: CPGroup, payload: Any) -> None:
    group.all_gather_padded(torch.zeros(2, 4), [2, 2], tag=f"kv{group.rank}")


def test_debug_mismatch_propagates_from_launch() -> None:
    with pytest.raises(CollectiveMismatchError, match="collective #0"):
        launch(gather_with_tag_per_rank, 2, None, device="cpu", timeout_s=20, debug=True)


def test_debug_missing_collective_detected() -> None:
    with pytest.raises(CollectiveMismatchError, match=r"collective #1: rank 0: barrier\[extra\].*rank 1: <none"):
        launch(mismatched_sequence, 2, "count", device="cpu", timeout_s=20, debug=True)


def test_debug_off_records_nothing() -> None:
    group = CPGroup.single(debug=False)
    group.all_gather_padded(torch.zeros(1), [1], tag="kv")
    assert group.recorder is None


def test_recorder_digest_and_first_mismatch() -> None:
    a, b = CollectiveRecorder(), CollectiveRecorder()
    for rec in (a, b):
        rec.record(CollectiveEntry("all_gather", "kv", (4, 576), "bfloat16"))
    assert a.digest() == b.digest() and len(a.digest()) == 40
    b.record(CollectiveEntry("barrier", "x", (), "none"))
    assert a.digest() != b.digest()
    assert first_mismatch([["a", "b"], ["a", "c"]]) == 1
    assert first_mismatch([["a"], ["a", "b"]]) == 1
    assert first_mismatch([["a"], ["a"]]) is None


def hang_on_rank1(group: CPGroup, payload: Any) -> int:
    if group.rank == 1:
        time.sleep(60)
    return group.rank


def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[1\] did not finish \(computing after collective #0\), within 5 s"
    ):
        launch(hang_on_rank1, 2, None, device="cpu", timeout_s=5)
    assert time.monotonic() - start < 9


def report_world(group: CPGroup, payload: Any) -> tuple[int, int, str, torch.Tensor]:
    return group.rank, group.size, group.backend, group.all_gather_padded(torch.ones(2, 3), [2], tag="kv")


def test_torchrun_env_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from reference_impl.launch import run_under_torchrun, under_torchrun
    from reference_impl.rank_processes import free_port as _free_port

    with pytest.raises(ConfigError, match="start with torchrun"):
        run_under_torchrun(report_world, None)
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    assert under_torchrun()
    with pytest.raises(ConfigError, match="cp_size=2 but torchrun started WORLD_SIZE=1"):
        launch(report_world, 2, None)
    ((rank, size, backend, rows),) = launch(report_world, 1, None)
    assert (rank, size, backend) == (0, 1, "gloo") and torch.equal(rows, torch.ones(2, 3))
    assert run_under_torchrun(report_world, None)[:3] == (0, 1, "gloo")
    assert not torch.distributed.is_initialized()  # the launcher's own group is torn down
