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


def page_bytes(cfg: ModelConfig, kv_dtype: KVDtype, page_size: int = 64) -> int:
    """Bytes of one page of one layer: MLA page + index page (``64 x 656 + 8448`` for V3.2 FP8)."""
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    return layout.mla_page_bytes + layout.index_page_bytes


def kv_bytes_per_rank(
    cfg: ModelConfig, tokens: int, cp_size: int, sharded: bool, kv_dtype: KVDtype = "fp8", page_size: int = 64, rank: int = 0,
    interleave: int | None = None,
) -> int:
    """KV + index bytes at rest on ``rank`` for one request of ``tokens`` tokens, all layers.

    Replicated (phase 0/1): every page on every rank. Sharded (phase 2+): the pages ``rank`` holds
    at ``interleave`` (default the page size: ``ceil((pages - rank) / C)``).
    """
    pages = -(-tokens // page_size)
    ownership = Ownership(cp_size, interleave or page_size, page_size)
    held = ownership.pages_held(pages, rank) if sharded else pages
    return cfg.n_layers * held * page_bytes(cfg, kv_dtype, page_size)


def max_context_per_rank(
    cfg: ModelConfig, budget_bytes: int, cp_size: int, sharded: bool, kv_dtype: KVDtype = "fp8", page_size: int = 64
) -> int:
    """Longest single request whose KV fits ``budget_bytes`` on every rank (a multiple of the page size)."""
    pages_per_rank = budget_bytes // (cfg.n_layers * page_bytes(cfg, kv_dtype, page_size))
    return pages_per_rank * page_size * (cp_size if sharded else 1)
