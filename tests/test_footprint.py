"""The memory estimate of a run (:mod:`reference_impl.footprint`) is an upper bound of what each
process really holds, and is arithmetic: a run of any size is judged in milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.footprint import GIB, check_fits, estimate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize(
    "spec",
    [
        # a long prefix: every rank and the oracle run the single-device model over it (the indexer's chunked logits)
        {"requests": "2048+64", "n_layers": 1},
        # several chunks, sharded KV written directly, four ranks
        {"requests": "0+300,64+900", "phases": "5", "cp_size": 4, "chunk_size": 200},
    ],
)
def test_the_estimate_is_above_each_process_s_measured_peak(spec: dict) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "memory_probe.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["matches_oracle"] is True
    measured, est = doc["measured"], doc["estimate"]
    for rank, (m, e) in enumerate(zip(measured["ranks"], est["ranks"])):
        assert m <= e, f"rank {rank}: measured {m / 2**20:.0f} MiB above the estimate {e / 2**20:.0f} MiB"
    assert measured["parent"] <= est["parent"], measured
    if max(measured["ranks"]) > 256 << 20:  # where tensors dominate, the bound is not absurd either
        assert max(e / m for m, e in zip(measured["ranks"], est["ranks"])) < 4.0, doc


def test_the_estimate_is_arithmetic_and_grows_with_the_run() -> None:
    start = time.monotonic()
    huge = estimate(RunConfig(requests=(Request(0, 2**31 - 1),)), "cpu")  # nothing proportional is built
    assert time.monotonic() - start < 0.5 and huge.per_device > 1000 * GIB
    small, longer = (estimate(RunConfig(requests=(Request(0, n),)), "cpu").per_device for n in (1024, 4096))
    assert small < longer
    replicated = estimate(
        RunConfig(
            preset="deepseek-v3.2", n_layers=1, cp_size=8, requests=(Request(65536, 64),), phases=PhaseSet.level(1)
        ),
        "cuda",
        "spawn",
        cuda_devices=8,
    )
    sharded = estimate(
        RunConfig(
            preset="deepseek-v3.2", n_layers=1, cp_size=8, requests=(Request(65536, 64),), phases=PhaseSet.level(2)
        ),
        "cuda",
        "spawn",
        cuda_devices=8,
    )
    assert sharded.terms["rank 0 layer loop"] < replicated.terms["rank 0 layer loop"]  # pools: 1/C of the pages


def test_check_fits_names_the_largest_part(monkeypatch) -> None:
    from reference_impl import footprint

    monkeypatch.setattr(footprint, "free_bytes", lambda device_type: 1 << 30)
    run = RunConfig(requests=(Request(100_000, 64),))
    with pytest.raises(ConfigError, match=r"needs up to [\d,.]+ GiB on cpu, which has 1.0 GiB free \(largest part: "):
        check_fits(run, "cpu")
    assert check_fits(RunConfig(), "cpu").per_device < 1 << 30  # the default run fits in 1 GiB
