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
