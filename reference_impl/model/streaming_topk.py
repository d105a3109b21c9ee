"""Exact top-k over keys that arrive one tile at a time: the indexer's bounded-memory selection.

The indexer picks, per query row, the ``k`` keys of largest score among the row's visible keys.
Written plainly that needs the row's scores over every key at once: ``[rows, S]`` fp32, which
grows with the context. Here the keys arrive in tiles and a **running top-k** is kept per row:
after each tile, the running top-k and the tile's scores are merged into a new running top-k.
The result is exact, not approximate: under one total order of the keys, the top-k of a union is
the top-k of (the top-k of one part) and the other part, so merging tile by tile selects what one
pass over the whole row selects.

The order (the contract of :func:`~reference_impl.kernels.topk_select.topk_select_reference`,
which the GPU selection kernel meets too): larger score first; between equal scores, the **lower
key** first. So of several keys tied at the k-th score, the lowest keys are kept. ``-inf`` marks
"not visible" and is never selected.

Why it is exact with ties: a merge lays out its candidates in key order (the running keys, each
row's in ascending key order, all lower than the tile's, then the tile's in key order) and picks
the ties at the k-th score by lowest *position*, which is then the lowest key.

Memory: a merge holds the running ``[R, k]`` scores and keys and one tile's ``[R, W]`` scores,
whatever the context; :func:`row_tile` sizes ``R`` and ``W`` for a byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def exact_topk_positions(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``min(k, N)`` largest entries of each row of ``values [R, N]``, ties at the
    k-th value broken by the lowest position, in ascending position order -> ``[R, min(k, N)]`` int64.

    ``torch.topk`` finds the k-th value (its choice among ties does not matter here); the keys
    strictly above it are taken, then the first ``k - above`` keys equal to it by position. A NaN
    (a broken model's score) ranks as ``+inf``, so that every row still yields ``min(k, N)`` positions.
    """
    n_rows, n = values.shape
    kk = min(k, n)
    if kk == 0:
        return torch.empty(n_rows, 0, dtype=torch.long, device=values.device)
    values = values.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=NEG_INF)
    kth = values.topk(kk, dim=1).values[:, -1:]  # [R, 1]
    above = values > kth
    tie = values == kth
    wanted = kk - above.sum(dim=1, keepdim=True)  # ties to keep per row, >= 1
    take = above | (tie & (tie.cumsum(dim=1) <= wanted))  # exactly kk per row
    # The kk taken positions in ascending order: the kk largest of -position (untaken: below all).
    position = torch.arange(n, device=values.device).expand(n_rows, n)
    ranked = torch.where(take, -position, -n - 1)
    return (-ranked.topk(kk, dim=1).values).long()


@dataclass
class RunningTopK:
    """Per row, the best ``k`` keys seen so far: ``values [R, k]`` f32 (``-inf``: no key) and
    ``keys [R, k]`` int64 (``-1``: no key). Invariant: a row's keys with finite values are in
    ascending key order (slots holding ``-inf`` may sit anywhere), and all are below the next tile's."""

    values: torch.Tensor
    keys: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, k: int, device: torch.device | str) -> RunningTopK:
        return cls(
            torch.full((n_rows, k), NEG_INF, dtype=torch.float32, device=device),
            torch.full((n_rows, k), -1, dtype=torch.long, device=device),
        )

    def merge(self, scores: torch.Tensor, first_key: int) -> RunningTopK:
        """The running top-k after a tile: ``scores [R, W]`` f32 of keys ``first_key ..
        first_key + W - 1`` (``-inf`` where a row does not see the key), all above the running keys."""
        k = self.values.shape[1]
        keys = torch.arange(first_key, first_key + scores.shape[1], device=scores.device).expand(scores.shape[0], -1)
        values = torch.cat([self.values, scores.float()], dim=1)  # candidates in key order
        all_keys = torch.cat([self.keys, keys], dim=1)
        pos = exact_topk_positions(values, k)
        kept = values.gather(1, pos)
        kept_keys = torch.where(torch.isneginf(kept), -1, all_keys.gather(1, pos))
        return RunningTopK(kept, kept_keys)

    def by_key(self) -> torch.Tensor:
        """``[R, k]`` int32: each row's keys in ascending order, ``-1`` padded at the end."""
        missing = self.keys < 0
        order = missing.to(torch.int8).argsort(dim=1, stable=True)  # keys first (already ascending), then -1s
        return self.keys.gather(1, order).to(torch.int32)

    def by_score(self) -> torch.Tensor:
        """``[R, k]`` int32: each row's keys by descending score (ties: lower key first), ``-1`` padded
        (``torch.topk``'s order, with its unspecified tie order made the lower key's)."""
        order = self.values.argsort(dim=1, descending=True, stable=True)  # -inf (no key) last
        return self.keys.gather(1, order).to(torch.int32)


def key_tiles(lo: int, hi: int, width: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into tiles of ``width`` keys from ``lo`` (the last one may be shorter)."""
    return [(t0, min(t0 + width, hi)) for t0 in range(lo, hi, max(width, 1))]


def row_tile(n_keys: int, bytes_per_row_key: int, budget_bytes: int, key_tile: int) -> tuple[int, int]:
    """``(rows, keys)`` of one tile: ``keys = min(n_keys, key_tile)`` and as many rows as keep
    ``rows x keys x bytes_per_row_key`` under ``budget_bytes`` (at least one)."""
    keys = max(1, min(n_keys, key_tile))
    return max(1, budget_bytes // (keys * bytes_per_row_key)), keys
