"""Triton pooling for DeepSeek-V4's compressors: the gated softmax over a window's slots, one pass.

Contract: :func:`reference_impl.families.deepseek_v4.model.compressor.pool`. Per entry ``e`` and feature ``d``::

    out[e, d] = sum_s softmax_s(score[row(e, s), col(s) + d]) * kv[row(e, s), col(s) + d]

over the entry's slots ``s`` (``slot_rows[e, s]``, ``-1`` absent: weight 0). ``col(s)`` is 0, except
for CSA's overlapping windows, whose last ``ratio`` slots read the second half of a row (``Cb``,
columns ``D .. 2D``) and whose first ``ratio`` slots the first (``Ca``).

Why a kernel: the torch reference gathers every slot's whole pre-pool row, ``[E, slots, coff * D]``
float32 for values and scores (CSA at 128K tokens, one rank of 8: 4,096 entries x 8 slots x 1,024
features x 4 B = 134 MB each), slices the halves into new tensors, masks, softmaxes and reduces:
about eight passes over those bytes. The kernel reads each slot's ``D`` value and score features
once (``E x slots x D x 8 B``: half the gathered bytes for CSA, whose rows are ``2D`` wide, all of
them for HCA, but once instead of eight times) and writes ``E x D x 4 B``: one program per (entry,
block of features), an online softmax over the slots in registers (running max, rescaled sum and
accumulator, as flash attention's, per feature).

The result equals the reference to float32 rounding, not bit for bit: the sum's order differs,
and on a GPU ``exp`` is the fast hardware one and multiply-adds may be fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.families.deepseek_v4.model.compressor import overlaps
from reference_impl.kernels import interpreter_compat  # noqa: F401  (repairs triton < 3.7's interpreter)

BLOCK_D = 128
"""Features per program: 512 B of values and 512 B of scores per slot row, coalesced."""


@triton.jit
def _pool_kernel(
    kv_ptr,
    score_ptr,
    slot_ptr,
    out_ptr,
    n_slots,
    stride_kv,
    stride_score,
    stride_slot,
    stride_out,
    D: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d_mask = offs < D
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(n_slots):
        row = tl.load(slot_ptr + entry * stride_slot + s)
        present = row >= 0
        row = tl.where(present, row, 0).to(tl.int64)
        col = offs
        if OVERLAP:  # the window's own tokens (the last RATIO slots) pool the second half: Cb
            col = offs + tl.where(s >= RATIO, D, 0)
        mask = d_mask & present
        z = tl.load(score_ptr + row * stride_score + col, mask=mask, other=float("-inf"))
        c = tl.load(kv_ptr + row * stride_kv + col, mask=mask, other=0.0)
        m_new = tl.maximum(m_i, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing present yet in this feature
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(z - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha + p * c
        m_i = m_new
    tl.store(out_ptr + entry * stride_out + offs, acc / tl.where(d_mask, l_i, 1.0), mask=d_mask)  # past D: no 0/0


def pool_triton(
    kv_rows: torch.Tensor,  # [N, coff * D] float32 (rows may be a column slice of a wider table)
    score_rows: torch.Tensor,  # [N, coff * D] float32
    slot_rows: torch.Tensor,  # [E, n_slots] int64, -1 where absent
    ratio: int,
) -> torch.Tensor:
    """Pooled entries ``[E, D]`` float32; see the module docstring."""
    overlap = overlaps(ratio)
    n_entries, n_slots = slot_rows.shape
    width = kv_rows.shape[1] // (2 if overlap else 1)
    if kv_rows.dtype != torch.float32 or score_rows.dtype != torch.float32 or kv_rows.shape != score_rows.shape:
        raise ValueError(
            f"kv {tuple(kv_rows.shape)} {kv_rows.dtype} and score {tuple(score_rows.shape)} "
            f"{score_rows.dtype}: need two float32 tensors of one shape"
        )
    if n_slots != (2 * ratio if overlap else ratio):
        raise ValueError(
            f"slot_rows has {n_slots} slots per entry; ratio {ratio} pools {2 * ratio if overlap else ratio}"
        )
    out = torch.empty(n_entries, width, dtype=torch.float32, device=kv_rows.device)
    if n_entries == 0:
        return out
    if kv_rows.stride(1) != 1 or score_rows.stride(1) != 1:
        kv_rows, score_rows = kv_rows.contiguous(), score_rows.contiguous()
    slot_rows = slot_rows.contiguous()
    _pool_kernel[(n_entries, triton.cdiv(width, BLOCK_D))](
        kv_rows,
        score_rows,
        slot_rows,
        out,
        n_slots,
        kv_rows.stride(0),
        score_rows.stride(0),
        slot_rows.stride(0),
        out.stride(0),
        D=width,
        RATIO=ratio,
        OVERLAP=overlap,
        BLOCK=BLOCK_D,
        num_warps=4,
    )
    return out
