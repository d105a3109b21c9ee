"""Gluon sparse MLA attention for Hopper: the Triton kernel's algorithm with the warp groups' work split.

Contract: the same as :func:`reference_impl.kernels.sparse_mla_triton.sparse_mla_attention_triton`
(q ``[T, H, D_qk]``, full-view kv ``[S, D_qk]``, indices ``[T, K]`` with ``-1`` for unused slots,
-> out ``[T, H, d_v]`` and natural-log lse ``[T, H]``), for bf16 / fp16 operands on an sm_90 GPU.

Why a second kernel. The Triton kernel runs one program per (token, 64 heads) with 8 warps: two
warp groups. Triton picks each product's warp layout itself, and a product whose result feeds
another product in the same loop iteration (the score product feeds the value product through
the softmax) gets all warps along M. With M = 64 heads, one warp group tall, both warp groups then
compute the whole ``[64, BLOCK_K]`` score tile: the score product, 576 of the 1088 multiply-adds
per (head, key), runs twice. Gluon states layouts explicitly, so here each warp group computes
half of the tile's keys (``warps_per_cta = [4, 2]``) and the probabilities meet in shared memory
for the value product, in which each warp group owns half of ``d_v``:

    per tile of BLOCK_K = 64 keys, slot s of a two-slot ring in shared memory:
      gather rows of tile i+1 -> slot s^1  (cp.async, 16 B per copy; overlaps the work below)
      S  = q @ kv[s]^T           warp group g: keys [32g, 32g + 32), all 64 heads, K = 576
      m, l, P = online softmax    row max / sum across the two warp groups
      P  -> shared memory         [64, 64] bf16, read by both warp groups
      O  = O * alpha + P @ kv[s]  warp group g: d_v columns [256g, 256g + 256)

Shared memory: q 72 KiB + 2 slots x 72 KiB + P 8 KiB = 224 KiB of the 227 an sm_90 SM offers; 216
registers per thread. Measured against the Triton kernel at the per-rank shape (rank 0 of C = 8,
128K; ``python -m reference_impl.bench.compute``): ``docs/compute-kernels.md#first-gluon-kernel``.

Two switches, both off in :data:`GPU_DEFAULT_CONFIG` (the same benchmark's ``--sweep``; measured:
``docs/compute-kernels.md#first-gluon-kernel``):

* ``OVERLAP_PV`` queues the next tile's score product behind this tile's value product and waits
  for both at once, so that the tensor cores could run them back to back; the next tile's gather is
  then issued after that wait. ptxas serializes the two products anyway (its warning C7515),
  because the accumulator rescale touches the output accumulator between them.
* ``EVICT_LAST`` gathers the KV rows with an L2 ``evict_last`` policy (FlashMLA's). Triton 3.6's
  Gluon copy emits the same PTX with and without the policy.

Gluon has no CPU interpreter: this kernel is checked against the torch reference on a GPU
(``tests/gpu/test_gpu_sparse_mla_gluon.py`` runs there and skips elsewhere); the Triton kernel remains the
path on other GPUs and the one the CPU suite checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from reference_impl.kernels.interpreter_compat import interpreting
from reference_impl.kernels.sparse_mla_triton import check_attention_shapes, unit_stride_inputs

LOG2E = math.log2(math.e)
BLOCK_H = 64
BLOCK_K = 64
NUM_WARPS = 8
# (OVERLAP_PV, EVICT_LAST), see the kernel; chosen by the compute benchmark's sweep
# (measured: docs/compute-kernels.md#first-gluon-kernel).
GPU_DEFAULT_CONFIG: tuple[bool, bool] = (False, False)

# The CTA-wide barrier is `gl.barrier` from Triton 3.7 and `gl.thread_barrier` before it.
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _same_tensor(x):
    return x


# From Triton 3.7 an asynchronous product returns a pending-accumulator type, and a loop that
# carries one must start from one (`warpgroup_mma_init`); before, it returned a plain tensor.
mma_accumulator = getattr(hopper, "warpgroup_mma_init", None) or _same_tensor


@gluon.jit
def _gather_part(
    slot_smem,
    kv_ptr,
    idx_row,
    k0,
    topk,
    n_kv,
    stride_kv,
    COL0: gl.constexpr,
    WIDTH: gl.constexpr,
    BLOCK_K: gl.constexpr,
    layout: gl.constexpr,
    EVICT_LAST: gl.constexpr,
):
    """Issue the cp.async copies of columns ``[COL0, COL0 + WIDTH)`` of one tile's KV rows into ``slot_smem``.

    Unused slots copy row 0: a real row, so the value product multiplies finite numbers by a zero
    probability (the scores of those slots are masked to -inf).
    """
    # read BLOCK_K x 4 B of indices (L1 hits after the first part), BLOCK_K x WIDTH x 2 B of rows
    offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    idx = gl.load(idx_row + offs_k, mask=offs_k < topk, other=-1)
    row = gl.where((idx >= 0) & (idx < n_kv), idx, 0).to(gl.int64)
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = kv_ptr + row[:, None] * stride_kv + cols[None, :]
    if EVICT_LAST:
        # Rows are shared by the token's other head block and by nearby tokens: keep them in L2.
        async_copy.async_copy_global_to_shared(slot_smem, ptrs, eviction_policy="evict_last")
    else:
        async_copy.async_copy_global_to_shared(slot_smem, ptrs)


@gluon.jit
def _gather_next(
    nope_slot,
    rope_slot,
    kv_ptr,
    idx_row,
    k0,
    topk,
    n_kv,
    stride_kv,
    D_V: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_K: gl.constexpr,
    nope_layout: gl.constexpr,
    rope_layout: gl.constexpr,
    EVICT_LAST: gl.constexpr,
):
    """Both parts of one tile's rows into a ring slot."""
    _gather_part(nope_slot, kv_ptr, idx_row, k0, topk, n_kv, stride_kv, 0, D_V, BLOCK_K, nope_layout, EVICT_LAST)
    _gather_part(rope_slot, kv_ptr, idx_row, k0, topk, n_kv, stride_kv, D_V, D_ROPE, BLOCK_K, rope_layout, EVICT_LAST)


