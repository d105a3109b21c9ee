"""Warp-specialized Gluon sparse MLA attention for Hopper: a gathering warp group and two seesawing consumers.

Contract: the same as :func:`reference_impl.kernels.sparse_mla_triton.sparse_mla_attention_triton`
(q ``[T, H, D_qk]``, full-view kv ``[S, D_qk]``, indices ``[T, K]`` with ``-1`` for unused slots,
-> out ``[T, H, d_v]`` and natural-log lse ``[T, H]``), for bf16 / fp16 operands on an sm_90 GPU.

Why a third kernel. The first Gluon kernel (:mod:`reference_impl.kernels.sparse_mla_gluon`) runs
one instruction stream in both warp groups: each waits for the gathered rows, computes half of the
score tile (64 heads x 32 keys, a narrow product), meets the other for the softmax, then computes
half of the value product. The tensor cores idle through every gather wait, softmax and barrier
(measured: ``docs/compute-kernels.md#warp-specialized-gluon-kernel``). This kernel gives each job
its own warps (FlashMLA's SM90 sparse prefill schedule, expressed with Gluon's ``warp_specialize``):

* a **producer** warp group gathers the selected KV rows with ``cp.async`` into two key blocks of
  shared memory, each split into a left quarter (``d_v / 2`` columns) and a right one (the other
  ``d_v / 2`` and the rope part), each quarter with a ``ready`` and a ``free`` mbarrier, so a
  consumer starts on one quarter while the next lands;
* **consumer 0** computes the score tile of even key blocks (all 64 heads x 64 keys, K = D_qk),
  **consumer 1** that of odd blocks; consumer 0 owns output columns ``[0, d_v / 2)``, consumer 1
  the rest. Per pair of blocks (2i in slot 0, 2i+1 in slot 1):

      C0: S0 = q @ K0^T         m0 = max(m, rowmax S0)      -> sM0         P0 @ V0[:, left]
      C1: S1 = q @ K1^T         m1 = max(m0, rowmax S1)     -> sM1         P1 @ V1[:, right]
      C0: P0 *= exp2(m0 - m1) -> sS0;  O_left  = O_left * exp2(m0 - m1) + sS1 @ V1[:, left]
      C1: P1 -> sS1;                   O_right += sS0 @ V0[:, right]

  so one consumer's softmax runs while the other's products occupy the tensor cores (the
  "seesaw"), the score products are 64 keys wide (no product runs twice), and each probability
  tile is used once from registers (the local half) and once from shared memory (the other's).

Shared memory (d_v = 512, rope 64, bf16): q 72 KiB + two key blocks 2 x 72 KiB + sS1 8 KiB; sS0
lives in slot 0's rope part, which no one reads once consumer 0's score product is done and which
the producer refills only after consumer 1 has used sS0 (slot 0's right quarter ``free``).
Registers: ``setmaxnreg`` gives the consumers :data:`CONSUMER_REGS` each and the producer
:data:`PRODUCER_REGS` (the 64 x 256 fp32 output half alone is 128 per thread).

Gluon has no CPU interpreter: the kernel is checked against the torch reference on a GPU
(``tests/gpu/test_gpu_sparse_mla_gluon.py``); it compiles for sm_90 without one
(``tests/test_kernels_compute.py`` builds it where Triton's CUDA backend is installed).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from reference_impl.kernels.sparse_mla_gluon import (
    hopper_operand_reason,
    inputs_reason,
    load_q_part,
    prepare_launch,
    width_reason,
)

BLOCK_H = 64
BLOCK_K = 64
# Registers per thread after `setmaxnreg` (multiples of 8; 128 threads each; the three warp groups
# share the SM's 64K): the default partition (consumer 0) gets what the two workers leave.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# Queue the next pair's score product behind consumer 0's last value product (`_consumer0_pair`);
# on by default (measured: docs/compute-kernels.md#warp-specialized-gluon-kernel).
GPU_PIPELINE_QK: bool = True
# The running max starts finite so that exp2(m_old - m_new) is 1, not NaN, before any valid key.
MAX_INIT = gl.constexpr(-1.0e30)

# mbarrier slots: the four quarters' `ready` and `free`; the consumers' hand-offs.
K0L, K0R, K1L, K1R = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
M0_READY, M1_READY, S0_READY = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
S1_READY, L0_READY, L1_READY = gl.constexpr(3), gl.constexpr(4), gl.constexpr(5)


@gluon.jit
def _wait_landed(bar, phase):
    """Wait for a quarter's cp.async copies, then make them visible to the tensor cores."""
    mbarrier.wait(bar, phase)
    fence_async_shared()


