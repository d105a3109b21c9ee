"""One rank's split as device tensors (:class:`SplitIndex`), built once per batch before the layer
loop, so the loop copies nothing from the host (phase 6's invariant holds at every level)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.cp.split_metadata import SplitMetadata


def local_index_tensor(meta: SplitMetadata, rank: int, device: Any = "cpu") -> torch.Tensor:
    """``int64 [rank_lengths[rank]]``: global indices of ``rank``'s tokens, so ``local = full[idx]``.

    Built from host metadata (a host-to-device copy on a GPU): build it once per batch, outside
    the layer loop.
    """
    return torch.tensor(meta.local_tokens(rank), dtype=torch.long, device=device)


def rerange_tensor(meta: SplitMetadata, device: Any = "cpu", *, padded: bool = False) -> torch.Tensor:
    """``int64 [total_tokens]``: ``gathered[idx]`` is sequence order.

    ``padded=False`` indexes the trimmed rank-major tensor (``total_tokens`` rows); ``padded=True``
    indexes the raw padded all-gather output (``cp_size * max_rank_len`` rows), skipping the trim.
    Built from host metadata: once per batch, outside the layer loop.
    """
    values = meta.padded_rerange_index if padded else meta.rerange_index
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass(frozen=True)
class SplitIndex:
    """One rank's split as device tensors, built once per batch so the layer loop copies nothing
    from the host (phase 6's invariant holds at every level)."""

    rank_lengths: tuple[int, ...]  # rows each rank sends in the all-gathers
    local: torch.Tensor  # int64 [n_local]: global indices of this rank's tokens
    rerange: torch.Tensor  # int64 [T]: trimmed rank-major row of each global token
    padded_rerange: torch.Tensor  # int64 [T]: padded all-gather row of each global token

    @classmethod
    def build(cls, meta: SplitMetadata, rank: int, device: Any = "cpu") -> SplitIndex:
        return cls(
            meta.rank_lengths,
            local_index_tensor(meta, rank, device),
            rerange_tensor(meta, device),
            rerange_tensor(meta, device, padded=True),
        )
