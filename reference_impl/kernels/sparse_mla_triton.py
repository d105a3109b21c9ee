"""Triton sparse MLA attention (absorbed / MQA form) over top-k selected rows of a full-view KV.

Contract: the same as :func:`reference_impl.model.sparse_attention.sparse_mla_attention`:

* ``q [T, H, D_qk]`` (bf16 on GPU; fp16 / fp32 accepted), the latent part ``[:d_v]`` then the rope
  part ``[d_v:]``;
* ``kv [S, D_qk]`` the full view (latent then rope), same dtype family as ``q``;
* ``indices [T, K]`` int32 rows of ``kv``; ``-1`` (or any row outside ``[0, S)``) is an unused slot;
* returns ``out [T, H, d_v]`` (``out_dtype``, float32 by default) and ``lse [T, H]`` float32 in
  natural log; a query row with no valid index gets ``out = 0`` and ``lse = -inf``.

Kernel shape: one program per (query token, block of ``BLOCK_H`` heads), heads fastest in the
launch order so that the programs of one token run together and share the gathered rows through
L2. The program loops over the token's top-k slots in tiles of ``BLOCK_K``: it gathers the tile's
KV rows once (latent ``[BLOCK_K, d_v]`` and rope ``[BLOCK_K, D_qk - d_v]``, never written back to
global memory) and reuses them for every head of the block, which turns the work into two matrix
products per tile, ``[BLOCK_H, D_qk] x [D_qk, BLOCK_K]`` then ``[BLOCK_H, BLOCK_K] x [BLOCK_K, d_v]``,
with an online softmax in base 2 (scores pre-multiplied by ``scale * log2(e)``) between them.

Four switches, all off in :data:`GPU_DEFAULT_CONFIG` (the winner of ``python -m reference_impl.bench.compute
--sweep`` at the per-rank shape, which ``scripts/apply_sweep.py`` writes there; measured:
``docs/compute-kernels.md#triton-sparse-mla-kernel``):

* ``DEFER_PV`` performs each tile's value product one iteration late. Triton lays a product whose
  result feeds another product in the same iteration out over the M axis only; with
  ``BLOCK_H = 64`` (one warp group tall) and 8 warps that repeats the score product in both warp
  groups. Deferred, the score product is split across the warp groups along the keys and the value
  product along ``d_v``; the price is the previous tile's latent rows held in registers.
* ``LAZY_RESCALE`` skips the ``[BLOCK_H, d_v]`` rescale of the accumulator unless some row's max
  grew by more than ``RESCALE_THRESHOLD_LOG2`` (FlashAttention-4's trick). Exact; the scalar branch
  around the accumulator stops Triton pipelining the products.
* ``WARP_SPECIALIZE`` asks Triton to split the loop into producer and consumer warps
  (``tl.range(..., warp_specialize=True)``).
* ``RELOAD_PREV`` (with ``DEFER_PV``) carries only the previous tile's row numbers and gathers its
  latent rows again for the deferred product, trading an L2 read for the registers that held
  them. With 64-key tiles and two stages it needs more shared memory than the SM has.

The KV gathers are software-pipelined by Triton (``num_stages``) into shared memory.

On Hopper the dispatch runs the Gluon kernels instead (:mod:`reference_impl.kernels.sparse_mla_gluon_ws`,
then :mod:`reference_impl.kernels.sparse_mla_gluon`): the same algorithm with the warp layouts stated,
so that the score product is not repeated in both warp groups. This kernel is the path on other
GPUs, for fp32, and the one the CPU suite checks under the interpreter.

On GPU the products run on bf16 / fp16 operands with fp32 accumulation (probabilities are cast to
the KV dtype for the second product, as FlashAttention does). Under the CPU interpreter
(``TRITON_INTERPRET=1``) low-precision ``tl.dot`` is not faithful, so operands are upcast to fp32
(``UPCAST``); fp32 inputs on GPU use IEEE fp32 products (exact, no TF32 rounding).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from reference_impl.kernels.triton_helpers import pow2_at_least_16

LOG2E = math.log2(math.e)

# (BLOCK_H, BLOCK_K, num_warps, num_stages, DEFER_PV, LAZY_RESCALE, WARP_SPECIALIZE, RELOAD_PREV)
# used on GPU unless the caller overrides them; scripts/apply_sweep.py writes the compute
# benchmark's winner here.
GPU_DEFAULT_CONFIG: tuple[int, int, int, int, bool, bool, bool, bool] = (64, 64, 8, 2, False, False, False, False)

# LAZY_RESCALE keeps a stale running max until some row's max grows by more than this (log2 units:
# probabilities stay below 2**8 = 256, far inside bf16 and fp32 range).
RESCALE_THRESHOLD_LOG2 = 8.0


@triton.jit
def _pv_update(acc, p, kv, alpha, rescale, IEEE: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """``acc * alpha + p @ kv`` (the value product of one tile, accumulated in fp32).

    With ``LAZY_RESCALE`` the multiply runs only when ``rescale`` (a scalar) is set: otherwise every
    ``alpha`` is 1 and the ``[BLOCK_H, d_v]`` multiply is skipped.
    """
    if LAZY_RESCALE:
        if rescale:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    if IEEE:
        return tl.dot(p, kv, acc=acc, input_precision="ieee")
    return tl.dot(p, kv, acc=acc)


@triton.jit
def _load_latent(kv_ptr, rows, valid, offs_v, v_mask, stride_kv, UPCAST: tl.constexpr):
    """The latent part ``[BLOCK_K, d_v]`` of the KV rows ``rows`` (zeros where not ``valid``)."""
    kv = tl.load(kv_ptr + rows[:, None] * stride_kv + offs_v[None, :], mask=valid[:, None] & v_mask[None, :], other=0.0)
    if UPCAST:
        kv = kv.to(tl.float32)
    return kv


@triton.jit
def _sparse_mla_fwd_kernel(
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
    D_V: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEFER_PV: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    RESCALE_LOG2: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    RELOAD_PREV: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // n_head_blocks
    head0 = (pid % n_head_blocks) * BLOCK_H
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    offs_kk = tl.arange(0, BLOCK_K)
    h_mask = offs_h < n_heads
    v_mask = offs_v < D_V
    r_mask = offs_r < D_ROPE

    q_rows = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    q_rope = tl.load(q_rows + D_V + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if DEFER_PV:
        # The previous tile's value product, done one iteration late (see below).
        alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        rescale_prev = tl.full([], 0, dtype=tl.int32)
        if UPCAST:
            p_prev = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        else:
            p_prev = tl.zeros([BLOCK_H, BLOCK_K], dtype=kv_ptr.dtype.element_ty)
        if RELOAD_PREV:
            # Carry the previous tile's row numbers, not its [BLOCK_K, d_v] rows: they are
            # gathered again (an L2 hit) for the deferred product, freeing the registers.
            rows_prev = tl.zeros([BLOCK_K], dtype=tl.int64)
            valid_prev = offs_kk < 0
        elif UPCAST:
            kv_prev = tl.zeros([BLOCK_K, BLOCK_DV], dtype=tl.float32)
        else:
            kv_prev = tl.zeros([BLOCK_K, BLOCK_DV], dtype=kv_ptr.dtype.element_ty)

    idx_row = idx_ptr + token * stride_it
    for k0 in tl.range(0, topk, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        offs_k = k0 + offs_kk
        idx = tl.load(idx_row + offs_k, mask=offs_k < topk, other=-1)
        valid = (idx >= 0) & (idx < n_kv)
        # Invalid slots read nothing (masked) and point at row 0 so no address leaves the buffer.
        kv_rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kv
        kv_nope = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None] & v_mask[None, :], other=0.0)
        kv_rope = tl.load(kv_rows + D_V + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            kv_nope = kv_nope.to(tl.float32)
            kv_rope = kv_rope.to(tl.float32)
        if DEFER_PV:
            if RELOAD_PREV:
                kv_prev = _load_latent(kv_ptr, rows_prev, valid_prev, offs_v, v_mask, stride_kv, UPCAST)
            acc = _pv_update(acc, p_prev, kv_prev, alpha_prev, rescale_prev, IEEE, LAZY_RESCALE)

        # Two independent products, each scaled, then summed. Accumulating one into the other
        # would make the first feed a product, and Triton lays out a product that feeds another
        # one over the M axis only, which for BLOCK_H = 64 (one warp group tall) repeats it in
        # every warp group; the multiplies also keep the sum out of the second's accumulator.
        if IEEE:
            s_nope = tl.dot(q_nope, tl.trans(kv_nope), input_precision="ieee")
            s_rope = tl.dot(q_rope, tl.trans(kv_rope), input_precision="ieee")
        else:
            s_nope = tl.dot(q_nope, tl.trans(kv_nope))
            s_rope = tl.dot(q_rope, tl.trans(kv_rope))
        s = s_nope * qk_scale_log2 + s_rope * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        rescale = tl.full([], 1, dtype=tl.int32)
        if LAZY_RESCALE:
            # FlashAttention-4's conditional rescale: keep the stale max (exact: out and l share
            # it) unless a row's max grows by more than RESCALE_LOG2, or a row sees its first
            # valid score (m = -inf). One decision for the block, so the acc multiply is skipped
            # as a whole; after the first tiles it almost never runs.
            rescale = tl.max((m_new > m_i + RESCALE_LOG2).to(tl.int32))
            m_new = tl.where(rescale > 0, m_new, m_i)
        # A row that has seen only invalid slots keeps m = -inf; subtract 0 instead so that
        # exp2 gives 0 rather than NaN (-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if DEFER_PV:
            # Hand P to the next iteration instead of using it now: with no same-iteration path
            # from the score product to the value product, the score product is split across the
            # warp groups along the keys instead of being repeated in each.
            p_prev = p.to(kv_nope.dtype)
            if RELOAD_PREV:
                rows_prev = tl.where(valid, idx, 0).to(tl.int64)
                valid_prev = valid
            else:
                kv_prev = kv_nope
            alpha_prev = alpha
            rescale_prev = rescale
        else:
            acc = _pv_update(acc, p.to(kv_nope.dtype), kv_nope, alpha, rescale, IEEE, LAZY_RESCALE)
    if DEFER_PV:
        if RELOAD_PREV:
            kv_prev = _load_latent(kv_ptr, rows_prev, valid_prev, offs_v, v_mask, stride_kv, UPCAST)
        acc = _pv_update(acc, p_prev, kv_prev, alpha_prev, rescale_prev, IEEE, LAZY_RESCALE)

    has_any = l_i > 0.0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    # m_i and log2(l_i) are base-2 quantities; times ln(2) gives the natural-log LSE.
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out_rows = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh
    tl.store(out_rows + offs_v[None, :], out, mask=h_mask[:, None] & v_mask[None, :])
    tl.store(lse_ptr + token * stride_lt + offs_h, lse, mask=h_mask)


def check_attention_shapes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> tuple[int, int, int]:
    """``(T, H, D_qk)`` of sparse MLA inputs ``q [T, H, D_qk]``, ``kv [S, D_qk]``, ``indices [T, K]``;
    ``ValueError`` naming the mismatch otherwise. Shared by the Triton and Gluon launchers."""
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(
            "expected q [T,H,D], kv [S,D], indices [T,K]; "
            f"got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    n_tokens, n_heads, d_qk = q.shape
    if kv.shape[1] != d_qk or indices.shape[0] != n_tokens:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    return n_tokens, n_heads, d_qk


def unit_stride_inputs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``kv`` and int32 ``indices`` with unit last stride (the kernels' contiguous rows), copying only
    what is not."""
    indices = indices.to(torch.int32)
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv, indices))  # type: ignore[return-value]


