"""KV cache: byte layouts (:mod:`.layout`), paged pools (:mod:`.pool`), page allocation (:mod:`.allocator`)."""

from __future__ import annotations

from .allocator import PageAllocator, ReqToToken, RequestPageTable
from .layout import (
    INDEX_HEAD_DIM,
    MLA_QUANT_BLOCK,
    KVLayout,
    dequantize_mla,
    index_page_bytes,
    index_token_bytes,
    mla_token_bytes,
    pack_index_pages,
    pack_mla,
    quantize_index_k,
    unpack_index_pages,
    unpack_mla_fp8,
)
from .pool import LocOutOfRangeError, PagedKVPool

__all__ = [
    "INDEX_HEAD_DIM",
    "MLA_QUANT_BLOCK",
    "KVLayout",
    "LocOutOfRangeError",
    "PageAllocator",
    "PagedKVPool",
    "ReqToToken",
    "RequestPageTable",
    "dequantize_mla",
    "index_page_bytes",
    "index_token_bytes",
    "mla_token_bytes",
    "pack_index_pages",
    "pack_mla",
    "quantize_index_k",
    "unpack_index_pages",
    "unpack_mla_fp8",
]
