"""One request's V4 cache of one layer, in the byte layouts, and the single-device layer call.

:class:`V4LayerCache` holds, for one request and one layer:

* ``raw`` -- every raw token's entry (the oracle keeps them all; an engine keeps the last
  ``window - 1``, :meth:`V4LayerCache.window_tail`, which is all a later token can read);
* ``entries`` / ``index_keys`` -- the compressed entries (CSA / HCA) and CSA's indexer keys, in
  entry order;
* the **compressor state**: pre-pool rows (float32 values and scores) of positions
  ``[state_start, n_tokens)``, the windows not yet complete (one window earlier for CSA's overlap).

:func:`compress_new` turns pre-pool rows into the entries a span of tokens completes; the oracle
and the CP ranks both call it, so the entries match bit for bit. :func:`v4_layer_forward` is the
single-device call of one layer for a request's next tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reference_impl.families.deepseek_v4.cache_layout import (
    decode_index,
    decode_main,
    encode_index,
    encode_main,
    index_entry_bytes,
    main_entry_bytes,
)
from reference_impl.families.deepseek_v4.model.attention import V4Attention, V4Projection
from reference_impl.families.deepseek_v4.model.compressor import Compressor, pool, slot_positions, state_start
from reference_impl.families.deepseek_v4.model.sparse import visible_entries, window_indices


def compress_new(
    compressor: Compressor,
    finish,  # (pooled [E, D] f32, entries [E]) -> entries in the compute dtype
    kv_rows: torch.Tensor,  # [N, coff * D] float32 pre-pool value rows of positions base .. base + N - 1
    score_rows: torch.Tensor,  # [N, coff * D] float32 score rows
    base: int,  # position of row 0
    entries: torch.Tensor,  # [E] int64 entry indices to build (all their slots within the rows)
    pool_fn=pool,  # the pooling: the torch reference, or a kernel with its contract (V4Ops.pool)
) -> torch.Tensor:
    """The finished entries ``[E, D]`` for ``entries``, from rows covering every slot they read."""
    slots = slot_positions(entries, compressor.ratio)
    rows = torch.where(slots >= 0, slots - base, torch.full_like(slots, -1))
    if bool(((slots >= 0) & ((rows < 0) | (rows >= kv_rows.shape[0]))).any()):
        raise AssertionError(f"entries {entries.tolist()} read positions outside [{base}, {base + kv_rows.shape[0]})")
    return finish(pool_fn(kv_rows, score_rows, rows, compressor.ratio), entries)


@dataclass
class V4LayerCache:
    """Dense cache of one request for one layer (see the module docstring)."""

    codec: str
    ratio: int
    index_head_dim: int
    raw: torch.Tensor  # uint8 [N, main bytes]
    entries: torch.Tensor  # uint8 [E, main bytes]
    index_keys: torch.Tensor  # uint8 [E, index bytes] (CSA; empty otherwise)
    pool_kv: torch.Tensor  # float32 [N - state_start, coff * D]
    pool_score: torch.Tensor
    index_pool_kv: torch.Tensor  # float32 [N - state_start, 2 * Di] (CSA)
    index_pool_score: torch.Tensor
    n_tokens: int = 0
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    raw_start: int = 0  # position of ``raw``'s row 0: a decode that received the window tail keeps only it

    @classmethod
    def empty(
        cls, codec: str, ratio: int, head_dim: int, index_head_dim: int, device: torch.device | str
    ) -> V4LayerCache:
        coff = 2 if ratio == 4 else 1
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        u8: dict[str, Any] = dict(dtype=torch.uint8, device=device)
        return cls(
            codec,
            ratio,
            index_head_dim,
            torch.empty(0, main_entry_bytes(codec), **u8),
            torch.empty(0, main_entry_bytes(codec), **u8),
            torch.empty(0, index_entry_bytes(codec, index_head_dim) if ratio == 4 else 0, **u8),
            torch.empty(0, coff * head_dim if ratio else 0, **f32),
            torch.empty(0, coff * head_dim if ratio else 0, **f32),
            torch.empty(0, 2 * index_head_dim if ratio == 4 else 0, **f32),
            torch.empty(0, 2 * index_head_dim if ratio == 4 else 0, **f32),
        )

    @property
    def state_start(self) -> int:
        """First position whose pre-pool row the state holds."""
        return state_start(self.n_tokens, self.ratio) if self.ratio else self.n_tokens

    def window_tail(self, window: int) -> torch.Tensor:
        """The raw entries a later token's window can still read: the last ``window - 1``."""
        return self.raw[max(0, self.n_tokens - (window - 1) - self.raw_start) :]

    def append(self, attn: V4Attention, proj: V4Projection, start: int, dtype: torch.dtype) -> None:
        """Encode the new tokens' raw entries and the entries they complete; advance the state."""
        n_new = proj.kv.shape[0]
        self.raw = torch.cat([self.raw, encode_main(proj.kv, self.codec)])
        stop = start + n_new
        if self.ratio:
            base = self.state_start
            new = torch.arange(start // self.ratio, stop // self.ratio, device=self.raw.device)
            # a compressed layer (ratio > 0) has a compressor, and project() made its pre-pool rows
            assert attn.compressor is not None and proj.pool_kv is not None and proj.pool_score is not None
            kv = torch.cat([self.pool_kv, proj.pool_kv])
            score = torch.cat([self.pool_score, proj.pool_score])
            main = compress_new(
                attn.compressor, lambda p, e: attn.finish_entries(p, e, dtype), kv, score, base, new, attn.ops.pool
            )
            self.entries = torch.cat([self.entries, encode_main(main, self.codec)])
            keep = state_start(stop, self.ratio) - base
            self.pool_kv, self.pool_score = kv[keep:], score[keep:]
            if attn.indexer is not None:
                assert proj.index_pool_kv is not None and proj.index_pool_score is not None  # project() made them
                ikv = torch.cat([self.index_pool_kv, proj.index_pool_kv])
                iscore = torch.cat([self.index_pool_score, proj.index_pool_score])
                keys = compress_new(
                    attn.indexer.compressor,
                    lambda p, e: attn.finish_index_keys(p, e, dtype),
                    ikv,
                    iscore,
                    base,
                    new,
                    attn.ops.pool,
                )
                self.index_keys = torch.cat([self.index_keys, encode_index(keys, self.codec)])
                self.index_pool_kv, self.index_pool_score = ikv[keep:], iscore[keep:]
        self.n_tokens = stop


@torch.no_grad()
def v4_layer_forward(
    attn: V4Attention, x: torch.Tensor, start_pos: int, cache: V4LayerCache, view_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, V4Projection]:
    """One request's tokens ``x [T, dim]`` at ``start_pos`` against ``cache`` (holding exactly its first
    ``start_pos`` tokens; this call appends the ``T`` new ones).

    Returns ``(out [T, dim], topk [T, index_topk] int32 CSA entry indices, -1 padded (``[T, 0]`` on
    other layers), projection)``.
    """
    if cache.n_tokens != start_pos:
        raise ValueError(f"cache holds {cache.n_tokens} tokens but start_pos is {start_pos}")
    cfg = attn.cfg
    positions = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
    proj = attn.project(x, positions, quantize_index=cache.codec == "fp8")
    cache.append(attn, proj, start_pos, x.dtype)

    lo = max(0, start_pos - cfg.window_size + 1)  # first position any new token's window reads
    if lo < cache.raw_start:
        raise ValueError(f"the window reads position {lo}; the cache's raw entries start at {cache.raw_start}")
    window_view = decode_main(cache.raw[lo - cache.raw_start :], cache.codec).to(view_dtype)
    indices = [window_indices(positions, cfg.window_size, lambda p: p - lo)]
    topk = torch.empty(x.shape[0], 0, dtype=torch.int32, device=x.device)
    views, dense_start, dense_len = [window_view], None, None
    if attn.ratio:
        offset = window_view.shape[0]
        views.append(decode_main(cache.entries, cache.codec).to(view_dtype))
        n_visible = visible_entries(positions, attn.ratio)
        if attn.indexer is not None:
            keys = decode_index(cache.index_keys, cache.codec, cache.index_head_dim)
            topk = attn.ops.select_entries(
                proj.index_q, proj.index_weights, keys, torch.zeros_like(positions), n_visible, cfg.index_topk
            )
            indices.append(torch.where(topk >= 0, topk.long() + offset, torch.full_like(topk, -1, dtype=torch.long)))
        else:
            dense_start, dense_len = torch.full_like(positions, offset), n_visible
    width = (start_pos + x.shape[0]) // attn.ratio if attn.ratio else 0
    out = attn.attend(proj, positions, torch.cat(views), torch.cat(indices, dim=1), dense_start, dense_len, width)
    return out, topk, proj