@gluon.jit
def _views_this_pair(pair, q_half, q_rope, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE: gl.constexpr):
    """The shared-memory views one pair of key blocks uses, indexed from a value the compiler cannot
    prove constant (``pair >> 30`` is 0 for any real top-k): the tensor-core descriptors of the
    36 + 36 steps of a score product are then recomputed each pair, in uniform registers, instead of
    being hoisted out of the loop into ~150 regular registers that spill."""
    zero = pair >> 30
    s0 = k_rope.index(zero) if S0_IN_ROPE else s1_smem.index(zero + 1)
    return (
        q_half.index(zero),
        q_half.index(zero + 1),
        q_rope.index(zero),
        k_l.index(zero),
        k_r.index(zero),
        k_rope.index(zero),
        k_l.index(zero + 1),
        k_r.index(zero + 1),
        k_rope.index(zero + 1),
        s0,
        s1_smem.index(zero),
    )


@gluon.jit
def _slot_valid(idx_row, k0, topk, n_kv, BLOCK_K: gl.constexpr, s_layout: gl.constexpr):
    """Which of key block ``k0``'s slots hold a row (not ``-1``, in range, before ``topk``); loaded
    before the score product is waited for, so the load's latency hides behind it."""
    offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    idx = gl.load(idx_row + offs_k, mask=offs_k < topk, other=-1)
    return (idx >= 0) & (idx < n_kv)


@gluon.jit
def _store_out(
    acc,
    l_i,
    out_ptr,
    token,
    head0,
    n_heads,
    stride_ot,
    stride_oh,
    COL0: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_H: gl.constexpr,
    o_layout: gl.constexpr,
):
    """out[token, heads, COL0 : COL0 + HALF] = acc / l (0 where no key was valid)."""
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, o_row)
    out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    heads = head0 + gl.arange(0, BLOCK_H, layout=o_row)
    cols = COL0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads < n_heads)[:, None])


@gluon.jit
def _issue_scores0(views, ready, phase, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, s_layout: gl.constexpr):
    """Queue S0 = q @ K0^T (2 x 64 x 64 x D_qk flops) on the tensor cores, the left quarter as soon
    as it lands, then the right one and the rope part; returns the pending accumulator."""
    q_l, q_r, q_rope, k0_l, k0_r, k0_rope, _, _, _, _, _ = views
    _wait_landed(ready.index(K0L), phase)
    s = warpgroup_mma(
        q_l, k0_l.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout), use_acc=False, is_async=True
    )
    _wait_landed(ready.index(K0R), phase)
    s = warpgroup_mma(q_r, k0_r.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_rope, k0_rope.permute((1, 0)), s, is_async=True)


