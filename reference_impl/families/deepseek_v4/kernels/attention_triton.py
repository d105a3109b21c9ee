"""Triton sparse attention with sinks for DeepSeek-V4: ``[window | selected entries | dense entries]``.

Contract: :func:`reference_impl.families.deepseek_v4.model.sparse.sparse_attention_sinks`.

* ``q [T, H, 512]``, ``view [S, 512]`` (K = V: the whole entry is key and value), same dtype;
* ``indices [T, K]`` rows of ``view`` (the window's raw tokens, then CSA's selected entries),
  ``-1`` or any row outside ``[0, S)`` unused;
* optionally a **dense run** per query, rows ``[dense_start[t], dense_start[t] + dense_len[t])``
  (HCA's visible entries: up to 8,192 at 1M tokens, read without an index list);
* ``sinks [H]`` float32 logits that join every softmax's denominator;
* returns ``out [T, H, 512]`` float32.

Shape of the kernel: one program per (query, block of ``BLOCK_H`` heads), heads fastest so one
query's programs share the gathered rows through L2 -- the layout of the V3.2 sparse MLA kernel
(:mod:`reference_impl.kernels.sparse_mla_triton`), with K = V: each tile of ``BLOCK_K`` rows is
gathered once, ``[BLOCK_H, 512] x [512, BLOCK_K]`` gives the scores, an online softmax in base 2
rescales, and ``[BLOCK_H, BLOCK_K] x [BLOCK_K, 512]`` accumulates the output. Two loops share the
accumulator: the index list, then the dense run (no index loads). The sink enters once at the end:
``l += 2^(sink log2 e - m)``. Under the CPU interpreter operands are upcast to float32 (``UPCAST``),
as in the V3.2 kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from reference_impl.kernels.triton_helpers import pow2_at_least_16

LOG2E = math.log2(math.e)
GPU_CONFIG = (64, 64, 8, 2)
"""BLOCK_H, BLOCK_K, num_warps, num_stages on GPU, chosen by `scripts/sweep_v4_attention.py` at V4-Flash's
64 heads (measured: `docs/deepseek-v4.md#tuning-history-the-attention-kernel`)."""


@triton.jit
def _tile(
    q,
    kv_ptr,
    rows,
    valid,
    offs_d,
    d_mask,
    stride_kv,
    m_i,
    l_i,
    acc,
    qk_scale_log2,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One tile of ``BLOCK_K`` rows: scores, online softmax, accumulate ``p @ kv``."""
    kv = tl.load(
        kv_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kv + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        kv = kv.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(kv), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of heads with nothing valid yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, kv, acc=acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(kv.dtype), kv, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _v4_attention_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    dstart_ptr,
    dlen_ptr,
    sink_ptr,
    out_ptr,
    n_heads,
    n_kv,
    topk,
    n_head_blocks,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_it,
    stride_ot,
    stride_oh,
    qk_scale_log2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_DENSE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // n_head_blocks
    offs_h = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_kk = tl.arange(0, BLOCK_K)
    h_mask = offs_h < n_heads
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, topk, BLOCK_K):
        offs_k = k0 + offs_kk
        rows = tl.load(idx_ptr + token * stride_it + offs_k, mask=offs_k < topk, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < n_kv)
        m_i, l_i, acc = _tile(
            q, kv_ptr, rows, valid, offs_d, d_mask, stride_kv, m_i, l_i, acc, qk_scale_log2, UPCAST, IEEE
        )
    if HAS_DENSE:
        start = tl.load(dstart_ptr + token).to(tl.int64)
        length = tl.load(dlen_ptr + token).to(tl.int64)
        for k0 in range(0, length, BLOCK_K):
            offs_k = k0 + offs_kk
            rows = start + offs_k
            valid = (offs_k < length) & (rows >= 0) & (rows < n_kv)
            m_i, l_i, acc = _tile(
                q, kv_ptr, rows, valid, offs_d, d_mask, stride_kv, m_i, l_i, acc, qk_scale_log2, UPCAST, IEEE
            )
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    scale = tl.exp2(m_i - m_fin)
    scale = tl.where(m_i == float("-inf"), 0.0, scale)
    denom = l_i * scale + tl.exp2(sink - m_fin)
    out = acc * (scale / denom)[:, None]
    tl.store(
        out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )


def v4_sparse_attention_triton(
    q: torch.Tensor,
    view: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    dense_start: torch.Tensor | None = None,
    dense_len: torch.Tensor | None = None,
    dense_width: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """The kernel behind :func:`~reference_impl.families.deepseek_v4.model.sparse.sparse_attention_sinks`'s contract
    (``dense_width`` is not needed: each program reads its own run length)."""
    n_tok, n_heads, d = q.shape
    if view.shape[1] != d or view.dtype != q.dtype:
        raise ValueError(f"view {tuple(view.shape)} {view.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    interp = q.device.type != "cuda"
    block_h, block_k, warps, stages = config or (GPU_CONFIG if not interp else (16, 16, 4, 1))
    block_h = min(block_h, pow2_at_least_16(n_heads))
    out = torch.empty(n_tok, n_heads, d, dtype=torch.float32, device=q.device)
    if n_tok == 0:
        return out
    q, view = q.contiguous(), view.contiguous()
    indices = indices.contiguous() if indices.shape[1] else indices.new_full((n_tok, 1), -1)
    if dense_start is not None and dense_len is not None:
        has_dense, dstart, dlen = True, dense_start.contiguous(), dense_len.contiguous()
    else:
        has_dense, dstart, dlen = False, indices, indices  # unused placeholders when no run
    n_blocks = triton.cdiv(n_heads, block_h)
    _v4_attention_kernel[(n_tok * n_blocks,)](
        q,
        view,
        indices,
        dstart,
        dlen,
        sinks.float().contiguous(),
        out,
        n_heads,
        view.shape[0],
        indices.shape[1],
        n_blocks,
        q.stride(0),
        q.stride(1),
        view.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        softmax_scale * LOG2E,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        HAS_DENSE=has_dense,
        UPCAST=interp,
        IEEE=q.dtype == torch.float32 and not interp,
        num_warps=warps,
        num_stages=stages,
    )
    return out
