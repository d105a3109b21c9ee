"""Phase 6 on CUDA: zero host syncs in the layer loop, counted by CUDA itself (GPU tier).

``torch.cuda.set_sync_debug_mode("warn")`` counts every synchronizing CUDA operation. In debug mode
the API counter runs too (and a sync raises ``HostSyncError``); debug diagnostics are excluded, and
the wire's own staging (gloo moves CUDA tensors through the host) is counted apart as
``transport_syncs_in_layer_loop``, one per staged collective, never hidden.
"""

from __future__ import annotations

import pytest
import torch

from gpu.conftest import V32
from reference_impl.config import PhaseSet, Request
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import HostSyncError, run_rank
from reference_impl.sync_audit import diagnostic

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]


@pytest.mark.parametrize("level", [6, 7, 8])
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_ranks_sharing_the_gpu_sync_only_on_the_wire(engine_reports: dict[str, dict], level: int, debug: bool) -> None:
    rep = engine_reports[f"{'debug-' if debug else ''}level{level}"]
    assert rep["host_sync_audit"] == ("cuda-sync-debug+api" if debug else "cuda-sync-debug")
    assert [p["host_syncs_in_layer_loop"] for p in rep["per_rank"]] == [0, 0]
    # gloo with CUDA tensors stages every all-gather through host memory: reported, not hidden (NCCL: 0)
    assert all(p["transport_syncs_in_layer_loop"] >= 2 * 2 for p in rep["per_rank"])  # kv and index_k, 2 layers


@pytest.mark.parametrize("level", [6, 7, 8])
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_one_rank_of_eight_syncs_nowhere_in_the_layer_loop(level: int, debug: bool) -> None:
    """Rank 0 of C = 8 alone (loopback collectives, no gloo staging): zero syncs of any kind, with the
    fused kernels in production and the torch paths plus diagnostics in debug."""
    run = V32.replace(
        cp_size=8,
        phases=PhaseSet.level(level),
        debug=debug,
        check=False,
        compute_dtype="bf16",
        requests=(Request(4096, 8192),),
    )
    group = LoopbackGroup(0, 8, "cuda")
    group.debug = debug
    result = run_rank(group, run)
    assert result.stats["host_syncs_in_layer_loop"] == 0
    assert result.stats["transport_syncs_in_layer_loop"] == 0
    assert result.kernel_fallbacks == {}


def _inject_item(monkeypatch: pytest.MonkeyPatch, inside_diagnostic: bool) -> None:
    original = ShardedKV.full_view

    def full_view_with_a_read(self, layer, kv_seq, index_k_seq, *rest):
        if inside_diagnostic:
            with diagnostic():
                _ = kv_seq.sum().item()
        else:
            _ = kv_seq.sum().item()  # a device read in the layer loop
        return original(self, layer, kv_seq, index_k_seq, *rest)

    monkeypatch.setattr(ShardedKV, "full_view", full_view_with_a_read)


def test_an_injected_item_fails_the_audit_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _inject_item(monkeypatch, inside_diagnostic=False)
    run = V32.replace(cp_size=1, phases=PhaseSet.level(6), check=False, compute_dtype="bf16")
    with pytest.raises(HostSyncError, match=r"host sync\(s\) in the phase-6 layer loop: item\(\) at "):
        run_rank(CPGroup.single("cuda", debug=True), run.replace(debug=True))
    production = run_rank(CPGroup.single("cuda", debug=False), run)
    assert production.stats["host_syncs_in_layer_loop"] == 2 and production.host_sync_audit == "cuda-sync-debug"


def test_a_sync_inside_a_diagnostic_passes_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _inject_item(monkeypatch, inside_diagnostic=True)
    run = V32.replace(cp_size=1, phases=PhaseSet.level(6), check=False, debug=True, compute_dtype="bf16")
    assert run_rank(CPGroup.single("cuda", debug=True), run).stats["host_syncs_in_layer_loop"] == 0
    assert torch.cuda.get_sync_debug_mode() == 0  # the audit restored CUDA's mode
