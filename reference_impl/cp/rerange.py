"""All-gather #1 (per layer) and the rerange from rank-major to sequence order.

Each rank computes the latent KV (576 wide) and indexer K (128 wide) of its own tokens only. The
per-layer all-gather pads every rank's rows to the longest rank, gathers them rank-major, trims
the padding, and **reranges** the rows into sequence order (the concatenated extend tokens of all
requests), so every rank then holds the whole current chunk in the order the cache and the full
view use. The torch path is two passes (trim, then reorder); phase 7 fuses them.
"""

from __future__ import annotations

import torch

from reference_impl.cp.comm import CPGroup
from reference_impl.cp.split_index import SplitIndex


def rerange(gathered: torch.Tensor, index: SplitIndex) -> torch.Tensor:
    """Rank-major rows (unpadded all-gather result) -> sequence order: ``gathered[rerange_index]``."""
    return gathered.index_select(0, index.rerange)


def gather_current(
    group: CPGroup, index: SplitIndex, local: torch.Tensor, tag: str, fused: bool = False, debug: bool = False
) -> torch.Tensor:
    """All-gather each rank's ``local [n_local, W]`` rows and return ``[T, W]`` in sequence order.

    ``index`` is the batch's :class:`~reference_impl.cp.split.SplitIndex` (device tensors built
    before the layer loop). ``fused`` (phase 7) reranges straight from the padded buffer in one
    pass (Triton on CUDA) instead of trimming, then reordering.
    """
    if fused:
        from reference_impl.cp.fused_ops import rerange_padded

        raw = group.all_gather_rows_padded_raw(local, index.rank_lengths, tag=tag)
        return rerange_padded(raw, index, debug=debug)
    return rerange(group.all_gather_padded(local, index.rank_lengths, tag=tag), index)
