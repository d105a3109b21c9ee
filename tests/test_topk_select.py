"""The Triton top-k selection kernel under the CPU interpreter, against an exact reference.

The reference: the first ``min(k, visible)`` columns of a stable descending sort of the row's
visible columns (so ties at the k-th value go to the lower column), in ascending column order, as
the kernel's contract states. Against ``torch.topk`` the kernel must select the same values.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from reference_impl.kernels import (
    fallback,
    indexer_triton,
)
from reference_impl.kernels.topk_select import (
    CPU_CONFIG,
    SelectConfig,
    candidate_slots,
    group_maxima_reference,
    maxima_width,
    selected_scores,
    topk_select_reference,
    topk_select_triton,
)

# The GPU config's logic at toy sizes: a bound of 4 radix steps (the k-th column maximum's top 16
# bits) and many short segments per row, so that candidates cross segment boundaries.
TRUNCATED_BOUND = SelectConfig(
    bound_warps=4, bound_steps=4, compact_block=32, compact_warps=1, segment_keys=64, max_segments=16, finish_warps=4
)
CONFIGS = pytest.mark.parametrize("config", [CPU_CONFIG, TRUNCATED_BOUND], ids=["cpu", "truncated_bound"])


def test_random_rows_ranges_and_offset_match_the_stable_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 900, generator=gen)
    starts = torch.tensor([0, 0, 10, 300, 0, 850, -5])
    ends = torch.tensor([900, 50, 600, 364, 1, 840, 2000])  # row 5 sees nothing; row 6 is clipped
    paths = torch.full((7,), -1, dtype=torch.int8)
    got = topk_select_triton(logits, starts, ends, 64, col_offset=1000, paths=paths)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, 64, col_offset=1000))
    assert (got[5] == -1).all() and (got[4, 1:] == -1).all()
    assert (paths == 0).all()  # scores without ties: every row's candidates fit
    # The values torch.topk selects, where a row sees at least k keys.
    assert torch.equal(selected_scores(logits[:1], got[:1] - 1000)[0], logits[0].topk(64).values)


def test_negative_values_signed_zeros_and_neg_inf() -> None:
    row = torch.tensor([-0.0, 0.0, -1.5, float("-inf"), 2.0, -3e-38, 3e-38, -0.0, 7.0, float("-inf")])
    logits = row.repeat(2, 1)
    starts, ends = torch.tensor([0, 0]), torch.tensor([10, 10])
    got = topk_select_triton(logits, starts, ends, 5)
    # 7.0, 2.0, 3e-38, then two of the three zeros: -0.0 and +0.0 tie (torch compares them equal),
    # so the lowest columns (0 and 1) win over column 7.
    assert got[0].tolist() == [0, 1, 4, 6, 8]
    assert torch.equal(got, topk_select_reference(logits, starts, ends, 5))
    assert topk_select_triton(logits, starts, ends, 9)[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # -inf ranks too


def _into_one_column(n: int, lo: int, g: int) -> torch.Tensor:
    """Positions that pass 1 folds into column 0: block i (of G keys from ``lo``) is rotated by
    ``i * 1031`` columns, so its key at offset ``i * 1031 mod G`` lands in column 0."""
    positions = torch.tensor([lo + i * g + (i * 1031) % g for i in range((n - lo) // g)])
    return positions[positions < n]


@CONFIGS
@pytest.mark.parametrize(
    ("pattern", "path"),
    [("all_equal", 1), ("two_values", 1), ("zeros_below_the_kth", 1), ("period_of_g", 0), ("one_column", 2)],
)
def test_paths_for_candidates_that_overflow_the_buffer(pattern: str, path: int, config: SelectConfig) -> None:
    """Scores built so that more than G keys reach the column-maxima bound: ties at the bound take
    path 1 (the bound is the k-th key); the largest keys all folded into one column take path 2
    (radix select over the whole row). A period of G (the engine's synthetic scores repeat so)
    stays on path 0: the rotation spreads the copies. Every path matches the reference exactly."""
    k, n = 16, 700
    g = candidate_slots(k)
    cols = torch.arange(n)
    starts, ends = torch.tensor([0, 3]), torch.tensor([n, n - 1])
    gen = torch.Generator().manual_seed(1)
    if pattern == "all_equal":
        logits = torch.full((2, n), 0.25)
    elif pattern == "two_values":
        logits = torch.where(cols % 3 == 0, 1.0, 2.0).float().repeat(2, 1)
    elif pattern == "zeros_below_the_kth":  # a few positive scores, then a sea of ReLU zeros
        logits = torch.where(cols % 97 == 5, cols.float(), 0.0).repeat(2, 1)
    elif pattern == "period_of_g":
        logits = torch.rand(g, generator=gen).repeat(n // g + 1)[:n].repeat(2, 1)
    else:
        logits = torch.rand(2, n, generator=gen)
        for row in range(2):
            hot = _into_one_column(int(ends[row]), int(starts[row]), g)
            logits[row, hot] = 100.0 + torch.arange(hot.numel()).float()
    paths = torch.full((2,), -1, dtype=torch.int8)
    got = topk_select_triton(logits, starts, ends, k, paths=paths, config=config)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, k))
    assert paths.tolist() == [path, path]


@CONFIGS
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_rows=st.integers(1, 4),
    n_cols=st.integers(1, 300),
    k=st.sampled_from([1, 3, 16, 40]),
    distinct=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_property_matches_the_stable_sort(
    n_rows: int, n_cols: int, k: int, distinct: int, seed: int, config: SelectConfig
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values make ties; a random range per row covers empty, short and full rows.
    logits = (torch.randint(0, distinct, (n_rows, n_cols), generator=gen).float() - distinct / 2) / 3
    starts = torch.randint(0, n_cols + 1, (n_rows,), generator=gen)
    ends = starts + torch.randint(0, n_cols + 1, (n_rows,), generator=gen)
    got = topk_select_triton(logits, starts, ends, k, col_offset=5, config=config)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, k, col_offset=5))


def test_writes_into_a_slice_and_names_bad_input() -> None:
    logits = torch.randn(4, 50)
    out = torch.full((6, 8), -7, dtype=torch.int32)
    topk_select_triton(logits, torch.zeros(4, dtype=torch.long), torch.full((4,), 50), 8, out=out[1:5])
    assert (out[0] == -7).all() and (out[5] == -7).all()
    assert torch.equal(out[1:5], topk_select_reference(logits, torch.zeros(4), torch.full((4,), 50), 8))
    bounds = (torch.zeros(4, dtype=torch.long), torch.full((4,), 50))
    with pytest.raises(ValueError, match="float32"):
        topk_select_triton(logits.double(), *bounds, 8)
    with pytest.raises(ValueError, match="k=0"):
        topk_select_triton(logits, *bounds, 0)
    with pytest.raises(ValueError, match="contiguous along the key"):
        topk_select_triton(logits.t().contiguous().t(), *bounds, 8)
    with pytest.raises(ValueError, match=r"\[4, 8\] int32"):
        topk_select_triton(logits, *bounds, 8, out=torch.empty(4, 9, dtype=torch.int32))


def test_indexer_selectors_agree_and_a_failing_selection_falls_back_to_torch_topk(monkeypatch, caplog) -> None:
    """``selector="torch"`` is the torch.topk path: the same scores selected. A selection kernel that
    raises falls back to it with one warning."""
    gen = torch.Generator().manual_seed(2)
    n, keys, heads, d = 20, 150, 2, 32
    q = torch.randn(n, heads, d, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(n, heads, generator=gen)
    k = torch.randn(keys, d, generator=gen).to(torch.float8_e4m3fn)
    ks = torch.rand(keys, generator=gen) + 0.5
    start = torch.zeros(n, dtype=torch.long)
    end = torch.arange(n) * 7 + 10
    args = (q, w, k, ks, start, end, 24)
    logits = indexer_triton.indexer_logits_triton(q, w, k, ks, start, end, 0, keys)
    via_kernel = indexer_triton.indexer_topk_triton(*args, rows_per_chunk=6, selector="triton")
    via_torch = indexer_triton.indexer_topk_triton(*args, rows_per_chunk=6)  # the default
    assert torch.equal(via_kernel, topk_select_reference(logits, start, end, 24))
    assert torch.equal(selected_scores(logits, via_kernel), selected_scores(logits, via_torch))
    assert torch.equal(via_kernel < 0, via_torch < 0)

    def boom(*_a: object, **_k: object) -> torch.Tensor:
        raise RuntimeError("selection kernel unavailable")

    fallback.reset_fallbacks()
    monkeypatch.setattr(indexer_triton, "topk_select_triton", boom)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        fell_back = indexer_triton.indexer_topk_triton(*args, rows_per_chunk=6, selector="triton")
    assert torch.equal(fell_back, via_torch)
    assert len(caplog.records) == 1 and "torch.topk" in caplog.records[0].getMessage()
    assert "Triton top-k selection" in fallback.fallbacks_taken()
    fallback.reset_fallbacks()
    with pytest.raises(ValueError, match="selector"):
        indexer_triton.indexer_topk_triton(*args, selector="heap")


def test_exact_selection_is_the_reference_contract() -> None:
    """The bench's vectorized reference equals the per-row one, rows with fewer than k keys included."""
    from reference_impl.bench.topk import Chunk, exact_selection

    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 5, (6, 40), generator=gen).float()
    starts, ends = torch.tensor([0, 3, 10, 0, 39, 5]), torch.tensor([40, 9, 40, 1, 40, 5])
    assert torch.equal(
        exact_selection(Chunk(logits, starts, ends, 0), 12), topk_select_reference(logits, starts, ends, 12)
    )


