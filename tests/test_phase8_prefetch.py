"""Phase 8: one-layer-ahead history MLA prefetch into two alternating buffers, waited on at consumption."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny

from reference_impl import engine
from reference_impl.config import PhaseSet, Request
from reference_impl.cp.prefetch import MlaPrefetcher
from reference_impl.families.dsa import family as dsa_family
from reference_impl.families.dsa.family import DSAFamily
from reference_impl.runner import run_prefill

MIXED = (Request(16, 150), Request(13, 130))


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_prefetch_matches_oracle(report_of, cp_size: int) -> None:
    rep = report_of(tiny(cp_size=cp_size, requests=MIXED, page_size=8, phases=PhaseSet.level(8)))
    assert rep["matches_oracle"] is True and rep["cache_equal"] is True and rep["collectives_identical"] is True


def test_prefetch_moves_the_same_history_bytes_as_phase3(report_of) -> None:
    with_prefetch = report_of(tiny(cp_size=3, requests=MIXED, page_size=8, phases=PhaseSet.level(8)))
    without = report_of(tiny(cp_size=3, requests=MIXED, page_size=8, phases=PhaseSet.level(7)))
    assert [e["materialized_bytes"] for e in with_prefetch["per_rank"]] == [
        e["materialized_bytes"] for e in without["per_rank"]
    ]
    # per layer: KV, index K, prefetched MLA history, synchronous index history; then the tail
    assert with_prefetch["per_rank"][0]["collectives"] == 2 * 4 + 1


def test_prefetch_chunked_and_audited(report_of) -> None:
    rep = report_of(tiny(cp_size=2, requests=MIXED, page_size=8, chunk_size=64, debug=True, phases=PhaseSet.level(8)))
    assert rep["matches_oracle"] is True and rep["per_rank"][0]["host_syncs_in_layer_loop"] == 0


def test_current_only_batch_prefetches_nothing(report_of) -> None:
    rep = report_of(tiny(cp_size=2, requests=(Request(0, 96), Request(0, 70)), page_size=8, phases=PhaseSet.level(8)))
    assert rep["matches_oracle"] is True and rep["per_rank"][0]["materialized_bytes"] == 0


class DeferredStream:
    """Work runs only when its consumer waits: the real ordering a side stream allows."""

    def __init__(self) -> None:
        self.pending: dict[int, Any] = {}

    def submit(self, work: Any, slot: int) -> int:
        self.pending[slot] = work
        return slot

    def wait(self, handle: int) -> None:
        self.pending.pop(handle)()

    def release(self, slot: int) -> None:
        pass

    def wait_ms(self) -> list[float]:
        return []


class NoWaitStream(DeferredStream):
    """The race: the consumer does not wait, so it reads what the slot held before (two layers back)."""

    def submit(self, work: Any, slot: int) -> int:
        late = self.pending.pop(slot, None)
        if late is not None:
            late()  # the previous prefetch into this slot completes only now
        self.pending[slot] = work
        return slot

    def wait(self, handle: int) -> None:
        pass


@pytest.mark.parametrize(("stream", "agrees"), [(DeferredStream, True), (NoWaitStream, False)])
def test_the_wait_is_what_makes_it_correct(monkeypatch, stream: type, agrees: bool) -> None:
    # One rank runs in this process: the registered DSA family's prefetcher is the one it uses.
    monkeypatch.setattr(dsa_family.FAMILY, "prefetcher", lambda store, n: MlaPrefetcher(store, n, stream()))
    run = tiny(cp_size=1, requests=MIXED, page_size=8, n_layers=4, phases=PhaseSet.level(8))
    rep = run_prefill(run)
    assert rep["matches_oracle"] is agrees


class TimedDeferredStream(DeferredStream):
    """Reports a stall of ``layer + 1`` ms at each wait, so the plumbing into the timings is visible."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, handle: int) -> None:
        super().wait(handle)
        self.waits += 1

    def wait_ms(self) -> list[float]:
        return [float(i + 1) for i in range(self.waits)]


def test_exposed_waits_reach_the_rank_timings(monkeypatch) -> None:
    """One stall figure per consumed layer lands in ``timings["prefetch_wait_ms"]`` (bench/layer's
    direct measure of the unhidden prefetch); none without phase 8."""
    from reference_impl.cp.loopback import LoopbackGroup

    family = DSAFamily(prefetcher=lambda store, n: MlaPrefetcher(store, n, TimedDeferredStream()))
    run = tiny(cp_size=2, requests=MIXED, page_size=8, n_layers=3, phases=PhaseSet.level(8), check=False)
    result = engine.run_rank(LoopbackGroup(0, 2, torch.device("cpu")), run, family=family)
    assert result.timings["prefetch_wait_ms"] == [1.0, 2.0, 3.0]
    no_prefetch = engine.run_rank(LoopbackGroup(0, 2, torch.device("cpu")), run.replace(phases=PhaseSet.level(7)))
    assert no_prefetch.timings["prefetch_wait_ms"] == []
