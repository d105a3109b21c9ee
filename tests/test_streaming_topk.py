"""The indexer's top-k over keys streamed in tiles equals one pass over the whole row, exactly.

Both paths (the torch reference, :func:`reference_impl.model.sparse_attention.indexer_topk`, and the
Triton logits kernel with the three-kernel selection under the CPU interpreter) run with tiles
smaller than the keys a row sees, and are compared with
:func:`~reference_impl.kernels.topk_select.topk_select_reference` over the whole ``[T, S]`` scores:
the first ``min(k, visible)`` keys of a stable descending sort (ties at the k-th score to the lower
key). The inputs are small integers, so every score is exact in fp32 whatever the order of the
sums, and ties are frequent.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_impl.model import sparse_attention as ref
from reference_impl.model.streaming_topk import exact_topk_positions, key_tiles, row_tile


def _integer_case(seed: int, n_rows: int, n_keys: int, n_heads: int = 2, dim: int = 16, levels: int = 3):
    """Indexer inputs whose scores are exact small integers: q, k in ``[-levels, levels]`` (exact in
    FP8), head weights in ``{0, 1, 2}``, key scales in ``{1, 2}``; random causal-like key ranges."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (n_rows, n_heads, dim), generator=gen).float().to(torch.float8_e4m3fn)
    k = torch.randint(-levels, levels + 1, (n_keys, dim), generator=gen).float().to(torch.float8_e4m3fn)
    weights = torch.randint(0, 3, (n_rows, n_heads), generator=gen).float()
    k_scale = torch.randint(1, 3, (n_keys,), generator=gen).float()
    key_start = torch.randint(0, n_keys, (n_rows,), generator=gen)
    key_end = key_start + torch.randint(0, n_keys + 1, (n_rows,), generator=gen)
    key_start[0], key_end[0] = 0, n_keys  # one row sees every key
    return q, weights, k, k_scale, key_start, key_end.clamp(max=n_keys)


def _whole_row_reference(case: tuple[torch.Tensor, ...], topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact selection over the whole rows, ascending keys; the masked ``[T, S]`` scores)."""
    q, weights, k, k_scale, key_start, key_end = case
    from reference_impl.kernels.topk_select import topk_select_reference

    scores = ref.indexer_scores(q, weights, k, k_scale)
    assert torch.equal(scores, scores.round()), "scores must be exact integers"
    return topk_select_reference(scores, key_start, key_end, topk), scores


def _by_key(selected: torch.Tensor) -> torch.Tensor:
    """A selection's keys in ascending order, -1 padded (what the selection kernel writes)."""
    big = torch.iinfo(torch.int32).max
    ordered = torch.where(selected < 0, big, selected).sort(dim=1).values
    return torch.where(ordered == big, -1, ordered).to(torch.int32)


def test_exact_topk_positions_keeps_the_lowest_ties_in_position_order() -> None:
    values = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")], [float("-inf")] * 6])
    assert exact_topk_positions(values, 2).tolist() == [[1, 2], [0, 1]]
    assert exact_topk_positions(values, 4).tolist() == [[1, 2, 3, 4], [0, 1, 2, 3]]
    assert exact_topk_positions(values, 9).shape == (2, 6)


def test_tiles_and_row_tile_cover_the_range_within_the_budget() -> None:
    assert key_tiles(5, 17, 4) == [(5, 9), (9, 13), (13, 17)]
    assert key_tiles(5, 15, 4)[-1] == (13, 15) and key_tiles(3, 3, 4) == []
    assert row_tile(1000, 8, 64_000, 100) == (80, 100)
    assert row_tile(10, 8, 64, 100) == (1, 10)  # at least one row


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n_rows=st.integers(1, 12),
    n_keys=st.integers(1, 90),
    topk=st.integers(1, 24),
    key_tile=st.integers(1, 40),
    rows_per_chunk=st.integers(0, 7),
    levels=st.sampled_from([1, 3]),
)
def test_property_torch_reference_tiled_equals_one_pass(
    seed: int, n_rows: int, n_keys: int, topk: int, key_tile: int, rows_per_chunk: int, levels: int
) -> None:
    """The torch reference with tiles of ``key_tile`` keys (and ``rows_per_chunk`` rows): the exact
    selection, listed by descending score with tied keys in ascending order."""
    case = _integer_case(seed, n_rows, n_keys, levels=levels)
    want, scores = _whole_row_reference(case, topk)
    got = ref.indexer_topk(*case, topk, rows_per_chunk, key_tile=key_tile)
    assert torch.equal(_by_key(got), want)
    picked = scores.gather(1, got.clamp(min=0).long()).masked_fill(got < 0, float("-inf"))
    assert (picked[:, :-1] >= picked[:, 1:]).all(), "listed by descending score"
    same = (picked[:, :-1] == picked[:, 1:]) & (got[:, 1:] >= 0)
    assert (got[:, :-1][same] < got[:, 1:][same]).all(), "tied keys listed lowest first"


