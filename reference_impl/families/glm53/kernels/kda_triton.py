"""Triton chunked Kimi Delta Attention (KDA): the gated delta rule with a per-channel forget gate.

Contract: :func:`kda_chunked_triton` is :func:`reference_impl.families.glm53.model.kda.kda_chunked`, and
:func:`span_map_triton` is :func:`~reference_impl.families.glm53.model.kda.span_map`. Per head, over tokens
``t`` of one span, on a ``[Dk, Dv]`` float32 state ``S``::

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t

* ``q, k [T, H, Dk]`` (``q`` already scaled, ``q`` and ``k`` L2-normalised by the layer), ``v [T, H, Dv]``,
  ``g [T, H, Dk]`` (natural-log decay per channel, ``<= 0``), ``beta [T, H]``: float32, bf16 or fp16,
  upcast to float32 as they are loaded;
* ``state [H, Dk, Dv]``: the entering state (any float dtype; used as float32);
* returns ``o [T, H, Dv]`` float32 and the final state ``[H, Dk, Dv]`` float32. The state is float32
  throughout: it lives in registers between chunks and every product on it runs on float32 operands
  (``input_precision="ieee"`` by default: no TF32 rounding).

**Why chunked.** The token-by-token recurrence is a chain of ``T`` dependent steps, each a rank-1
update of the whole state after a reduction over it (``S^T k``): latency-bound, a few FLOPs per byte
of state per step, nothing for tensor cores to do. The chunked form (the WY / UT representation of
the ``C`` Householder-like factors of a chunk, as in the fla-org KDA kernels and ``transformers``'
torch fallback) makes the sequential chain ``T / C`` steps of matrix products, and moves everything
that does not touch the state into work parallel over chunks. Per chunk of ``C`` tokens with
cumulative log decay ``G`` (``G_i = g_1 + ... + g_i`` within the chunk, per channel)::

    N[i, j]   = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
    Aqk[i, j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])             (j <= i)
    Tm        = (I + N)^-1                                           (forward substitution)
    w = Tm (beta k exp(G)),  u = Tm (beta v)
    -- then, in sequence over chunks, with the state S entering the chunk --
    v_new = u - w S
    o     = (q exp(G)) S + Aqk v_new
    S     = diag(exp G_C) S + (k exp(G_C - G))^T v_new

Two kernels:

1. :func:`_kda_prep_kernel`, one program per (chunk, head), all in parallel: ``N`` and ``Aqk``
   column by column (each column's factor ``exp(G_i - G_j)`` is taken with its exponent masked to
   ``-inf`` above the diagonal, so it never overflows whatever the gate: exact for the softplus gate
   too, at ``C^2 Dk`` exponentials per chunk), ``Tm`` by forward substitution in registers (the
   reference's order), and ``w``, ``u`` as two ``tl.dot``. Writes ``w``, ``u`` and ``Aqk`` to a
   float32 scratch.
2. :func:`_kda_state_kernel`, one program per (head, block of ``BV`` state columns), the loop over
   chunks in sequence: four ``tl.dot`` per chunk against the ``[Dk, BV]`` state held in registers
   (the state's columns evolve independently, so column blocks are independent programs). Its
   exponentials are of ``G`` and ``G_C - G``, both ``<= 0``.

**The span map** ``S -> A S + B`` (what a CP rank hands on) is kernel 2 run once on the state
``[A | B]`` of width ``Dk + Dv`` entered as ``[I | 0]``, with value columns ``[0 | u]`` and no outputs:
``A`` is the recurrence from ``I`` with zero values, ``B`` the span's state from zero, and kernel 1's
``w`` (which depends on ``k``, ``g``, ``beta`` only) serves both.

**Bytes per token and head** (``e``: the input dtype's bytes, scratch float32, ``n_v = ceil(W / BV)``
column blocks with ``W = Dv`` for the outputs, ``Dk + Dv`` for the span map): kernel 1 reads
``e (3 Dk + Dv + 1)`` (``q`` only for the outputs) and writes ``4 (Dk + Dv + C)``; kernel 2 reads
``n_v (e (2 Dk [+ Dk for q]) + 4 (Dk [+ C for Aqk]))`` plus ``4 Dv`` of ``u`` and writes ``4 Dv`` of
``o``. At GLM-5.3-Flash's ``Dk = Dv = 128``, ``C = 64``, ``BV = 64``, bf16 inputs, with outputs: kernel 1
1.0 KB read + 1.3 KB written, kernel 2 2 x 1.5 KB + 0.5 KB read + 0.5 KB written, 6.4 KB per token
and head in all (the span map: the same 6.4 KB, four column blocks and no ``q``, ``Aqk`` or ``o``),
against the 1.5 KB the inputs and float32 outputs take at least. The ``[Dk, Dv]`` state (64 KB per
head) touches memory only where it enters and leaves. :func:`kda_bytes_per_token` computes the total.
The scratch holds ``4 (Dk + Dv + C)`` bytes per token and head while the call runs: 1.25 KB at those
dims, 1.3 GB for a 16K-token span of 64 heads (a production kernel keeps it in bf16, as fla does, or
fuses the two kernels per chunk).

Accuracy: the same algorithm as the reference in float32, sums in other orders. Every state map
factor ``(I - beta k k^T) diag(exp g)`` has spectral norm ``<= 1`` (``0 <= beta <= 1``, ``|k| <= 1``,
``g <= 0``), so rounding introduced in one chunk is not amplified by later ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.families.glm53.model.kda import KDA_CHUNK, check_kda_inputs
from reference_impl.kernels import interpreter_compat  # noqa: F401  (repairs triton < 3.7's interpreter)
from reference_impl.kernels.triton_helpers import pow2_at_least_16

CHUNKS = (16, 32, 64)
"""Chunk lengths the kernels take: powers of two (``tl.arange``), at least 16 (``tl.dot``)."""

STATE_BLOCK = 64
"""State columns per program of kernel 2: a ``[128, 64]`` float32 state is 32 KB of registers per program."""

DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")
"""``tl.dot``'s ``input_precision`` on float32 operands: ``ieee`` (exact float32 products, the default),
``tf32x3`` (three TF32 products, near float32), ``tf32`` (one, ~1e-3 relative: not the contract)."""


@triton.jit
def _kda_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    T,
    Dk,
    Dv,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    C: tl.constexpr,
    BK: tl.constexpr,
    BDV: tl.constexpr,
    WITH_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One chunk of one head: ``w [C, BK]``, ``u [C, BDV]``, ``Aqk [C, C]`` (when ``WITH_Q``) into the
    scratch rows ``head * n_chunks * C + chunk * C + i`` (widths ``BK``, ``BDV``, ``C``, padding zero)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, C)
    t = chunk * C + rows
    t_ok = t < T
    t64 = t.to(tl.int64)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BDV)
    mask_k = t_ok[:, None] & (ck < Dk)[None, :]
    mask_v = t_ok[:, None] & (cv < Dv)[None, :]
    # Read once per chunk: C x (2 Dk + Dv + 1) input elements (+ C x Dk for q); past T and Dk zeros,
    # so padded tokens add nothing (beta 0, k 0) and leave G flat (g 0), as the reference's padding.
    k = tl.load(k_ptr + t64[:, None] * stride_kt + head * stride_kh + ck[None, :], mask=mask_k, other=0.0)
    k = k.to(tl.float32)
    g = tl.load(g_ptr + t64[:, None] * stride_gt + head * stride_gh + ck[None, :], mask=mask_k, other=0.0)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + head * stride_vh + cv[None, :], mask=mask_v, other=0.0)
    beta = tl.load(beta_ptr + t64 * stride_bt + head * stride_bh, mask=t_ok, other=0.0).to(tl.float32)
    G = tl.cumsum(g.to(tl.float32), axis=0)  # [C, BK]: cumulative log decay within the chunk
    if WITH_Q:
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head * stride_qh + ck[None, :], mask=mask_k, other=0.0)
        q = q.to(tl.float32)
    else:
        q = k  # unused
    # N and Aqk column by column: column j needs exp(G_i - G_j) per channel, which does not factor
    # into a product of bounded terms; masking the exponent to -inf above the diagonal keeps it <= 1.
    kk = tl.zeros([C, C], tl.float32)
    qk = tl.zeros([C, C], tl.float32)
    for j in range(C):
        pick = (rows == j)[:, None]
        k_j = tl.sum(tl.where(pick, k, 0.0), axis=0)  # [BK]: row j, from registers
        G_j = tl.sum(tl.where(pick, G, 0.0), axis=0)
        decay = tl.exp(tl.where((rows >= j)[:, None], G - G_j[None, :], float("-inf")))  # [C, BK], <= 1
        kd_j = k_j[None, :] * decay
        column = (rows == j)[None, :]
        kk = tl.where(column, tl.sum(k * kd_j, axis=1)[:, None], kk)
        if WITH_Q:
            qk = tl.where(column, tl.sum(q * kd_j, axis=1)[:, None], qk)
    # Tm - I by forward substitution (the reference's order): row i <- row i + row i @ (rows < i, done).
    strict = rows[:, None] > rows[None, :]
    m = tl.where(strict, -beta[:, None] * kk, 0.0)
    for i in range(1, C):
        at_i = (rows == i)[:, None]
        row = tl.sum(tl.where(at_i, m, 0.0), axis=0)  # [C] over columns; zero from column i on
        row = row + tl.sum(row[:, None] * m, axis=0)
        m = tl.where(at_i, row[None, :], m)
    tm = m + tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    w = tl.dot(tm, beta[:, None] * k * tl.exp(G), input_precision=DOT_PRECISION)  # [C, BK]
    u = tl.dot(tm, beta[:, None] * v.to(tl.float32), input_precision=DOT_PRECISION)  # [C, BDV]
    # Write 4 x C x (BK + BDV [+ C]) bytes of scratch.
    scratch_row = (head * tl.num_programs(0) * C + t).to(tl.int64)
    tl.store(w_ptr + scratch_row[:, None] * BK + ck[None, :], w)
    tl.store(u_ptr + scratch_row[:, None] * BDV + cv[None, :], u)
    if WITH_Q:
        lower = rows[:, None] >= rows[None, :]
        tl.store(aqk_ptr + scratch_row[:, None] * C + rows[None, :], tl.where(lower, qk, 0.0))


@triton.jit
def _kda_state_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    s0_ptr,
    o_ptr,
    s_out_ptr,
    T,
    Dk,
    Dv,
    W,
    U_OFF,
    n_chunks,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    stride_ot,
    stride_oh,
    C: tl.constexpr,
    BK: tl.constexpr,
    BDV: tl.constexpr,
    BV: tl.constexpr,
    WITH_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Columns ``[c0, c0 + BV)`` of one head's state ``[Dk, W]`` through every chunk in sequence;
    state column ``c`` takes value column ``c - U_OFF`` of ``u`` (zero outside ``[0, Dv)``). Reads
    ``s0 [H, Dk, W]``, writes ``s_out [H, Dk, W]`` and (``WITH_OUT``, then ``W = Dv``) ``o [T, H, Dv]``."""
    head = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BV
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cs = c0 + tl.arange(0, BV)
    k_ok = ck < Dk
    s_ok = cs < W
    u_col = cs - U_OFF
    u_ok = (u_col >= 0) & (u_col < Dv)
    state_offs = head * Dk * W + ck[:, None] * W + cs[None, :]
    state_mask = k_ok[:, None] & s_ok[None, :]
    S = tl.load(s0_ptr + state_offs, mask=state_mask, other=0.0)  # [BK, BV] float32, in registers
    scratch0 = head * n_chunks * C
    for chunk in range(n_chunks):
        t = chunk * C + rows
        t_ok = t < T
        t64 = t.to(tl.int64)
        mask_k = t_ok[:, None] & k_ok[None, :]
        # Per chunk: C x 2 Dk input elements (k, g) and 4 C (BK + BV) scratch bytes (w, this block of u).
        k = tl.load(k_ptr + t64[:, None] * stride_kt + head * stride_kh + ck[None, :], mask=mask_k, other=0.0)
        k = k.to(tl.float32)
        g = tl.load(g_ptr + t64[:, None] * stride_gt + head * stride_gh + ck[None, :], mask=mask_k, other=0.0)
        G = tl.cumsum(g.to(tl.float32), axis=0)
        srow = (scratch0 + t).to(tl.int64)
        w = tl.load(w_ptr + srow[:, None] * BK + ck[None, :])
        u = tl.load(u_ptr + srow[:, None] * BDV + u_col[None, :], mask=u_ok[None, :], other=0.0)
        v_new = u - tl.dot(w, S, input_precision=DOT_PRECISION)  # [C, BV]
        if WITH_OUT:
            # + C x Dk input elements (q) and 4 C^2 scratch bytes (Aqk); writes 4 C BV bytes of o.
            q = tl.load(q_ptr + t64[:, None] * stride_qt + head * stride_qh + ck[None, :], mask=mask_k, other=0.0)
            aqk = tl.load(aqk_ptr + srow[:, None] * C + rows[None, :])
            o = tl.dot(q.to(tl.float32) * tl.exp(G), S, input_precision=DOT_PRECISION)
            o = tl.dot(aqk, v_new, acc=o, input_precision=DOT_PRECISION)
            tl.store(
                o_ptr + t64[:, None] * stride_ot + head * stride_oh + cs[None, :],
                o,
                mask=t_ok[:, None] & (cs < Dv)[None, :],
            )
        G_last = tl.sum(tl.where((rows == C - 1)[:, None], G, 0.0), axis=0)  # [BK]: padded tokens add 0
        k_decayed = k * tl.exp(G_last[None, :] - G)  # <= |k|: G decreases along the chunk
        S = S * tl.exp(G_last)[:, None]
        S = tl.dot(tl.trans(k_decayed), v_new, acc=S, input_precision=DOT_PRECISION)
    tl.store(s_out_ptr + state_offs, S, mask=state_mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_options(chunk: int, dot_precision: str) -> None:
    if chunk not in CHUNKS:
        raise ValueError(f"chunk={chunk}: the kernels take chunks of {CHUNKS} tokens")
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision={dot_precision!r}: one of {DOT_PRECISIONS}")


def _run(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    u_offset: int,
    chunk: int,
    dot_precision: str,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Kernel 1 then kernel 2 on a state ``state [H, Dk, W]`` whose columns from ``u_offset`` take ``v``'s."""
    T, H, Dk = k.shape
    Dv, W = v.shape[2], state.shape[2]
    k, v, g, beta = (_last_dim_contiguous(t) for t in (k, v, g, beta))
    q = None if q is None else _last_dim_contiguous(q)
    dev = k.device
    state = state.to(torch.float32).contiguous()
    n_chunks = triton.cdiv(T, chunk)
    BK, BDV = pow2_at_least_16(Dk), pow2_at_least_16(Dv)
    BV = min(STATE_BLOCK, pow2_at_least_16(W))
    rows = H * n_chunks * chunk
    warps = 8 if BK >= 128 else 4  # [C, 128] float32 tiles: 8 warps keep each 32 registers per thread
    w = torch.empty(rows, BK, dtype=torch.float32, device=dev)
    u = torch.empty(rows, BDV, dtype=torch.float32, device=dev)
    with_q = q is not None
    aqk = torch.empty(rows if with_q else 1, chunk, dtype=torch.float32, device=dev)
    qq = q if q is not None else k
    _kda_prep_kernel[(n_chunks, H)](
        qq, k, v, g, beta, w, u, aqk, T, Dk, Dv,
        qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        C=chunk, BK=BK, BDV=BDV, WITH_Q=with_q, DOT_PRECISION=dot_precision, num_warps=warps,
    )  # fmt: skip
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=dev) if with_q else None
    o_arg = out if out is not None else w
    final = torch.empty_like(state)
    _kda_state_kernel[(H, triton.cdiv(W, BV))](
        qq, k, g, w, u, aqk, state, o_arg, final, T, Dk, Dv, W, u_offset, n_chunks,
        qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
        o_arg.stride(0), o_arg.stride(1) if o_arg.dim() == 3 else 0,
        C=chunk, BK=BK, BDV=BDV, BV=BV, WITH_OUT=with_q, DOT_PRECISION=dot_precision, num_warps=warps,
    )  # fmt: skip
    return out, final


def kda_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = KDA_CHUNK,
    *,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [T, H, Dv], final state [H, Dk, Dv])``, both float32, from ``q, k, g [T, H, Dk]``,
    ``v [T, H, Dv]``, ``beta [T, H]`` and the entering ``state [H, Dk, Dv]``; see the module docstring."""
    check_kda_inputs(q, k, v, g, beta, state)
    _check_options(chunk, dot_precision)
    if q.shape[0] == 0:
        return torch.zeros(v.shape, dtype=torch.float32, device=v.device), state.float().clone()
    out, final = _run(q, k, v, g, beta, state, 0, chunk, dot_precision)
    assert out is not None
    return out, final


def span_map_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = KDA_CHUNK,
    *,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's state map ``S -> A S + B``: ``(A [H, Dk, Dk], B [H, Dk, Dv])`` float32, two views of one
    ``[H, Dk, Dk + Dv]`` tensor (the state ``[A | B]`` run from ``[I | 0]``; see the module docstring)."""
    T, H, Dk = k.shape if k.dim() == 3 else (0, 0, 0)
    Dv = v.shape[2] if v.dim() == 3 else 0
    check_kda_inputs(k, k, v, g, beta, k.new_zeros((H, Dk, Dv), dtype=torch.float32))
    _check_options(chunk, dot_precision)
    entering = torch.zeros(H, Dk, Dk + Dv, dtype=torch.float32, device=k.device)
    entering[:, :, :Dk] = torch.eye(Dk, dtype=torch.float32, device=k.device)
    if T == 0:
        return entering[:, :, :Dk], entering[:, :, Dk:]
    _, final = _run(None, k, v, g, beta, entering, Dk, chunk, dot_precision)
    return final[:, :, :Dk], final[:, :, Dk:]


def kda_bytes_per_token(Dk: int, Dv: int, input_bytes: int, chunk: int = KDA_CHUNK, *, outputs: bool = True) -> int:
    """Bytes the two kernels move per token and head (the module docstring's count; the scratch at
    its padded widths taken equal to ``Dk``, ``Dv``)."""
    width = Dv if outputs else Dk + Dv
    n_v = triton.cdiv(width, min(STATE_BLOCK, pow2_at_least_16(width)))
    prep = input_bytes * ((3 if outputs else 2) * Dk + Dv + 1) + 4 * (Dk + Dv + (chunk if outputs else 0))
    per_block = input_bytes * (3 if outputs else 2) * Dk + 4 * (Dk + (chunk if outputs else 0))
    state = n_v * per_block + 4 * Dv + (4 * Dv if outputs else 0)
    return prep + state
