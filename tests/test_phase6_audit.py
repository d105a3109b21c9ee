"""Phase 6: device-resident CP metadata, audited in debug mode to issue no host sync in the layer loop."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny
from reference_impl.config import PhaseSet, Request
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.sync_audit import HostSyncCounter, diagnostic
from reference_impl.engine import HostSyncError, run_rank


def test_counter_counts_syncing_calls_and_skips_diagnostics() -> None:
    x = torch.arange(8)
    with HostSyncCounter() as audit:
        _ = int(x.max())
        _ = x.nonzero()
        with diagnostic():
            _ = x.tolist()
    assert audit.count == 2 and "__int__" in audit.sites[0]
    _ = int(x.max())  # patches are gone after the block
    assert audit.count == 2


@pytest.mark.parametrize(
    ("requests", "chunk_size"),
    [((Request(0, 96), Request(0, 70)), None), ((Request(13, 150), Request(40, 130)), None), ((Request(16, 150),), 64)],
)
@pytest.mark.parametrize("cp_size", [1, 3])
def test_zero_host_syncs_in_the_layer_loop(report_of, requests, chunk_size, cp_size: int) -> None:
    rep = report_of(tiny(cp_size=cp_size, requests=requests, page_size=8, chunk_size=chunk_size, debug=True,
                         phases=PhaseSet.level(6)))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True
    assert rep["per_rank"][0]["host_syncs_in_layer_loop"] == 0


def test_the_audit_fails_loudly_on_a_sync(monkeypatch) -> None:
    original = ShardedKV.full_view

    def syncing_full_view(self, layer, kv_seq, index_k_seq):
        _ = float(kv_seq.sum())  # a device read in the layer loop
        return original(self, layer, kv_seq, index_k_seq)

    monkeypatch.setattr(ShardedKV, "full_view", syncing_full_view)
    run = tiny(cp_size=1, requests=(Request(0, 64),), debug=True, phases=PhaseSet.level(6), check=False)
    with pytest.raises(HostSyncError, match="host sync"):
        run_rank(CPGroup.single(debug=True), run)


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