@gluon.jit
def load_q_part(
    q_smem,
    q_ptr,
    token,
    head0,
    n_heads,
    stride_qt,
    stride_qh,
    COL0: gl.constexpr,
    WIDTH: gl.constexpr,
    BLOCK_H: gl.constexpr,
    layout: gl.constexpr,
):
    """Columns ``[COL0, COL0 + WIDTH)`` of the block's q rows into ``q_smem`` (zeros past ``n_heads``)."""
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    q = gl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + cols[None, :],
        mask=(heads < n_heads)[:, None],
        other=0.0,
    )
    q_smem.store(q)


@gluon.jit
def _sparse_mla_fwd_gluon_kernel(
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
    OVERLAP_PV: gl.constexpr,
    EVICT_LAST: gl.constexpr,
):
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    # Register layouts. Loads: 8 contiguous elements (16 B) per thread, rows over the warps.
    nope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D_ROPE, D_ROPE // 8], [8, 1], [1, 0])
    # Scores [BLOCK_H, BLOCK_K]: warp group g holds keys [g * BLOCK_K / 2, (g + 1) * BLOCK_K / 2).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_K // 2, 16]
    )
    # Output [BLOCK_H, D_V]: warp group g holds d_v columns [g * D_V / 2, (g + 1) * D_V / 2).
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16]
    )
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_col: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_col: gl.constexpr = gl.SliceLayout(0, o_layout)

    pid = gl.program_id(0).to(gl.int64)
    token = pid // n_head_blocks
    head0 = (pid % n_head_blocks) * BLOCK_H

    # q stays in shared memory for the whole loop: read BLOCK_H x (D_V + D_ROPE) x 2 B once.
    # Shared tiles in the tensor cores' swizzled (NVMMA) layout.
    q_nope_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V], dtype)
    q_rope_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], dtype)
    q_nope_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], q_nope_shared)
    q_rope_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], q_rope_shared)
    load_q_part(q_nope_smem, q_ptr, token, head0, n_heads, stride_qt, stride_qh, 0, D_V, BLOCK_H, nope_layout)
    load_q_part(q_rope_smem, q_ptr, token, head0, n_heads, stride_qt, stride_qh, D_V, D_ROPE, BLOCK_H, rope_layout)

    # The two-slot ring of gathered KV rows and the probabilities' meeting point.
    kv_nope_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    kv_rope_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_ROPE], dtype)
    p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], dtype)
    kv_nope_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_K, D_V], kv_nope_shared)
    kv_rope_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_K, D_ROPE], kv_rope_shared)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_K], p_shared)

    idx_row = idx_ptr + token * stride_it
    _gather_part(
        kv_nope_smem.index(0), kv_ptr, idx_row, 0, topk, n_kv, stride_kv, 0, D_V, BLOCK_K, nope_layout, EVICT_LAST
    )
    _gather_part(
        kv_rope_smem.index(0), kv_ptr, idx_row, 0, topk, n_kv, stride_kv, D_V, D_ROPE, BLOCK_K, rope_layout, EVICT_LAST
    )
    async_copy.commit_group()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=s_row)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=s_row)
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
    if OVERLAP_PV:
        acc = mma_accumulator(acc)  # the loop carries it pending
    n_tiles = gl.cdiv(topk, BLOCK_K)
    for tile in range(n_tiles):
        slot = tile % 2
        k0 = tile * BLOCK_K
        if not OVERLAP_PV:
            # Every warp group is done with the other slot (last tile's value product waited), so
            # the next tile's rows can land in it while this tile is computed.
            cta_barrier()
            if tile + 1 < n_tiles:
                _gather_next(
                    kv_nope_smem.index(1 - slot),
                    kv_rope_smem.index(1 - slot),
                    kv_ptr,
                    idx_row,
                    k0 + BLOCK_K,
                    topk,
                    n_kv,
                    stride_kv,
                    D_V,
                    D_ROPE,
                    BLOCK_K,
                    nope_layout,
                    rope_layout,
                    EVICT_LAST,
                )
            async_copy.commit_group()
            async_copy.wait_group(1)  # this thread's copies of the current tile have landed
        else:
            async_copy.wait_group(0)  # the current tile is the only group in flight
        cta_barrier()  # ... and every other thread's
        fence_async_shared()  # make the cp.async writes visible to the tensor cores' reads

        kv_nope = kv_nope_smem.index(slot)
        kv_rope = kv_rope_smem.index(slot)
        # S = q_nope @ kv_nope^T + q_rope @ kv_rope^T: 2 x BLOCK_H x BLOCK_K x 576 flops, each warp
        # group half the keys.
        s = warpgroup_mma(
            q_nope_smem,
            kv_nope.permute((1, 0)),
            gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        s = warpgroup_mma(q_rope_smem, kv_rope.permute((1, 0)), s, is_async=True)
        if OVERLAP_PV:
            # The score product queued behind the last tile's value product: one wait retires both
            # (a warp group's products complete in order). Once every warp group is past it, the
            # other slot is free for the next tile's rows, which land during this tile's softmax
            # and value product.
            s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
            cta_barrier()
            if tile + 1 < n_tiles:
                _gather_next(
                    kv_nope_smem.index(1 - slot),
                    kv_rope_smem.index(1 - slot),
                    kv_ptr,
                    idx_row,
                    k0 + BLOCK_K,
                    topk,
                    n_kv,
                    stride_kv,
                    D_V,
                    D_ROPE,
                    BLOCK_K,
                    nope_layout,
                    rope_layout,
                    EVICT_LAST,
                )
            async_copy.commit_group()
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

        offs_k = k0 + gl.arange(0, BLOCK_K, layout=s_col)
        idx = gl.load(idx_row + offs_k, mask=offs_k < topk, other=-1)
        valid = (idx >= 0) & (idx < n_kv)
        s = gl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # A row that has seen only unused slots keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new

        # P meets in shared memory: each warp group wrote its keys, the value product reads all.
        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        # O += P @ kv_nope: 2 x BLOCK_H x BLOCK_K x D_V flops, each warp group half of d_v.
        acc = warpgroup_mma(p_smem, kv_nope, acc, is_async=True)
        if not OVERLAP_PV:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if OVERLAP_PV:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    l_o = gl.convert_layout(l_i, o_row)
    has_any = l_o > 0.0
    out = acc / gl.where(has_any, l_o, 1.0)[:, None]
    heads = head0 + gl.arange(0, BLOCK_H, layout=o_row)
    cols = gl.arange(0, D_V, layout=o_col)
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads < n_heads)[:, None])
    # m_i and log2(l_i) are base-2 quantities; times ln(2) gives the natural-log LSE.
    m_o = gl.convert_layout(m_i, o_row)
    lse = gl.where(has_any, (m_o + gl.log2(gl.where(has_any, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + token * stride_lt + heads, lse, mask=heads < n_heads)


# Shared memory holds q and two KV tiles of D_qk bf16 columns each, plus P: this width fills it.
MAX_D_QK = 576


# --------------------------------------------------------------------------------------------
# What both Gluon kernels share on the host: their refusals and their launch prologue
# --------------------------------------------------------------------------------------------


def hopper_operand_reason(
    device_type: str, capability: tuple[int, int] | None, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> str | None:
    """Why neither Gluon kernel runs on this device or these dtypes (an sm_90 GPU, bf16 / fp16 ``q``
    and ``kv`` of one dtype), or ``None``."""
    if device_type != "cuda" or capability is None or capability[0] != 9:
        return f"needs an sm_90 GPU, got {device_type} {capability or ''}".rstrip()
    if q_dtype not in (torch.bfloat16, torch.float16) or kv_dtype != q_dtype:
        return f"needs bf16 or fp16 q and kv of one dtype, got {q_dtype} and {kv_dtype}"
    return None


def width_reason(d_v: int, d_rope: int, max_d_v: int, max_d_rope: int) -> str | None:
    """Why a Gluon kernel's layouts cannot tile these widths (both powers of two, ``d_v`` in
    ``[64, max_d_v]``, the rope width in ``[16, max_d_rope]``), or ``None``."""

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if pow2(d_v) and 64 <= d_v <= max_d_v and pow2(d_rope) and 16 <= d_rope <= max_d_rope:
        return None
    return (
        f"needs power-of-two d_v in [64, {max_d_v}] and rope width in [16, {max_d_rope}], got d_v={d_v}, rope={d_rope}"
    )


UnsupportedReason = Callable[[str, tuple[int, int] | None, torch.dtype, torch.dtype, int, int], str | None]
"""A kernel's ``unsupported_reason(device_type, capability, q_dtype, kv_dtype, d_qk, d_v)``."""


def inputs_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int, unsupported: UnsupportedReason) -> str | None:
    """Why a Gluon kernel (its ``unsupported_reason``) cannot run these tensors, or ``None``; never
    under ``TRITON_INTERPRET=1``."""
    if interpreting():
        return "does not run under TRITON_INTERPRET=1 (Gluon has no interpreter)"
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return unsupported(q.device.type, capability, q.dtype, kv.dtype, q.shape[-1], d_v)


class GluonLaunch(NamedTuple):
    """Checked inputs and allocated outputs of one Gluon sparse MLA call (:func:`prepare_launch`).
    ``empty``: no key at all, and ``out`` / ``lse`` already hold the reference's empty-row answer."""

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    empty: bool

    def grid_and_args(self, block_h: int, softmax_scale: float) -> tuple[tuple[int], tuple[object, ...]]:
        """Both kernels' grid (one program per token and head block) and positional arguments."""
        q, kv, indices, out, lse = self.q, self.kv, self.indices, self.out, self.lse
        n_tokens, n_heads = q.shape[0], q.shape[1]
        n_head_blocks = triton.cdiv(n_heads, block_h)
        args = (
            q,
            kv,
            indices,
            out,
            lse,
            n_heads,
            kv.shape[0],
            indices.shape[1],
            n_head_blocks,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            indices.stride(0),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            float(softmax_scale) * LOG2E,
        )
        return (n_tokens * n_head_blocks,), args


def prepare_launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    d_v: int,
    out_dtype: torch.dtype,
    kernel: str,
    unsupported: UnsupportedReason,
) -> GluonLaunch:
    """The launchers' shared prologue: shapes checked, a ``ValueError`` naming ``kernel`` and the
    problem for inputs ``unsupported`` rejects, unit-stride inputs, and ``out [T, H, d_v]`` /
    ``lse [T, H]`` (every entry is stored by the kernel, or the empty-row answer here)."""
    n_tokens, n_heads, _ = check_attention_shapes(q, kv, indices)
    reason = inputs_reason(q, kv, d_v, unsupported)
    if reason is not None:
        raise ValueError(f"the {kernel} {reason}")
    q, kv, indices = unit_stride_inputs(q, kv, indices)
    out = torch.empty(n_tokens, n_heads, d_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=q.device)
    empty = n_tokens == 0 or n_heads == 0 or kv.shape[0] == 0 or indices.shape[1] == 0
    if empty:
        out.zero_()
        lse.fill_(float("-inf"))
    return GluonLaunch(q, kv, indices, out, lse, empty)


# --------------------------------------------------------------------------------------------
# This kernel's host side
# --------------------------------------------------------------------------------------------


def unsupported_reason(
    device_type: str,
    capability: tuple[int, int] | None,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    d_qk: int,
    d_v: int,
) -> str | None:
    """Why the Gluon kernel cannot run these inputs, or ``None`` when it can.

    It needs an sm_90 (Hopper) GPU, bf16 / fp16 ``q`` and ``kv`` of one dtype, a power-of-two ``d_v``
    in [64, 512] and rope width ``d_qk - d_v`` in [16, 256] (the layouts tile them exactly), and
    ``d_qk <= 576`` (shared memory).
    """
    reason = hopper_operand_reason(device_type, capability, q_dtype, kv_dtype) or width_reason(
        d_v, d_qk - d_v, 512, 256
    )
    if reason is None and d_qk > MAX_D_QK:
        reason = f"needs d_qk <= {MAX_D_QK} (q and two KV tiles in shared memory), got {d_qk}"
    return reason


def gluon_supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether :func:`sparse_mla_attention_gluon` runs these inputs (see :func:`unsupported_reason`;
    never under ``TRITON_INTERPRET=1``)."""
    return inputs_reason(q, kv, d_v, unsupported_reason) is None


def sparse_mla_attention_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.float32,
    overlap_pv: bool | None = None,
    evict_last: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention with the Gluon kernel -> (out [T, H, d_v] ``out_dtype``, lse [T, H] f32).

    ``overlap_pv`` / ``evict_last`` override :data:`GPU_DEFAULT_CONFIG` (benchmark sweeps). Raises
    ``ValueError`` naming the problem for inputs :func:`unsupported_reason` rejects.
    """
    launch = prepare_launch(q, kv, indices, d_v, out_dtype, "Gluon sparse MLA kernel", unsupported_reason)
    if launch.empty:
        return launch.out, launch.lse
    grid, args = launch.grid_and_args(BLOCK_H, softmax_scale)
    _sparse_mla_fwd_gluon_kernel[grid](
        *args,
        D_V=d_v,
        D_ROPE=q.shape[-1] - d_v,
        BLOCK_H=BLOCK_H,
        BLOCK_K=BLOCK_K,
        OVERLAP_PV=GPU_DEFAULT_CONFIG[0] if overlap_pv is None else overlap_pv,
        EVICT_LAST=GPU_DEFAULT_CONFIG[1] if evict_last is None else evict_last,
        num_warps=NUM_WARPS,
    )
    return launch.out, launch.lse
