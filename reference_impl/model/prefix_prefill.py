"""A request's prefix computed the way an earlier chunked prefill computed it, in bounded memory.

A CP run with a prefix needs the prefix's KV bytes in the pools before its first layer, computed
by the single-device model (every rank gets the same bytes: the oracle is deterministic).
Computing the whole prefix in one call would hold one layer's activations for every prefix token
at once (the absorbed queries alone are ``[P, H, 576]``: 18 GiB at 131,072 tokens of
DeepSeek-V3.2) and, kept per layer for comparisons, grow with the layer count.

:func:`prefill_prefix` runs the prefix in chunks of :data:`PREFIX_CHUNK_TOKENS` tokens through
every layer, keeps nothing per chunk but each layer's dense KV (the cache attention reads, the
size of the KV itself) and hands each chunk's new cache rows to a callback as soon as a layer has
made them. What it holds at its peak: the dense caches, one chunk's activations, and one layer's
dequantized full view (what the oracle's attention reads).

:func:`prefix_spans` is the chunking; :func:`reference_impl.model.oracle.run_oracle` uses the same
spans for its prefix, so the oracle's cache and an installed prefix are the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from reference_impl.kvcache.layout import KVLayout
from reference_impl.model.attention import Projection
from reference_impl.model.cache import LayerCache, attention_forward

if TYPE_CHECKING:  # the oracle imports prefix_spans from here
    from reference_impl.model.oracle import DSABlock, DSAModel

PREFIX_CHUNK_TOKENS = 16384
"""Tokens per chunk of a prefix (a power of two, so chunks start on page boundaries)."""

RowsCallback = Callable[[int, int, int, LayerCache], None]
"""``(layer, start, stop, cache)``: ``cache`` (the layer's dense cache) now holds tokens ``[start, stop)``."""


def prefix_spans(prefix: int, chunk_tokens: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of a ``prefix``-token prefix (none for an empty one), chunks of
    ``chunk_tokens`` (default: :data:`PREFIX_CHUNK_TOKENS`, read at the call)."""
    chunk_tokens = PREFIX_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: a prefix chunk needs at least one token")
    return [(s, min(s + chunk_tokens, prefix)) for s in range(0, prefix, chunk_tokens)]


class GrowingCache(LayerCache):
    """A :class:`LayerCache` whose buffers are allocated once for ``capacity`` tokens: appending a
    chunk writes into them instead of concatenating (which would hold the old and the new cache at
    once). ``mla_rows`` / ``index_fp8`` / ``index_scale`` are views of the filled part."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device | str, with_index: bool = True) -> None:
        d = layout.index_head_dim
        index_rows = capacity if with_index else 0  # an IndexShare shared layer keeps no index K
        self._mla = torch.empty(capacity, layout.mla_bytes, dtype=torch.uint8, device=device)
        self._index = torch.empty(index_rows, d, dtype=torch.float8_e4m3fn, device=device)
        self._scale = torch.empty(index_rows, dtype=torch.float32, device=device)
        super().__init__(layout, self._mla[:0], self._index[:0], self._scale[:0], with_index)

    def append(self, proj: Projection) -> None:
        """Quantize and write the projected tokens' KV and (on a layer that keeps it) index K after
        the filled part."""
        start, stop = len(self), len(self) + proj.kv.shape[0]
        if stop > self._mla.shape[0]:
            raise ValueError(f"cache of {self._mla.shape[0]} tokens cannot take tokens up to {stop}")
        if (proj.index_k is not None) != self.with_index:
            raise ValueError(
                f"a cache {'with' if self.with_index else 'without'} index K gets a projection "
                f"{'without' if proj.index_k is None else 'with'} one (IndexShare pattern mismatch)"
            )
        self._mla[start:stop] = self.layout.pack_mla(proj.kv)
        self.mla_rows = self._mla[:stop]
        if proj.index_k is not None:
            k_fp8, k_scale = self.layout.quantize_index_k(proj.index_k)
            self._index[start:stop] = k_fp8
            self._scale[start:stop] = k_scale
            self.index_fp8, self.index_scale = self._index[:stop], self._scale[:stop]


@torch.no_grad()
def prefill_prefix(
    model: DSAModel,
    x: torch.Tensor,
    layout: KVLayout,
    on_rows: RowsCallback,
    chunk_tokens: int | None = None,
    view_dtype: torch.dtype = torch.bfloat16,
) -> list[GrowingCache]:
    """Run a request's prefix ``x [P, dim]`` (its layer-0 inputs) through ``model``'s layers in
    chunks, calling ``on_rows(layer, start, stop, cache)`` after each layer of each chunk.

    Returns the per-layer dense caches (drop them to free the KV copy). The bytes are those of
    :func:`~reference_impl.model.oracle.run_oracle` for the same prefix.
    """
    share = model.cfg.index_share  # IndexShare: a shared layer keeps no index K, reuses the top-k before it
    caches = [GrowingCache(layout, x.shape[0], x.device, share.is_full(layer)) for layer in range(len(model.layers))]
    for start, stop in prefix_spans(x.shape[0], chunk_tokens):
        h = x[start:stop]
        topk = None
        for layer, block in enumerate(cast("list[DSABlock]", model.layers)):  # ModuleList yields nn.Module
            out, topk, _ = attention_forward(
                block.attn, block.attn_norm(h), start, caches[layer], view_dtype, reuse_topk=topk
            )
            h = h + out
            del out
            on_rows(layer, start, stop, caches[layer])
    return caches