def test_the_selection_kernel_is_the_default_selector_and_the_knob_picks_torch_topk(monkeypatch) -> None:
    from reference_impl.config import ConfigError
    from reference_impl.kernels.dispatch import topk_selector

    monkeypatch.delenv("DSACP_TRITON_TOPK", raising=False)
    assert topk_selector() == "triton"
    monkeypatch.setenv("DSACP_TRITON_TOPK", "0")
    assert topk_selector() == "torch"
    monkeypatch.setenv("DSACP_TRITON_TOPK", "sometimes")
    with pytest.raises(ConfigError, match="DSACP_TRITON_TOPK"):
        topk_selector()


@CONFIGS
def test_workspace_bytes_is_what_the_selection_allocates(config: SelectConfig) -> None:
    """The planner counts the selection's candidate slots with ``workspace_bytes``: the bytes of the
    one ``[R, S, G]`` int32 tensor a selection allocates."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from reference_impl.kernels.topk_select import workspace_bytes

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.int32_3d: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and out.dtype == torch.int32 and out.dim() == 3:
                self.int32_3d.append(out.numel() * out.element_size())
            return out

    rows, cols, k = 6, 300, 16
    logits = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    start, end = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), cols, dtype=torch.int64)
    with Allocations() as seen:
        topk_select_triton(logits, start, end, k, config=config)
    assert seen.int32_3d == [workspace_bytes(rows, cols, k, config)]


def _indexer_inputs(n: int, keys: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 2, 32, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(n, 2, generator=gen)
    k = torch.randn(keys, 32, generator=gen).to(torch.float8_e4m3fn)
    return q, w, k, torch.rand(keys, generator=gen) + 0.5


def test_the_logits_kernel_writes_the_group_maxima_of_the_visible_keys() -> None:
    """The fused bound's input: beside the logits, each row's group maxima (8 per 128-column span,
    every 8th column a group) of the order keys of its visible columns, 0 where none is visible, on a
    chunk that starts at a key offset and ends inside a span."""
    n, keys, lo, hi = 24, 700, 37, 650
    q, w, k, ks = _indexer_inputs(n, keys, seed=5)
    start = torch.arange(n) * 13
    end = torch.minimum(start + 40 + torch.arange(n) * 29, torch.tensor(hi))
    maxima = torch.empty(n, maxima_width(hi - lo), dtype=torch.uint32)
    logits = indexer_triton.indexer_logits_triton(q, w, k, ks, start, end, lo, hi, maxima=maxima)
    want = group_maxima_reference(logits, start - lo, end - lo)
    assert torch.equal(maxima.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, want)
    assert (want > 0).any() and (want == 0).any()  # both visible and empty groups occur
    with pytest.raises(ValueError, match="block_s=64"):
        indexer_triton.indexer_logits_triton(q, w, k, ks, start, end, lo, hi, maxima=maxima, block_s=64)
    with pytest.raises(ValueError, match=r"maxima must be an \[24, 40\] uint32"):
        indexer_triton.indexer_logits_triton(q, w, k, ks, start, end, lo, hi, maxima=maxima[:, :8])


def _run_of_hot_keys(n: int, run: int, count: int) -> torch.Tensor:
    """``count`` runs of ``run`` adjacent columns spread over ``n``: locally clustered top scores."""
    starts = torch.linspace(0, n - run - 1, count).long()
    return (starts[:, None] + torch.arange(run)[None]).flatten()


@CONFIGS
@pytest.mark.parametrize("pattern", ["random", "all_equal", "two_values", "adjacent_runs", "one_column"])
def test_the_fused_bound_selects_exactly_and_keeps_random_rows_on_the_fast_path(
    pattern: str, config: SelectConfig
) -> None:
    """The selection with the group maxima as its bound source, on rows long enough to use them
    (at least G maxima) and short ones beside them: the stable-sort reference on every pattern;
    random scores and runs of 8 adjacent hot keys still fit the candidate slots (path 0)."""
    k, n = 16, 1500
    g = candidate_slots(k)
    starts, ends = torch.tensor([0, 5, 200, 1300]), torch.tensor([n, n - 3, 1499, 1400])  # the last row is short
    gen = torch.Generator().manual_seed(7)
    cols = torch.arange(n)
    logits = torch.rand(4, n, generator=gen)
    if pattern == "all_equal":
        logits = torch.full((4, n), 0.5)
    elif pattern == "two_values":
        logits = torch.where(cols % 3 == 0, 1.0, 2.0).float().repeat(4, 1)
    elif pattern == "adjacent_runs":
        logits[:, _run_of_hot_keys(n, 8, 4)] += 10.0
    elif pattern == "one_column":
        for row in range(4):
            hot = _into_one_column(int(ends[row]), int(starts[row]), g)
            logits[row, hot] = 100.0 + torch.arange(hot.numel()).float()
    maxima = group_maxima_reference(logits, starts, ends).to(torch.uint32)
    assert maxima.shape[1] >= g  # the long rows read maxima, not keys
    paths = torch.full((4,), -1, dtype=torch.int8)
    got = topk_select_triton(logits, starts, ends, k, col_offset=9, paths=paths, config=config, maxima=maxima)
    assert torch.equal(got, topk_select_reference(logits, starts, ends, k, col_offset=9))
    if pattern in ("random", "adjacent_runs"):
        assert (paths == 0).all()
    with pytest.raises(ValueError, match=r"maxima must be an \[4, 96\] uint32"):
        topk_select_triton(logits, starts, ends, k, maxima=maxima.view(torch.int32))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_rows=st.integers(1, 6), n_cols=st.integers(100, 2000), k=st.sampled_from([1, 8, 40]), seed=st.integers(0, 2**16)
)
def test_property_the_indexer_with_the_fused_bound_selects_what_it_selects_without(
    n_rows: int, n_cols: int, k: int, seed: int
) -> None:
    """Through ``indexer_topk_triton``: the fused bound changes where the bound reads, never the result."""
    q, w, kk, ks = _indexer_inputs(n_rows, n_cols, seed)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, n_cols // 2, (n_rows,), generator=gen)
    end = torch.clamp(start + torch.randint(1, n_cols, (n_rows,), generator=gen), max=n_cols)
    args = (q, w, kk, ks, start, end, k)
    fused = indexer_triton.indexer_topk_triton(*args, selector="triton", fused_bound=True)
    plain = indexer_triton.indexer_topk_triton(*args, selector="triton")
    logits = indexer_triton.indexer_logits_triton(q, w, kk, ks, start, end, 0, int(end.max()))
    assert torch.equal(fused, plain)
    assert torch.equal(fused, topk_select_reference(logits, start, end, k))


def test_the_fused_bound_is_off_by_default_and_the_knob_turns_it_on(monkeypatch) -> None:
    from reference_impl.config import ConfigError
    from reference_impl.kernels import dispatch

    seen: list[object] = []
    monkeypatch.setattr(indexer_triton, "indexer_topk_triton", lambda *a, **kw: seen.append(kw["fused_bound"]))
    args = (None,) * 8
    monkeypatch.delenv("DSACP_FUSED_BOUND", raising=False)
    dispatch._triton_indexer_topk(*args)
    monkeypatch.setenv("DSACP_FUSED_BOUND", "1")
    dispatch._triton_indexer_topk(*args)
    assert seen == [False, True]
    monkeypatch.setenv("DSACP_FUSED_BOUND", "perhaps")
    with pytest.raises(ConfigError, match="DSACP_FUSED_BOUND"):
        dispatch._triton_indexer_topk(*args)
