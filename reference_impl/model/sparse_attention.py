"""Torch references for the two compute cores of a DSA layer: indexer top-k and sparse MLA attention.

Both work on a **full view**: dense, sequence-ordered KV / index-K tensors of all requests of a
batch, concatenated. A query ``t`` sees keys ``[key_start[t], key_end[t])`` of that view (its own
request, causally: ``key_end = request start + prefix + j + 1``). Indices returned and consumed
are absolute rows of the full view; ``-1`` marks an unused top-k slot.

These functions are the contract the Triton kernels in :mod:`reference_impl.kernels` must match.
They are chunked over query rows so that memory stays bounded at real shapes.

The model calls the two cores, its query preparation (:mod:`reference_impl.model.query_prep`) and
its RMSNorm (:mod:`reference_impl.model.norm`) through a :class:`ComputeOps` object:
:data:`TORCH_OPS` (the references, the default, so the model stays pure torch) or
:data:`reference_impl.kernels.dispatch.KERNEL_OPS` (the kernels, plugged in on top).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reference_impl.model import norm, query_prep
from reference_impl.model.streaming_topk import NEG_INF, RunningTopK, key_tiles, row_tile


def indexer_scores(
    q_fp8: torch.Tensor,  # [T, Hi, D] float8_e4m3fn (Hadamard-rotated, quantized), or its float32 copy
    weights: torch.Tensor,  # [T, Hi] float32: weights_proj(x) * Hi^-0.5 * D^-0.5 * q_scale
    k_fp8: torch.Tensor,  # [S, D] float8_e4m3fn
    k_scale: torch.Tensor,  # [S] float32
) -> torch.Tensor:
    """Index scores ``I[t, s] = k_scale[s] * sum_h weights[t, h] * ReLU(q[t, h] . k[s])`` -> [T, S] f32."""
    logits = torch.einsum("thd,sd->ths", q_fp8.float(), k_fp8.float())
    return torch.einsum("ths,th->ts", logits.relu_(), weights) * k_scale.unsqueeze(0)


HostKeyBounds = tuple[Sequence[int], Sequence[int]]
"""``(key_start [T], key_end [T])`` as host ints: copies of the per-row key ranges, built from metadata."""


def chunk_key_range(
    key_start: torch.Tensor, key_end: torch.Tensor, r0: int, r1: int, host_bounds: HostKeyBounds | None
) -> tuple[int, int]:
    """Keys ``[lo, hi)`` covering rows ``r0:r1``: from ``host_bounds`` when given (no device read),
    else from the device tensors (one host sync per chunk). Per chunk, not per batch: with the
    zigzag split a rank's first rows see a few keys and its last rows nearly all of them."""
    if host_bounds is not None:
        starts, ends = host_bounds
        return min(starts[r0:r1]), max(ends[r0:r1])
    return int(key_start[r0:r1].min()), int(key_end[r0:r1].max())


TORCH_TILE_BYTES = 512 << 20
"""Budget of the torch reference's ``[rows, Hi, keys]`` fp32 logits tile (the scores before the head sum)."""
TORCH_KEY_TILE = 16384
"""Keys per tile of the torch reference (fewer where a row chunk sees fewer)."""


def indexer_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    key_start: torch.Tensor,  # [T] int64
    key_end: torch.Tensor,  # [T] int64, exclusive
    topk: int,
    rows_per_chunk: int = 0,
    host_bounds: HostKeyBounds | None = None,
    *,
    key_tile: int | None = None,
) -> torch.Tensor:
    """Top-``min(topk, visible)`` full-view rows per query by index score -> [T, topk] int32, -1 padded.

    Indices within a row are ordered by descending score (``torch.topk`` order); of keys tied at
    the k-th score the lower ones are kept and listed first (:mod:`~reference_impl.model.streaming_topk`).
    ``host_bounds`` (host copies of ``key_start`` / ``key_end``) give each chunk of rows its key
    range without a device read, i.e. without a host sync; see :func:`chunk_key_range`.

    Memory is bounded by a tile, not by the context: the scores of ``rows_per_chunk`` rows over
    ``key_tile`` keys at a time (default :data:`TORCH_KEY_TILE`, read at the call; ``[rows, Hi, keys]``
    fp32 under :data:`TORCH_TILE_BYTES` when ``rows_per_chunk <= 0``), merged into a running top-k
    per row, exactly.
    """
    n_rows = q_fp8.shape[0]
    out = torch.full((n_rows, topk), -1, dtype=torch.int32, device=q_fp8.device)
    if n_rows == 0 or topk <= 0:
        return out
    key_tile = TORCH_KEY_TILE if key_tile is None else key_tile
    tile_rows, key_tile = row_tile(int(k_fp8.shape[0]), q_fp8.shape[1] * 4, TORCH_TILE_BYTES, key_tile)
    rows_per_chunk = rows_per_chunk if rows_per_chunk > 0 else tile_rows
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        lo, hi = chunk_key_range(key_start, key_end, r0, r1, host_bounds)
        best = RunningTopK.empty(r1 - r0, topk, q_fp8.device)
        q_rows = q_fp8[r0:r1].float()  # once per row chunk, not per tile
        for t0, t1 in key_tiles(lo, hi, key_tile):
            scores = indexer_scores(q_rows, weights[r0:r1], k_fp8[t0:t1], k_scale[t0:t1])
            cols = torch.arange(t0, t1, device=scores.device)
            visible = (cols >= key_start[r0:r1, None]) & (cols < key_end[r0:r1, None])
            best = best.merge(scores.masked_fill_(~visible, NEG_INF), t0)
        out[r0:r1] = best.by_score()
    return out


