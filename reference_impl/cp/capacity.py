"""KV capacity arithmetic from the real byte layouts: bytes at rest per rank, max context per rank.

Pure functions of the model dims, the KV dtype, the page size and ``C``; the page counts come from
the same ownership rule the sharded store allocates with, so a pool built for a batch has exactly
these sizes (tested).
"""

from __future__ import annotations

from reference_impl.config import KVDtype
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.layout import KVLayout
from reference_impl.presets import ModelConfig


def page_bytes(cfg: ModelConfig, kv_dtype: KVDtype, page_size: int = 64, index: bool = True) -> int:
    """Bytes of one page of one layer: MLA page + index page (``64 x 656 + 8448`` for V3.2 FP8);
    ``index=False``: the MLA page alone (an IndexShare shared layer keeps no index K)."""
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    return layout.mla_page_bytes + (layout.index_page_bytes if index else 0)


def model_page_bytes(cfg: ModelConfig, kv_dtype: KVDtype, page_size: int = 64) -> tuple[int, int]:
    """``(MLA, index)`` bytes of one page over all layers: ``n_layers`` MLA pages, and an index page
    on each layer that runs the indexer (every layer, or IndexShare's full layers)."""
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    return cfg.n_layers * layout.mla_page_bytes, cfg.index_share.n_full * layout.index_page_bytes


def held_pages(
    tokens: int, cp_size: int, sharded: bool, page_size: int = 64, rank: int = 0, interleave: int | None = None
) -> int:
    """Pages of one request of ``tokens`` tokens on ``rank``: all of them (replicated), or the ones
    it holds at ``interleave`` (sharded; default the page size: ``ceil((pages - rank) / C)``)."""
    pages = -(-tokens // page_size)
    return Ownership(cp_size, interleave or page_size, page_size).pages_held(pages, rank) if sharded else pages


def kv_bytes_per_rank(
    cfg: ModelConfig,
    tokens: int,
    cp_size: int,
    sharded: bool,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    rank: int = 0,
    interleave: int | None = None,
) -> int:
    """KV + index bytes at rest on ``rank`` for one request of ``tokens`` tokens, all layers.

    Replicated (phase 0/1): every page on every rank. Sharded (phase 2+): the pages ``rank`` holds
    at ``interleave`` (default the page size: ``ceil((pages - rank) / C)``). With IndexShare only
    the full layers hold index pages.
    """
    return held_pages(tokens, cp_size, sharded, page_size, rank, interleave) * sum(
        model_page_bytes(cfg, kv_dtype, page_size)
    )


def index_bytes_per_rank(
    cfg: ModelConfig,
    tokens: int,
    cp_size: int,
    sharded: bool,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    rank: int = 0,
    interleave: int | None = None,
) -> int:
    """The indexer K part of :func:`kv_bytes_per_rank` (what IndexShare shrinks)."""
    return (
        held_pages(tokens, cp_size, sharded, page_size, rank, interleave)
        * model_page_bytes(cfg, kv_dtype, page_size)[1]
    )


def max_context_per_rank(
    cfg: ModelConfig, budget_bytes: int, cp_size: int, sharded: bool, kv_dtype: KVDtype = "fp8", page_size: int = 64
) -> int:
    """Longest single request whose KV fits ``budget_bytes`` on every rank (a multiple of the page size)."""
    pages_per_rank = budget_bytes // sum(model_page_bytes(cfg, kv_dtype, page_size))
    return pages_per_rank * page_size * (cp_size if sharded else 1)
