"""Phase 3: reuse the current chunk; materialize only history.

After all-gather #1 every rank already holds the whole current chunk (latent KV and index K) in
sequence order. Phase 2 nevertheless rebuilds those rows from the sharded pages. Phase 3 fills the
full view's current rows straight from the gathered tensors (quantized and dequantized exactly as
the cache stores them, so the view's values are identical) and materializes only the history:

* **current-only** batch (no request has a prefix): nothing to materialize, no collective;
* **mixed** batch: the prefix pages only (a partial last prefix page is gathered whole; its
  current rows are then overwritten from the gathered chunk);
* otherwise (**fallback**): the phase-2 full materialization.

The decision is made per batch from the batch locs alone, so every rank takes the same branch and
issues the same collectives.
"""

from __future__ import annotations

from typing import Literal

import torch

from reference_impl.cp.batch import BatchLocs
from reference_impl.kvcache.layout import KVLayout

BatchKind = Literal["current-only", "mixed", "fallback"]


def classify_batch(batch: BatchLocs, gathered_tokens: int) -> BatchKind:
    """How phase 3 treats this batch. ``gathered_tokens`` is the length of the all-gathered chunk.

    Reuse needs the gathered chunk to cover every extend token of the batch (in-seq CP gathers all
    of them; a batch computed partly outside the CP group would not); anything else falls back.
    """
    if gathered_tokens != batch.meta.total_tokens:
        return "fallback"
    return "mixed" if batch.has_prefix else "current-only"


def history_rows(batch: BatchLocs) -> torch.Tensor:
    """Full-view rows of prefix tokens (request order) -> int64 ``[n_history]``."""
    device = batch.view_locs.device
    rows = [torch.arange(off, off + p, device=device) for off, p in zip(batch.view_offsets, batch.meta.prefix_lens)]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=device)


def fill_current(
    batch: BatchLocs,
    layout: KVLayout,
    kv_seq: torch.Tensor,  # [T, 576] gathered, sequence order, pre-quantization
    index_k_seq: torch.Tensor | None,  # [T, 128]; None on an IndexShare shared layer
    kv_view: torch.Tensor,  # [S, 576] bf16, filled in place
    index_fp8: torch.Tensor | None,  # [S, 128] fp8, filled in place
    index_scale: torch.Tensor | None,  # [S] f32, filled in place
) -> None:
    """Write the current rows of the full view from the gathered chunk, with the cache's rounding
    (the MLA rows alone when the index tensors are ``None``)."""
    fill_rows(kv_seq, index_k_seq, batch.extend_view_rows, kv_view, index_fp8, index_scale, layout)


def fill_rows(
    kv_seq: torch.Tensor,  # [T, 576]
    index_k_seq: torch.Tensor | None,  # [T, 128]
    view_rows: torch.Tensor,  # [T] int64: the full-view row of each
    kv_view: torch.Tensor,
    index_fp8: torch.Tensor | None,
    index_scale: torch.Tensor | None,
    layout: KVLayout,
) -> None:
    """The torch path of :func:`fill_current` for explicit ``view_rows`` (phase 7's fused kernel,
    :mod:`reference_impl.kernels.fused_current`, writes the same bytes)."""
    kv_view[view_rows] = layout.dequantize_mla(layout.pack_mla(kv_seq)).to(kv_view.dtype)
    if index_k_seq is None or index_fp8 is None or index_scale is None:
        return  # an IndexShare shared layer: no indexer K
    k_fp8, k_scale = layout.quantize_index_k(index_k_seq)
    index_fp8.view(torch.uint8)[view_rows] = k_fp8.view(torch.uint8)  # fp8 has no index_put on CPU
    index_scale[view_rows] = k_scale
