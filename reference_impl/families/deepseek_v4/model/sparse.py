"""Torch references for V4's two compute cores: index scores with the entry causal rule, and sparse
attention with sinks over ``[window | selected entries | dense entries]``.

**Causal rule for compressed entries.** Entry ``w`` of ratio ``m`` pools tokens up to
``(w + 1) m - 1``, so the query at position ``t`` may see it only when ``w < (t + 1) // m``
(:func:`visible_entries`). CSA's indexer scores only those, and a query with fewer than
``index_topk`` visible entries selects all of them (``-1`` pads the rest).

**Keys of a query.** A query reads rows of a **view** (dequantized entries, one tensor per batch)
through two sources, both optional per layer:

* ``indices [T, K]`` -- explicit rows, ``-1`` unused: the sliding window's raw tokens and CSA's
  selected entries;
* ``dense_start [T], dense_len [T]`` -- a contiguous run of rows: HCA's visible entries, which
  grow with the context (1M tokens give 8,192 per query) and would not fit an index list.

**Attention sinks.** Each head ``h`` has a learned logit ``sink[h]`` that joins the softmax's
denominator but has no value: ``out = sum_k exp(s_k - lse) v_k`` with
``lse = log(exp(sink) + sum_k exp(s_k))``. K = V: the value is the whole 512-wide entry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference_impl.model.sparse_attention import HostKeyBounds


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entries a query at ``positions [T]`` may see: ``(t + 1) // ratio`` (entries ``0 ..`` that - 1)."""
    return (positions + 1) // ratio


def index_scores(
    q: torch.Tensor,  # [T, Hi, Di] indexer queries (roped, rotated, quantized as the layout says)
    weights: torch.Tensor,  # [T, Hi] float32: weights_proj(x) * Di^-0.5 * Hi^-0.5
    keys: torch.Tensor,  # [S, Di] indexer keys (dequantized)
) -> torch.Tensor:
    """``I[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . k[s])`` -> ``[T, S]`` float32."""
    logits = torch.einsum("thd,sd->ths", q.float(), keys.float())
    return torch.einsum("ths,th->ts", logits.relu_(), weights.float())


def select_entries(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_start: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    rows_per_chunk: int = 0,
    *,
    host_bounds: HostKeyBounds | None = None,
) -> torch.Tensor:
    """Top-``topk`` rows of ``keys`` by index score among ``[key_start[t], key_start[t] + n_visible[t])``
    -> ``[T, topk]`` int32 rows of ``keys``, ``-1`` padded.

    ``keys`` are the indexer keys of a batch's requests, each request's in entry order from its
    ``key_start`` (one request: ``key_start = 0`` and rows are entry indices). ``host_bounds``: the
    same ranges as host ints, for a kernel that must not read them from the device (unused here).
    """
    n_rows = q.shape[0]
    out = torch.full((n_rows, topk), -1, dtype=torch.int32, device=q.device)
    n_keys = keys.shape[0]
    if n_keys == 0:
        return out
    if rows_per_chunk <= 0:  # the [rows, heads, keys] float32 logits under ~512 MiB
        rows_per_chunk = max(1, (512 << 20) // (q.shape[1] * n_keys * 4))
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        scores = index_scores(q[r0:r1], weights[r0:r1], keys)
        rel = torch.arange(n_keys, device=q.device)[None, :] - key_start[r0:r1, None]
        hidden = (rel < 0) | (rel >= n_visible[r0:r1, None])
        scores = scores.masked_fill(hidden, float("-inf"))
        k = min(topk, n_keys)
        vals, idx = scores.topk(k, dim=-1)
        out[r0:r1, :k] = torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx).to(torch.int32)
    return out


def window_indices(
    positions: torch.Tensor, window: int, row_of_position: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The sliding window of each query ``[T] -> [T, window]``: positions ``t - window + 1 .. t``
    mapped to view rows by ``row_of_position``; positions below 0 give ``-1``."""
    pos = positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)[None, :]
    return torch.where(pos >= 0, row_of_position(pos.clamp(min=0)), torch.full_like(pos, -1))


def sparse_attention_sinks(
    q: torch.Tensor,  # [T, H, D]
    view: torch.Tensor,  # [S, D] dequantized entries (K = V)
    indices: torch.Tensor,  # [T, K] int rows of view, -1 unused
    sinks: torch.Tensor,  # [H] float32
    softmax_scale: float,
    dense_start: torch.Tensor | None = None,  # [T] int64 first row of a dense run
    dense_len: torch.Tensor | None = None,  # [T] int64 rows in the run
    dense_width: int | None = None,  # a host bound on dense_len (None: read it from the device)
    rows_per_chunk: int = 0,
) -> torch.Tensor:
    """``out [T, H, D]`` float32: softmax over the selected rows and the sink; see the module docstring."""
    n_rows, n_heads, d = q.shape
    out = torch.zeros(n_rows, n_heads, d, dtype=torch.float32, device=q.device)
    if dense_len is not None and dense_start is not None and n_rows:
        width = dense_width if dense_width is not None else int(dense_len.max())
        run = dense_start[:, None] + torch.arange(width, device=q.device)[None, :]
        run = torch.where(
            torch.arange(width, device=q.device)[None, :] < dense_len[:, None], run, torch.full_like(run, -1)
        )
        indices = torch.cat([indices.long(), run], dim=1)
    k = indices.shape[1]
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, (256 << 20) // max(1, k * (d + n_heads) * 4))
    sink = sinks.float()[None, :, None]
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        idx = indices[r0:r1].long()
        valid = idx >= 0
        gathered = view[idx.clamp(min=0)].float()  # [t, K, D]
        scores = torch.einsum("thd,tkd->thk", q[r0:r1].float(), gathered) * softmax_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink.expand(r1 - r0, -1, -1))
        probs = torch.exp(scores - lse)
        out[r0:r1] = torch.einsum("thk,tkd->thd", probs, gathered)
    return out
