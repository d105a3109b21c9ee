"""CP prefill agrees with the single-device oracle across the configuration matrix."""

from __future__ import annotations

import pytest
from conftest import tiny

from reference_impl.config import PhaseSet, Request
from reference_impl.runner import run_prefill

MIXED = (Request(0, 96), Request(40, 70), Request(13, 37))  # prefixes 40 and 13 are not page multiples


def assert_agrees(rep: dict) -> None:
    assert rep["problems"] == []
    assert rep["matches_oracle"] is True
    assert rep["cache_equal"] is True
    assert rep["collectives_identical"] is True
    assert rep["topk_agreement"] + rep["topk_boundary_ties"] / 1e9 > 0.99


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_matrix_matches_oracle(report_of, cp_size: int, kv_dtype: str) -> None:
    rep = report_of(tiny(cp_size=cp_size, kv_dtype=kv_dtype, requests=MIXED, page_size=16))
    assert_agrees(rep)
    assert len(rep["per_rank"]) == cp_size


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("page_size", [4, 64])
def test_phase_levels_and_page_sizes(report_of, level: int, page_size: int) -> None:
    rep = report_of(tiny(cp_size=3, phases=PhaseSet.level(level), page_size=page_size, requests=MIXED))
    assert_agrees(rep)
    assert rep["phase_level"] == level


def test_round_robin_baseline(report_of) -> None:
    rep = report_of(tiny(cp_size=4, split_mode="round-robin", requests=MIXED))
    assert_agrees(rep)


def test_bf16_compute(report_of) -> None:
    rep = report_of(tiny(cp_size=2, compute_dtype="bf16", requests=(Request(16, 80),)))
    assert rep["matches_oracle"] is True
    assert rep["cache_equal"] is True


def test_replicated_store_holds_every_page(report_of) -> None:
    """Phase 0 keeps a full replica: every rank's pool holds all pages of the batch."""
    run = tiny(cp_size=4, requests=MIXED, page_size=16)
    rep = report_of(run)
    layout_bytes = 260  # tiny fp8 MLA row: 128 e4m3 + 1 fp32 scale + 64 bf16 rope
    pages = sum(-(-r.total // 16) for r in MIXED)
    for entry in rep["per_rank"]:
        assert entry["kv_bytes"] == run.model.n_layers * pages * 16 * layout_bytes
        assert entry["index_bytes"] == run.model.n_layers * pages * 16 * 132


def test_per_layer_gather_bytes_are_padded_buffers(report_of) -> None:
    """All-gather #1 moves C x max_rank_len rows of 576-wide KV and 128-wide index K per layer."""
    run = tiny(cp_size=3, requests=MIXED)
    rep = report_of(run)
    cfg = run.model
    max_len = max(p["tokens"] for p in rep["per_rank"])
    per_layer = 3 * max_len * (cfg.kv_width + cfg.index_head_dim) * 4  # fp32 compute on CPU
    for entry in rep["per_rank"]:
        assert entry["gather_bytes"] == cfg.n_layers * per_layer
        assert entry["collectives"] == 2 * cfg.n_layers + 1


def test_debug_mode_runs_and_agrees(report_of) -> None:
    rep = report_of(tiny(cp_size=3, debug=True, requests=MIXED))
    assert_agrees(rep)


def test_few_row_products_give_the_bits_of_many_row_products() -> None:
    """A rank's handful of local rows must project to the oracle's bits (the caches are compared
    byte for byte). CPU GEMMs over a few rows take another kernel on some machines (MKL, AVX-512:
    up to ~10 rows), so the model's linear maps pad them to ``MIN_CPU_GEMM_ROWS`` rows. From there on
    the byte-for-byte checks of every CP run rest on the BLAS giving a row its bits whatever the
    row count, so every count up to 64 is tried: where a BLAS breaks that (MKL's
    ``MKL_CBWR=COMPATIBLE`` does, at counts that are not multiples of 4 past 16), this test names the
    cause of the CP runs' ``cache_equal`` failures."""
    import torch

    from reference_impl.model.attention import MIN_CPU_GEMM_ROWS, RowStableLinear

    gen = torch.Generator().manual_seed(0)
    linear = RowStableLinear(256, 96, bias=False)
    torch.nn.init.normal_(linear.weight, generator=gen)
    x = torch.randn(200, 256, generator=gen)
    many = linear(x)
    for rows in [*range(4 * MIN_CPU_GEMM_ROWS + 1), 101, 199]:  # every count up to 64, and two past it
        few = linear(x[:rows])
        assert few.shape == (rows, 96) and torch.equal(few, many[:rows]), rows


def test_a_nan_output_disagrees_with_the_oracle(monkeypatch) -> None:
    """NaN compares false with every tolerance: the check must treat it as a failure, not a pass."""
    from reference_impl.model.attention import DSAAttention

    original = DSAAttention.attend

    def nan_attend(self, *args, **kwargs):
        out, topk = original(self, *args, **kwargs)
        return out * float("nan"), topk

    monkeypatch.setattr(DSAAttention, "attend", nan_attend)
    rep = run_prefill(tiny(cp_size=1, requests=(Request(0, 40),)))
    assert rep["matches_oracle"] is False and "hidden states differ" in rep["problems"][0]


def test_topk_boundary_rules() -> None:
    """Exact: a swap must tie the k-th score; rounding-tolerant: a swap must rank near k; never an invisible key."""
    import torch

    from reference_impl.check import _topk_rows_agree

    scores = 100 * 0.9 ** torch.arange(100).float()  # key i has rank i; neighbours 10% apart
    ref = torch.arange(40)  # the oracle's top 40
    near = torch.cat([torch.arange(39), torch.tensor([40])])  # swaps rank 39 for rank 40
    far = torch.cat([torch.arange(1, 40), torch.tensor([90])])  # drops the best, takes rank 90
    assert _topk_rows_agree(near, ref, scores, exact=False)
    assert not _topk_rows_agree(far, ref, scores, exact=False)
    assert not _topk_rows_agree(near, ref, scores, exact=True)  # 10% apart: not a tie within 2%
    tied = scores.clone()
    tied[40] = tied[39]
    assert _topk_rows_agree(near, ref, tied, exact=True)
    assert not _topk_rows_agree(near, ref, scores[:40], exact=False)  # key 40 is not visible


@pytest.mark.parametrize("level", [0, 8])
def test_a_prefill_leaves_no_tensor_to_the_cyclic_collector(level: int) -> None:
    """Every tensor of a layer is freed by reference counting when it goes out of use. A reference
    cycle (a closure that calls itself held the sparse MLA's ``q``, ``kv`` and ``indices``) keeps
    them until the cyclic collector runs, which in a GPU layer loop can be many layers later: on the
    H200 the measured peak grew by ``q`` per layer (2.25 GiB at 16K local tokens)."""
    import gc

    import torch

    from reference_impl.config import RunConfig
    from reference_impl.cp.loopback import LoopbackGroup
    from reference_impl.engine import run_rank

    run = RunConfig(
        preset="tiny",
        n_layers=3,
        cp_size=2,
        check=False,
        device="cpu",
        requests=(Request(64, 128),),
        phases=PhaseSet.level(level),
    )
    run_rank(LoopbackGroup(0, 2, "cpu"), run)  # first use: module imports and caches
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept in gc.garbage
    try:
        run_rank(LoopbackGroup(0, 2, "cpu"), run)
        gc.collect()
        cyclic = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []
