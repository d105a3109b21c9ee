"""Phase 6: device-resident CP metadata, audited in debug mode to issue no host sync in the layer loop."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.config import PhaseSet, Request
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.engine import HostSyncError, run_rank
from reference_impl.sync_audit import HostSyncAudit, diagnostic, syncing_call, transport


def test_the_audit_counts_syncing_calls_and_skips_diagnostics() -> None:
    x = torch.arange(8)
    with HostSyncAudit(api=True, cuda=False) as audit:
        _ = int(x.max())
        _ = x.nonzero()
        _ = x[x > 3]  # a boolean mask: the result's size is on the device
        _ = torch.tensor([1, 2])  # host data -> device on a GPU
        _ = x[[1, 2]]  # a Python list index is host data too
        _ = x.index_select(0, torch.arange(2)) + x[2:4]  # stays on the device: not counted
        with diagnostic():
            _ = x.tolist()
        with transport(stages_through_host=True):  # one staged collective; what syncs inside is the wire's
            _ = x.sum().item()
    assert audit.count == 5 and audit.transport == 1
    assert audit.sites[0].startswith("__int__() at ") and __file__ in audit.sites[0]
    assert audit.method == "api"
    _ = int(x.max())  # the mode is gone after the block
    assert audit.count == 5


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "syncs"),
    [
        ("item", (torch.zeros(1),), {}, True),
        ("unique", (torch.zeros(2),), {}, True),
        ("repeat_interleave", (torch.arange(2), torch.ones(2, dtype=torch.long)), {}, True),
        ("repeat_interleave", (torch.arange(2), torch.ones(2, dtype=torch.long)), {"output_size": 2}, False),
        ("where", (torch.ones(2, dtype=torch.bool),), {}, True),
        ("where", (torch.ones(2, dtype=torch.bool), torch.zeros(2), torch.ones(2)), {}, False),
        ("as_tensor", ([1, 2],), {}, True),
        ("as_tensor", (torch.zeros(2),), {}, False),
        ("to", (torch.zeros(2), "cuda"), {}, True),
        ("to", (torch.zeros(2), "cuda"), {"non_blocking": True}, False),
        ("to", (torch.zeros(2), torch.float16), {}, False),
        ("__getitem__", (torch.zeros(2), slice(0, 1)), {}, False),
        ("__setitem__", (torch.zeros(2), torch.ones(2, dtype=torch.bool), 0.0), {}, True),
        ("index_select", (torch.zeros(2), 0, torch.zeros(1, dtype=torch.long)), {}, False),
    ],
)
def test_which_calls_sync(name: str, args: tuple, kwargs: dict, syncs: bool) -> None:
    assert syncing_call(name, args, kwargs) is syncs


@pytest.mark.parametrize(
    ("requests", "chunk_size"),
    [((Request(0, 96), Request(0, 70)), None), ((Request(13, 150), Request(40, 130)), None), ((Request(16, 150),), 64)],
)
@pytest.mark.parametrize("cp_size", [1, 3])
def test_zero_host_syncs_in_the_layer_loop(report_of, requests, chunk_size, cp_size: int) -> None:
    rep = report_of(
        tiny(
            cp_size=cp_size, requests=requests, page_size=8, chunk_size=chunk_size, debug=True, phases=PhaseSet.level(6)
        )
    )
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["per_rank"][0]["host_syncs_in_layer_loop"] == 0


def _inject_item(monkeypatch, inside_diagnostic: bool) -> None:
    original = ShardedKV.full_view

    def full_view_with_a_read(self, layer, kv_seq, index_k_seq):
        if inside_diagnostic:
            with diagnostic():
                _ = kv_seq.sum().item()
        else:
            _ = kv_seq.sum().item()  # a device read in the layer loop
        return original(self, layer, kv_seq, index_k_seq)

    monkeypatch.setattr(ShardedKV, "full_view", full_view_with_a_read)


def test_an_injected_item_fails_the_debug_audit(monkeypatch) -> None:
    _inject_item(monkeypatch, inside_diagnostic=False)
    run = tiny(cp_size=1, requests=(Request(0, 64),), debug=True, phases=PhaseSet.level(6), check=False, device="cpu")
    with pytest.raises(
        HostSyncError, match=r"2 host sync\(s\) in the phase-6 layer loop: item\(\) at .*test_phase6_audit"
    ):
        run_rank(CPGroup.single(debug=True), run)


def test_an_injected_item_is_counted_without_debug(monkeypatch) -> None:
    _inject_item(monkeypatch, inside_diagnostic=False)
    run = tiny(cp_size=1, requests=(Request(0, 64),), phases=PhaseSet.level(6), check=False, device="cpu")
    result = run_rank(CPGroup.single(debug=False), run)
    assert result.stats["host_syncs_in_layer_loop"] == 2 and result.host_sync_audit == "api"  # one per layer


def test_a_sync_inside_a_diagnostic_passes(monkeypatch) -> None:
    _inject_item(monkeypatch, inside_diagnostic=True)
    run = tiny(cp_size=1, requests=(Request(0, 64),), debug=True, phases=PhaseSet.level(6), check=False, device="cpu")
    assert run_rank(CPGroup.single(debug=True), run).stats["host_syncs_in_layer_loop"] == 0


@pytest.mark.parametrize("level", [6, 7, 8])
def test_the_production_path_counts_zero_syncs(report_of, level: int) -> None:
    rep = report_of(
        tiny(cp_size=2, requests=(Request(13, 150), Request(40, 130)), page_size=8, phases=PhaseSet.level(level))
    )
    assert rep["matches_oracle"] is True and rep["host_sync_audit"] == "api"
    assert [p["host_syncs_in_layer_loop"] for p in rep["per_rank"]] == [0, 0]


def test_without_phase6_the_audit_is_off(report_of) -> None:
    rep = report_of(tiny(cp_size=2, debug=True, phases=PhaseSet.level(5), requests=(Request(0, 96),), page_size=8))
    assert "host_syncs_in_layer_loop" not in rep["per_rank"][0]


def test_host_bounds_bound_each_chunk_and_change_no_index() -> None:
    """Zigzag rows: early positions then late ones. Host bounds give each chunk its own key range
    (the early chunk scores 8 keys, not 64) and the same top-k as the device bounds."""
    from reference_impl.model.sparse_attention import chunk_key_range, indexer_topk

    gen = torch.Generator().manual_seed(0)
    positions = list(range(0, 8)) + list(range(56, 64))
    key_start, key_end = torch.zeros(16, dtype=torch.long), torch.tensor([p + 1 for p in positions])
    host = ([0] * 16, [p + 1 for p in positions])
    assert chunk_key_range(key_start, key_end, 0, 8, host) == (0, 8)
    assert chunk_key_range(key_start, key_end, 8, 16, host) == (0, 64)
    q = torch.randn(16, 4, 32, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(64, 32, generator=gen).to(torch.float8_e4m3fn)
    w, scale = torch.rand(16, 4, generator=gen), torch.rand(64, generator=gen) + 0.5
    with_host = indexer_topk(q, w, k, scale, key_start, key_end, 6, rows_per_chunk=8, host_bounds=host)
    assert torch.equal(with_host, indexer_topk(q, w, k, scale, key_start, key_end, 6, rows_per_chunk=8))
    assert bool((with_host[:8] < 8).all())