@gluon.jit
def _consumer0_pair(
    pair,
    s_pending,
    m_i,
    l_i,
    acc,
    q_half,
    q_rope1,
    k_l,
    k_r,
    k_rope,
    s1_smem,
    stats,
    ready,
    free,
    hand,
    idx_row,
    topk,
    n_kv,
    qk_scale_log2,
    HALF: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    S0_IN_ROPE: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    ISSUE_NEXT: gl.constexpr,
    PIPELINE_QK: gl.constexpr,
):
    """Consumer 0's share of one pair whose S0 is already queued (``s_pending``); with ``ISSUE_NEXT``
    it queues the next pair's S0 before returning -- with ``PIPELINE_QK`` right behind this pair's
    last value product, so the tensor cores go from one to the other without a gap."""
    dtype: gl.constexpr = k_l.dtype
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    phase = pair & 1
    views = _views_this_pair(pair, q_half, q_rope1, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE)
    _, _, _, k0_l, _, _, k1_l, _, _, s0_smem, s1_p = views
    valid = _slot_valid(idx_row, pair * 2 * BLOCK_K, topk, n_kv, BLOCK_K, s_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_pending,))
    s = gl.where(valid[None, :], s * qk_scale_log2, float("-inf"))

    m0 = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m0)
    p = gl.exp2(s - m0[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    stats[0].store(m0)
    mbarrier.arrive(hand.index(M0_READY))  # consumer 1 takes m0 as its running max

    # O_left = O_left * alpha + P0 @ V0[:, left], P0 from registers.
    acc = acc * gl.convert_layout(alpha, o_row)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_operand)
    acc = warpgroup_mma(p_op, k0_l, acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    mbarrier.arrive(free.index(K0L))

    # Consumer 1's max m1 >= m0: hand it P0 in m1's units, and move O_left and l there too.
    mbarrier.wait(hand.index(M1_READY), phase)
    m1 = stats[1].load(s_row)
    beta = gl.exp2(m0 - m1)
    s0_smem.store((p * beta[:, None]).to(dtype))
    fence_async_shared()
    mbarrier.arrive(hand.index(S0_READY))
    l_i = l_i * beta
    acc = acc * gl.convert_layout(beta, o_row)[:, None]

    # O_left += P1 @ V1[:, left], P1 from consumer 1 through shared memory.
    mbarrier.wait(hand.index(S1_READY), phase)
    acc = warpgroup_mma(s1_p, k1_l, acc, is_async=True)
    if ISSUE_NEXT and PIPELINE_QK:
        next_views = _views_this_pair(pair + 1, q_half, q_rope1, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE)
        q_l, q_r, q_rope, k0_l, k0_r, k0_rope, _, _, _, _, _ = next_views
        _wait_landed(ready.index(K0L), phase ^ 1)
        s_next = warpgroup_mma(
            q_l, k0_l.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout), use_acc=False, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(free.index(K1L))
        _wait_landed(ready.index(K0R), phase ^ 1)
        s_next = warpgroup_mma(q_r, k0_r.permute((1, 0)), s_next, is_async=True)
        s_next = warpgroup_mma(q_rope, k0_rope.permute((1, 0)), s_next, is_async=True)
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(K1L))
        if ISSUE_NEXT:
            next_views = _views_this_pair(pair + 1, q_half, q_rope1, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE)
            s_next = _issue_scores0(next_views, ready, phase ^ 1, BLOCK_H, BLOCK_K, s_layout)
        else:
            s_next = s_pending
    return m1, l_i, acc, s_next


@gluon.jit
def _consumer0(
    q_half,
    q_rope1,
    k_l,
    k_r,
    k_rope,
    s1_smem,
    stats,
    ready,
    free,
    hand,
    idx_row,
    topk,
    n_kv,
    n_pairs,
    qk_scale_log2,
    out_ptr,
    token,
    head0,
    n_heads,
    stride_ot,
    stride_oh,
    HALF: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    S0_IN_ROPE: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    PIPELINE_QK: gl.constexpr,
):
    """Even key blocks' scores; output columns [0, d_v / 2). Each pair's S0 is queued one step
    ahead (the last pair's by the one before it, or by the prologue)."""
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([BLOCK_H], MAX_INIT, gl.float32, layout=s_row)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=s_row)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    views = _views_this_pair(0, q_half, q_rope1, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE)
    s_pending = _issue_scores0(views, ready, 0, BLOCK_H, BLOCK_K, s_layout)
    for pair in range(n_pairs - 1):
        m_i, l_i, acc, s_pending = _consumer0_pair(
            pair,
            s_pending,
            m_i,
            l_i,
            acc,
            q_half,
            q_rope1,
            k_l,
            k_r,
            k_rope,
            s1_smem,
            stats,
            ready,
            free,
            hand,
            idx_row,
            topk,
            n_kv,
            qk_scale_log2,
            HALF,
            BLOCK_H,
            BLOCK_K,
            S0_IN_ROPE,
            s_layout,
            o_layout,
            True,
            PIPELINE_QK,
        )
    m_i, l_i, acc, s_pending = _consumer0_pair(
        n_pairs - 1,
        s_pending,
        m_i,
        l_i,
        acc,
        q_half,
        q_rope1,
        k_l,
        k_r,
        k_rope,
        s1_smem,
        stats,
        ready,
        free,
        hand,
        idx_row,
        topk,
        n_kv,
        qk_scale_log2,
        HALF,
        BLOCK_H,
        BLOCK_K,
        S0_IN_ROPE,
        s_layout,
        o_layout,
        False,
        PIPELINE_QK,
    )

    # The row sums meet in shared memory; both halves divide by the whole.
    stats[2].store(l_i)
    mbarrier.arrive(hand.index(L0_READY))
    mbarrier.wait(hand.index(L1_READY), 0)
    l_i = l_i + stats[3].load(s_row)
    _store_out(acc, l_i, out_ptr, token, head0, n_heads, stride_ot, stride_oh, 0, HALF, BLOCK_H, o_layout)