def test_torch_reference_memory_is_a_tile_not_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scores the reference computes at once stay ``rows x key_tile`` however many keys there are."""
    case = _integer_case(7, 9, 300)
    want, _ = _whole_row_reference(case, 16)
    widths: list[tuple[int, int]] = []
    real = ref.indexer_scores

    def spy(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        widths.append((q.shape[0], k.shape[0]))
        return real(q, w, k, s)

    monkeypatch.setattr(ref, "indexer_scores", spy)
    assert torch.equal(_by_key(ref.indexer_topk(*case, 16, 4, key_tile=32)), want)
    assert max(k for _, k in widths) == 32 and max(r for r, _ in widths) == 4 and len(widths) > 9


# ---- the GPU path under the interpreter ------------------------------------------------------------

triton = pytest.importorskip("triton")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    n_rows=st.integers(1, 10),
    n_keys=st.integers(2, 200),
    topk=st.sampled_from([1, 5, 24]),
    key_tile=st.sampled_from([16, 37, 64]),
    levels=st.sampled_from([1, 3]),
)
def test_property_triton_streamed_selection_equals_one_pass(
    seed: int, n_rows: int, n_keys: int, topk: int, key_tile: int, levels: int
) -> None:
    """The Triton logits kernel and the selection kernel, keys streamed right to left through the
    running top-k (the buffer's last ``topk`` columns): the exact selection, ascending keys. The
    torch selector: the same scores (a row chunk that fits one tile takes ``torch.topk``, whose
    choice among ties is its own)."""
    from reference_impl.kernels import fallback
    from reference_impl.kernels.indexer_triton import indexer_topk_triton
    from reference_impl.kernels.topk_select import selected_scores

    fallback.reset_fallbacks()
    case = _integer_case(seed, n_rows, n_keys, levels=levels)
    want, scores = _whole_row_reference(case, topk)
    got = indexer_topk_triton(*case, topk, 4, key_tile=key_tile, selector="triton")
    assert torch.equal(got, want)
    assert not fallback.fallbacks_taken(), "the kernels ran, no fallback"
    by_torch = indexer_topk_triton(*case, topk, 4, key_tile=key_tile, selector="torch")
    assert torch.equal(selected_scores(scores, by_torch), selected_scores(scores, want))


def test_triton_streamed_selection_falls_back_to_the_torch_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    from reference_impl.kernels import fallback, indexer_triton

    case = _integer_case(3, 6, 200)
    want, _ = _whole_row_reference(case, 8)

    def boom(*_a: object, **_k: object) -> torch.Tensor:
        raise RuntimeError("selection kernel unavailable")

    fallback.reset_fallbacks()
    monkeypatch.setattr(indexer_triton, "topk_select_triton", boom)
    got = indexer_triton.indexer_topk_triton(*case, 8, key_tile=50, selector="triton")
    assert torch.equal(_by_key(got), want)
    assert "selection kernel unavailable" in fallback.fallbacks_taken()["Triton top-k selection"]
    fallback.reset_fallbacks()


def test_the_tile_model_is_flat_in_the_context() -> None:
    """The planner's indexer transient (:func:`indexer_tile_bytes`) stops growing past one tile:
    1M keys cost what 256K keys cost, and 128K keys (one tile) no more than that."""
    from reference_impl.kernels.indexer_triton import KEY_TILE, indexer_tile_bytes, logits_tile_shape

    at = {s: indexer_tile_bytes(16384, s, 2048) for s in (131072, 262144, 1 << 20, 1 << 22)}
    assert at[1 << 20] == at[262144] == at[1 << 22]
    assert at[131072] <= at[1 << 20] <= 1.25 * at[131072]
    rows, cols = logits_tile_shape(1 << 20, 2048)
    assert cols == KEY_TILE + 2048 and rows * cols * 4 <= 1 << 30
    assert logits_tile_shape(131072, 2048) == (2048, 131072)  # one tile: the rows of the untiled path
