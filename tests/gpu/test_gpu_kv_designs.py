"""The competing KV designs on CUDA, with the compiled kernels (GPU tier).

* Two ranks sharing the GPU over gloo run each design at DeepSeek-V3.2 dims (prefixes ending
  mid-page, chunked) and agree with the oracle (the rounding-tolerant rule), with no kernel falling
  back and no host sync in the layer loop.
* Rank 0 of C = 8 alone (loopback collectives): zero syncs of any kind, the layer-ahead gathers
  on a real side stream.
* A slow side stream: the designs that gather a layer ahead (layer split, rotated shard) still agree
  with the oracle, because the layer waits for its slot.
* The benchmark runs end to end on the GPU at a small size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu.conftest import PREFIX, V32
from reference_impl.bench import designs as bench
from reference_impl.config import PhaseSet, Request
from reference_impl.cp import prefetch
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import run_rank
from reference_impl.runner import run_prefill, run_prefills

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

DESIGNS = ("layer-split", "rotated-shard", "dcp-gather")
BESIDE = PhaseSet(frozenset({1, 7}))  # narrow output and the fused kernels
SLOW_SIDE_STREAM_CYCLES = 50_000_000  # ~25 ms at ~2 GHz: far longer than a layer here


@pytest.fixture(scope="module")
def design_reports() -> dict[str, dict]:
    runs = {d: V32.replace(kv_design=d, phases=BESIDE, chunk_size=1024) for d in DESIGNS}
    return dict(zip(runs, run_prefills(list(runs.values()), timeout_s=600)))


@pytest.mark.parametrize("design", DESIGNS)
def test_ranks_sharing_the_gpu_match_the_oracle(design_reports: dict[str, dict], design: str) -> None:
    rep = design_reports[design]
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["collectives_identical"] and rep["config"]["kv_design"] == design
    assert rep["kernel_fallbacks"] == {}, "a kernel failed on the GPU and its torch path ran instead"
    assert rep["host_sync_audit"] == "cuda-sync-debug"
    assert [p["host_syncs_in_layer_loop"] for p in rep["per_rank"]] == [0, 0]


@pytest.mark.parametrize("design", DESIGNS)
def test_one_rank_of_eight_syncs_nowhere_in_the_layer_loop(design: str) -> None:
    run = V32.replace(
        cp_size=8, kv_design=design, phases=BESIDE, check=False, compute_dtype="bf16", requests=(Request(4096, 8192),)
    )
    result = run_rank(LoopbackGroup(0, 8, "cuda", wire_gbps=450.0), run)
    assert result.stats["host_syncs_in_layer_loop"] == 0
    assert result.stats["transport_syncs_in_layer_loop"] == 0
    assert result.stats["materialized_bytes"] > 0 and result.kernel_fallbacks == {}


@pytest.mark.parametrize("design", ["layer-split", "rotated-shard"])
def test_a_slow_side_stream_still_matches_the_oracle(monkeypatch: pytest.MonkeyPatch, design: str) -> None:
    original_submit = prefetch.CudaSideStream.submit

    def slow_submit(self, work, slot):
        def late_work():
            torch.cuda._sleep(SLOW_SIDE_STREAM_CYCLES)  # on the side stream, before the gather
            work()

        return original_submit(self, late_work, slot)

    monkeypatch.setattr(prefetch.CudaSideStream, "submit", slow_submit)
    rep = run_prefill(V32.replace(cp_size=1, kv_design=design, phases=BESIDE, requests=PREFIX))
    assert rep["matches_oracle"] is True, rep["problems"]


def test_the_benchmark_runs_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "designs.json"
    assert (
        bench.main(
            [
                "--out",
                str(out),
                "--workloads",
                "prefix-heavy:4096+2048",
                "--layers",
                "2",
                "--repeats",
                "1",
                "--wire-gbps",
                "450",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    rows = {r["design"]: r for r in doc["workloads"][0]["designs"]}
    assert doc["device"] == torch.cuda.get_device_name(0)
    for design in bench.MEASURED_DESIGNS:
        assert rows[design]["host_syncs_per_layer"] == 0 and rows[design]["peak_bytes"] > 0
        assert rows[design]["history_bytes_moved_per_layer"] > 0