@gluon.jit
def _consumer1(
    q_half,
    q_rope1,
    k_l,
    k_r,
    k_rope,
    s1_smem,
    stats,
    ready,
    free,
    hand,
    idx_row,
    topk,
    n_kv,
    n_pairs,
    qk_scale_log2,
    out_ptr,
    lse_ptr,
    token,
    head0,
    n_heads,
    stride_ot,
    stride_oh,
    stride_lt,
    HALF: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    S0_IN_ROPE: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
):
    """Odd key blocks' scores; output columns [d_v / 2, d_v) and the lse."""
    dtype: gl.constexpr = k_l.dtype
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BLOCK_H], MAX_INIT, gl.float32, layout=s_row)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=s_row)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    for pair in range(n_pairs):
        phase = pair & 1
        q_l, q_r, q_rope, _, k0_r, _, k1_l, k1_r, k1_rope, s0_smem, s1_p = _views_this_pair(
            pair, q_half, q_rope1, k_l, k_r, k_rope, s1_smem, S0_IN_ROPE
        )
        # S1 = q @ K1^T, the right quarter first (the producer fills slot 1's right before its left).
        _wait_landed(ready.index(K1R), phase)
        s = warpgroup_mma(
            q_r, k1_r.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout), use_acc=False, is_async=True
        )
        s = warpgroup_mma(q_rope, k1_rope.permute((1, 0)), s, is_async=True)
        _wait_landed(ready.index(K1L), phase)
        s = warpgroup_mma(q_l, k1_l.permute((1, 0)), s, is_async=True)
        valid = _slot_valid(idx_row, pair * 2 * BLOCK_K + BLOCK_K, topk, n_kv, BLOCK_K, s_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(valid[None, :], s * qk_scale_log2, float("-inf"))

        # The running max after both blocks: m1 = max(m0, rowmax S1), with m0 from consumer 0.
        mbarrier.wait(hand.index(M0_READY), phase)
        m1 = gl.maximum(stats[0].load(s_row), gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m1)
        p = gl.exp2(s - m1[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m1
        stats[1].store(m1)
        mbarrier.arrive(hand.index(M1_READY))

        # O_right = O_right * alpha + P1 @ V1[:, right] (registers) + P0 @ V0[:, right] (shared memory).
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        p_cast = p.to(dtype)
        p_op = gl.convert_layout(p_cast, p_operand)
        acc = warpgroup_mma(p_op, k1_r, acc, is_async=True)
        s1_p.store(p_cast)
        fence_async_shared()
        mbarrier.arrive(hand.index(S1_READY))
        mbarrier.wait(hand.index(S0_READY), phase)
        acc = warpgroup_mma(s0_smem, k0_r, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(acc, p_op))
        mbarrier.arrive(free.index(K1R))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(K0R))  # also frees sS0 when it lives in slot 0's rope part

    stats[3].store(l_i)
    mbarrier.arrive(hand.index(L1_READY))
    mbarrier.wait(hand.index(L0_READY), 0)
    l_i = l_i + stats[2].load(s_row)
    _store_out(acc, l_i, out_ptr, token, head0, n_heads, stride_ot, stride_oh, HALF, HALF, BLOCK_H, o_layout)
    # lse = (m + log2 l) * ln 2, natural log; -inf for a row that saw no valid key.
    heads = head0 + gl.arange(0, BLOCK_H, layout=s_row)
    has_any = l_i > 0.0
    lse = gl.where(has_any, (m_i + gl.log2(gl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + token * stride_lt + heads, lse, mask=heads < n_heads)


@gluon.jit
def _block_indices(idx_row, k0, topk, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """Key block ``k0``'s row indices (``-1`` past ``topk``), one per row of ``layout``."""
    offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    return gl.load(idx_row + offs_k, mask=offs_k < topk, other=-1)  # read BLOCK_K x 4 B


@gluon.jit
def _gather(dst, kv_ptr, idx, n_kv, stride_kv, COL0: gl.constexpr, WIDTH: gl.constexpr, layout: gl.constexpr):
    """cp.async columns [COL0, COL0 + WIDTH) of the rows ``idx`` names into ``dst`` (16 B per copy).

    Unused slots (``-1``, out of range) are zero-filled: the masked copy reads nothing (their scores
    are masked to -inf by the consumers).
    """
    # read up to BLOCK_K x WIDTH x 2 B of rows
    idx = gl.convert_layout(idx, gl.SliceLayout(1, layout))  # a no-op where the layouts agree
    used = (idx >= 0) & (idx < n_kv)
    row = gl.where(used, idx, 0).to(gl.int64)
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(dst, kv_ptr + row[:, None] * stride_kv + cols[None, :], mask=used[:, None])


@gluon.jit
def _producer(
    k_l,
    k_r,
    k_rope,
    ready,
    free,
    kv_ptr,
    idx_row,
    topk,
    n_kv,
    stride_kv,
    n_pairs,
    HALF: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_K: gl.constexpr,
    half_layout: gl.constexpr,
    rope_layout: gl.constexpr,
):
    """Gather each pair of key blocks, quarter by quarter, in the order the consumers need them:
    slot 0 left, slot 1 right, slot 0 right, slot 1 left. The indices are loaded a pair ahead, so
    their latency hides behind the waits for free slots instead of delaying the copies."""
    idx0 = _block_indices(idx_row, 0, topk, BLOCK_K, half_layout)
    idx1 = _block_indices(idx_row, BLOCK_K, topk, BLOCK_K, half_layout)
    for pair in range(n_pairs):
        free_phase = (pair & 1) ^ 1  # a fresh barrier counts as freed: the first waits pass
        next0 = _block_indices(idx_row, (pair + 1) * 2 * BLOCK_K, topk, BLOCK_K, half_layout)
        next1 = _block_indices(idx_row, (pair + 1) * 2 * BLOCK_K + BLOCK_K, topk, BLOCK_K, half_layout)
        mbarrier.wait(free.index(K0L), free_phase)
        _gather(k_l.index(0), kv_ptr, idx0, n_kv, stride_kv, 0, HALF, half_layout)
        async_copy.mbarrier_arrive(ready.index(K0L), increment_count=False)
        mbarrier.wait(free.index(K1R), free_phase)
        _gather(k_r.index(1), kv_ptr, idx1, n_kv, stride_kv, HALF, HALF, half_layout)
        _gather(k_rope.index(1), kv_ptr, idx1, n_kv, stride_kv, 2 * HALF, D_ROPE, rope_layout)
        async_copy.mbarrier_arrive(ready.index(K1R), increment_count=False)
        mbarrier.wait(free.index(K0R), free_phase)
        _gather(k_r.index(0), kv_ptr, idx0, n_kv, stride_kv, HALF, HALF, half_layout)
        _gather(k_rope.index(0), kv_ptr, idx0, n_kv, stride_kv, 2 * HALF, D_ROPE, rope_layout)
        async_copy.mbarrier_arrive(ready.index(K0R), increment_count=False)
        mbarrier.wait(free.index(K1L), free_phase)
        _gather(k_l.index(1), kv_ptr, idx1, n_kv, stride_kv, 0, HALF, half_layout)
        async_copy.mbarrier_arrive(ready.index(K1L), increment_count=False)
        idx0 = next0
        idx1 = next1


@gluon.jit
def _sparse_mla_fwd_ws_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
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
    stride_lt,
    qk_scale_log2,
    D_V: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    half_layout: gl.constexpr,
    rope_layout: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PIPELINE_QK: gl.constexpr,
):
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    HALF: gl.constexpr = D_V // 2
    S0_IN_ROPE: gl.constexpr = D_ROPE == BLOCK_K
    # One warp group's score tile [64 heads, 64 keys] and output half [64 heads, d_v / 2].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])

    pid = gl.program_id(0).to(gl.int64)
    token = pid // n_head_blocks
    head0 = (pid % n_head_blocks) * BLOCK_H
    idx_row = idx_ptr + token * stride_it

    half_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], dtype)
    rope_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], dtype)
    p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], dtype)
    # q in three parts, read once: BLOCK_H x (D_V + D_ROPE) x 2 B.
    q_half = gl.allocate_shared_memory(dtype, [2, BLOCK_H, HALF], half_shared)
    q_rope1 = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_ROPE], rope_shared)
    # Two key blocks (slot 0: even, slot 1: odd), each as left / right / rope parts.
    k_l = gl.allocate_shared_memory(dtype, [2, BLOCK_K, HALF], half_shared)
    k_r = gl.allocate_shared_memory(dtype, [2, BLOCK_K, HALF], half_shared)
    k_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_K, D_ROPE], rope_shared)
    # sS1 (and sS0 when it cannot live in slot 0's rope part).
    s1_smem = gl.allocate_shared_memory(dtype, [1 if S0_IN_ROPE else 2, BLOCK_H, BLOCK_K], p_shared)
    # m0, m1, l0, l1 per head.
    stat_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    stats = (
        gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_shared),
        gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_shared),
        gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_shared),
        gl.allocate_shared_memory(gl.float32, [BLOCK_H], stat_shared),
    )
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(ready.index(i), count=4 * 32)  # every producer thread's cp.async arrival
        mbarrier.init(free.index(i), count=1)
    for i in gl.static_range(6):
        mbarrier.init(hand.index(i), count=1)

    load_q_part(q_half.index(0), q_ptr, token, head0, n_heads, stride_qt, stride_qh, 0, HALF, BLOCK_H, half_layout)
    load_q_part(q_half.index(1), q_ptr, token, head0, n_heads, stride_qt, stride_qh, HALF, HALF, BLOCK_H, half_layout)
    load_q_part(q_rope1.index(0), q_ptr, token, head0, n_heads, stride_qt, stride_qh, D_V, D_ROPE, BLOCK_H, rope_layout)
    fence_async_shared()

    n_pairs = gl.cdiv(topk, 2 * BLOCK_K)
    qk_scale = qk_scale_log2
    gl.warp_specialize(
        [
            (
                _consumer0,
                (
                    q_half,
                    q_rope1,
                    k_l,
                    k_r,
                    k_rope,
                    s1_smem,
                    stats,
                    ready,
                    free,
                    hand,
                    idx_row,
                    topk,
                    n_kv,
                    n_pairs,
                    qk_scale,
                    out_ptr,
                    token,
                    head0,
                    n_heads,
                    stride_ot,
                    stride_oh,
                    HALF,
                    BLOCK_H,
                    BLOCK_K,
                    S0_IN_ROPE,
                    s_layout,
                    o_layout,
                    PIPELINE_QK,
                ),
            ),
            (
                _consumer1,
                (
                    q_half,
                    q_rope1,
                    k_l,
                    k_r,
                    k_rope,
                    s1_smem,
                    stats,
                    ready,
                    free,
                    hand,
                    idx_row,
                    topk,
                    n_kv,
                    n_pairs,
                    qk_scale,
                    out_ptr,
                    lse_ptr,
                    token,
                    head0,
                    n_heads,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    HALF,
                    BLOCK_H,
                    BLOCK_K,
                    S0_IN_ROPE,
                    s_layout,
                    o_layout,
                ),
            ),
            (
                _producer,
                (
                    k_l,
                    k_r,
                    k_rope,
                    ready,
                    free,
                    kv_ptr,
                    idx_row,
                    topk,
                    n_kv,
                    stride_kv,
                    n_pairs,
                    HALF,
                    D_ROPE,
                    BLOCK_K,
                    half_layout,
                    rope_layout,
                ),
            ),
        ],
        [4, 4],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def row_copy_layout(width: int, num_warps: int = 4) -> gl.BlockedLayout:
    """Rows of ``width`` bf16 / fp16 columns, 16 B (8 elements) per thread and at most 8 threads
    (128 B) along a row: a thread then copies few rows (few 64-bit row addresses to hold) at
    several column offsets (immediates)."""
    lanes_along_row = min(8, width // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_along_row, lanes_along_row], [num_warps, 1], [1, 0])


# Shared memory at d_v = 512, rope 64: q, two key blocks and sS1 fill 224 KiB of the 227 an sm_90 SM offers.
MAX_D_V = 512
MAX_D_ROPE = 64


def unsupported_reason(
    device_type: str,
    capability: tuple[int, int] | None,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    d_qk: int,
    d_v: int,
) -> str | None:
    """Why the warp-specialized kernel cannot run these inputs, or ``None`` when it can.

    It needs an sm_90 (Hopper) GPU, bf16 / fp16 ``q`` and ``kv`` of one dtype, a power-of-two ``d_v``
    in [64, 512] (each consumer's half is one tensor-core product wide) and a power-of-two rope
    width ``d_qk - d_v`` in [16, 64] (shared memory).
    """
    return hopper_operand_reason(device_type, capability, q_dtype, kv_dtype) or width_reason(
        d_v, d_qk - d_v, MAX_D_V, MAX_D_ROPE
    )


def ws_supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether :func:`sparse_mla_attention_gluon_ws` runs these inputs (see :func:`unsupported_reason`)."""
    return inputs_reason(q, kv, d_v, unsupported_reason) is None


def launch_constexprs(d_v: int, d_rope: int, pipeline_qk: bool | None = None) -> dict[str, object]:
    """The kernel's compile-time arguments for these widths (also used to compile it without a GPU);
    ``pipeline_qk`` overrides :data:`GPU_PIPELINE_QK`."""
    return {
        "D_V": d_v,
        "D_ROPE": d_rope,
        "BLOCK_H": BLOCK_H,
        "BLOCK_K": BLOCK_K,
        "half_layout": row_copy_layout(d_v // 2),
        "rope_layout": row_copy_layout(d_rope),
        "CONSUMER_REGS": CONSUMER_REGS,
        "PRODUCER_REGS": PRODUCER_REGS,
        "PIPELINE_QK": GPU_PIPELINE_QK if pipeline_qk is None else pipeline_qk,
    }


def sparse_mla_attention_gluon_ws(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.float32,
    pipeline_qk: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention with the warp-specialized kernel -> (out [T, H, d_v] ``out_dtype``, lse [T, H] f32).

    ``pipeline_qk`` overrides :data:`GPU_PIPELINE_QK` (benchmark sweeps). Raises ``ValueError`` naming the
    problem for inputs :func:`unsupported_reason` rejects.
    """
    launch = prepare_launch(
        q, kv, indices, d_v, out_dtype, "warp-specialized Gluon sparse MLA kernel", unsupported_reason
    )
    if launch.empty:
        return launch.out, launch.lse
    grid, args = launch.grid_and_args(BLOCK_H, softmax_scale)
    _sparse_mla_fwd_ws_kernel[grid](*args, **launch_constexprs(d_v, q.shape[-1] - d_v, pipeline_qk), num_warps=4)
    return launch.out, launch.lse