def sparse_mla_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    out_dtype: torch.dtype = torch.float32,
    block_h: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    defer_pv: bool | None = None,
    lazy_rescale: bool | None = None,
    warp_specialize: bool | None = None,
    reload_prev: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention with the Triton kernel -> (out [T, H, d_v] ``out_dtype``, lse [T, H] f32).

    Same semantics as the torch reference (see the module docstring). ``block_*``, ``num_*`` and
    ``defer_pv`` / ``lazy_rescale`` / ``warp_specialize`` / ``reload_prev`` override the launch
    configuration (benchmark sweeps); ``None`` picks the defaults.
    """
    n_tokens, n_heads, d_qk = check_attention_shapes(q, kv, indices)
    d_rope = d_qk - d_v
    if not 0 < d_v < d_qk:
        raise ValueError(f"d_v={d_v} must lie in (0, D_qk={d_qk}): the kernel expects a latent and a rope part")

    on_gpu = q.device.type == "cuda"
    if q.dtype != kv.dtype:
        common = torch.promote_types(q.dtype, kv.dtype)
        q, kv = q.to(common), kv.to(common)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        q, kv = q.float(), kv.float()
    q, kv, indices = unit_stride_inputs(q, kv, indices)
    topk = indices.shape[1]

    out = torch.empty(n_tokens, n_heads, d_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=q.device)
    if n_tokens == 0 or n_heads == 0:
        return out, lse

    dflt_h, dflt_k, dflt_warps, dflt_stages, dflt_defer, dflt_lazy, dflt_ws, dflt_reload = (
        GPU_DEFAULT_CONFIG if on_gpu else (64, 64, 4, 1, True, False, False, False)
    )
    block_h = block_h or min(dflt_h, pow2_at_least_16(n_heads))
    block_k = block_k or min(dflt_k, pow2_at_least_16(topk))
    n_head_blocks = triton.cdiv(n_heads, block_h)
    _sparse_mla_fwd_kernel[(n_tokens * n_head_blocks,)](
        q,
        kv,
        indices,
        out,
        lse,
        n_heads,
        kv.shape[0],
        topk,
        n_head_blocks,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        float(softmax_scale) * LOG2E,
        D_V=d_v,
        D_ROPE=d_rope,
        BLOCK_DV=pow2_at_least_16(d_v),
        BLOCK_DR=pow2_at_least_16(d_rope),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        DEFER_PV=dflt_defer if defer_pv is None else defer_pv,
        LAZY_RESCALE=dflt_lazy if lazy_rescale is None else lazy_rescale,
        RESCALE_LOG2=RESCALE_THRESHOLD_LOG2,
        WARP_SPECIALIZE=on_gpu and (dflt_ws if warp_specialize is None else warp_specialize),
        RELOAD_PREV=dflt_reload if reload_prev is None else reload_prev,
        UPCAST=not on_gpu,
        IEEE=on_gpu and q.dtype == torch.float32,
        num_warps=num_warps or dflt_warps,
        num_stages=num_stages or dflt_stages,
    )
    return out, lse