def sparse_mla_attention(
    q: torch.Tensor,  # [T, H, Dqk] (absorbed: latent part then rope part; Dqk = 576)
    kv: torch.Tensor,  # [S, Dqk] full view (latent then rope), dequantized
    indices: torch.Tensor,  # [T, K] int32 rows of kv, -1 = unused
    softmax_scale: float,
    d_v: int,  # latent width that is also the value (512)
    rows_per_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA attention over the selected rows -> (out [T, H, d_v] f32, lse [T, H] f32, natural log).

    ``out[t, h] = sum_k softmax_k(scale * q[t,h] . kv[idx[t,k]]) * kv[idx[t,k], :d_v]``.
    A row whose indices are all -1 gets ``out = 0`` and ``lse = -inf``.
    """
    n_rows, n_heads, _ = q.shape
    topk = indices.shape[1]
    out = torch.zeros(n_rows, n_heads, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((n_rows, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if rows_per_chunk <= 0:
        # Gathered [rows, K, Dqk] fp32 plus [rows, H, K] scores under ~512 MiB.
        per_row = topk * (kv.shape[1] + n_heads) * 4
        rows_per_chunk = max(1, (512 << 20) // per_row)
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        idx = indices[r0:r1].long()
        valid = idx >= 0
        gathered = kv[idx.clamp(min=0)].float()  # [t, K, Dqk]
        scores = torch.einsum("thd,tkd->thk", q[r0:r1].float(), gathered) * softmax_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, H]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num_(0.0)
        out[r0:r1] = torch.einsum("thk,tkd->thd", probs, gathered[..., :d_v])
        lse[r0:r1] = row_lse
    return out, lse


def _sparse_mla_out(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_attention` with its output stored in ``out_dtype`` (the ops' signature)."""
    out, lse = sparse_mla_attention(q, kv, indices, softmax_scale, d_v)
    return out.to(out_dtype), lse


@dataclass(frozen=True)
class ComputeOps:
    """What a DSA layer hands to kernels: its two compute cores, with the contracts of this module's
    references, its query preparation and its RMSNorm (the references of
    :mod:`reference_impl.model.query_prep` and :mod:`reference_impl.model.norm`):

    * ``indexer_topk(q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, *, host_bounds=None)``
      -> ``[T, topk]`` int32 full-view rows (:func:`indexer_topk`); the order within a row is the
      implementation's (the reference sorts by score, the GPU selection kernel by row): sparse
      attention reads the row as a set;
    * ``sparse_mla_attention(q, kv, indices, softmax_scale, d_v, *, out_dtype=float32)``
      -> ``(out [T, H, d_v] out_dtype, lse [T, H] f32)`` (:func:`sparse_mla_attention`);
    * ``indexer_query(q, cos, sin, hadamard, head_weights, rope_dim, interleaved, scale_fmt)``
      -> ``(q_fp8 [T, Hi, D], weights [T, Hi] f32)`` (:func:`~reference_impl.model.query_prep.indexer_query`);
    * ``rope_into(out, x, cos, sin, interleaved)``: the rotated ``x`` written into ``out``
      (:func:`~reference_impl.model.query_prep.rope_into`);
    * ``rms_norm(x, weight, eps)`` -> ``x.dtype`` (:func:`~reference_impl.model.norm.rms_norm`).
    """

    name: str
    indexer_topk: Callable[..., torch.Tensor]
    sparse_mla_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    indexer_query: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_into: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]


TORCH_OPS = ComputeOps(
    "torch", indexer_topk, _sparse_mla_out, query_prep.indexer_query, query_prep.rope_into, norm.rms_norm
)
