"""The query preparation of a DSA layer in one pass per tensor: two Triton kernels.

Contracts: :func:`reference_impl.model.query_prep.indexer_query` and
:func:`reference_impl.model.query_prep.rope_into`. As torch ops, the indexer query at one rank's
16K tokens (``[16384, 64, 128]`` bf16, 268 MB) goes through about twenty elementwise kernels and
float32 copies (upcast, RoPE halves, concatenations, a float32 FFMA GEMM for the Hadamard rotation,
scaling, ``abs``, ``amax``, division, clamp, casts): several GB of traffic for 268 MB in and 134 MB
out. Here each program reads its rows once, keeps every intermediate in registers and writes the
result once.

* :func:`indexer_query_triton`: one program per ``BLOCK_M`` (token, head) rows of ``D = 128``
  values: RoPE on the first ``rope_dim`` columns (each column loads its pair partner too, an L1
  hit), rounded to the input dtype; the Hadamard rotation as a ``[BLOCK_M, 128] x [128, 128]``
  ``tl.dot`` (bf16 operands: the values are bf16 and the matrix is +-1, so every product is exact
  and the sums run in float32), times ``D^-0.5``, rounded to the input dtype; FP8 quantization with
  one scale per row (:func:`~reference_impl.kernels.triton_helpers.quantize_block`); the row's head
  weight times ``Hi^-0.5``, the scale and ``D^-0.5``, in the reference's order.
  Read ``2 T Hi D`` bytes (bf16) + ``4 T Hi``; write ``T Hi D + 4 T Hi``.
* :func:`rope_into_triton`: RoPE of ``[T, H, R]`` strided rows straight into the output view.
  Read ``2 T H R``, write ``2 T H R`` (bf16).

Rounding. The kernels compile with ``enable_fp_fusion=False``: RoPE's ``a * c - b * s`` is two
rounded products and a rounded difference, as torch's separate kernels compute it, not an FMA; so
:func:`rope_into_triton` equals the reference bit for bit, and so do the indexer query's RoPE, its
scaling and its weights' products. The Hadamard sums are the one step whose order differs from the
reference's float32 GEMM: a rotated value can differ in its last float32 bit, so after rounding to
bf16 a few values (and their FP8 codes, and a head's scale) move by one step. Under the CPU
interpreter (``soft=True``) the bf16 and e4m3 roundings use the integer paths of
:mod:`.triton_helpers` and the rotation a float32 ``tl.dot``.

What runs here (:func:`indexer_query_unsupported`, :func:`rope_into_unsupported` name the rest,
which the dispatch sends to the torch references): bf16 or float32 inputs, ``D = 128`` and an even
rope width for the indexer query; bf16 or float32 output for RoPE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.triton_helpers import bf16_bits, quantize_block

QUERY_PREP_CONFIG: dict[str, tuple[int, int]] = {"indexer_query": (64, 4), "rope_into": (16, 2)}
"""(BLOCK_M rows, num_warps) per kernel, tuned on an H200 (measured: ``docs/glue-kernels.md#tuning-history``);
the CPU interpreter uses the same."""

_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _pair_columns(cols, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """RoPE pairs over the first ``R`` columns -> (first of its pair, the partner column, the frequency)."""
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        first = (cols % 2) == 0
        partner = cols ^ 1
        freq = cols // 2
    else:  # pairs (i, i + R / 2)
        first = cols < R // 2
        partner = tl.where(first, cols + R // 2, cols - R // 2)
        freq = tl.where(first, cols, cols - R // 2)
    return first, partner, freq


@triton.jit
def _rotate(x, partner, cos, sin, first):
    """torch's ``apply_rope`` per column: ``a c - b s`` for the first of a pair ``(a, b)``, ``a s + b c``
    for the second (no FMA: the kernels compile with ``enable_fp_fusion=False``)."""
    return tl.where(first, x * cos - partner * sin, partner * sin + x * cos)


@triton.jit
def _round_to(x, IN_BF16: tl.constexpr, SOFT: tl.constexpr):
    """float32 ``x`` rounded to the input dtype and widened back (``.to(dtype).float()``)."""
    if IN_BF16:
        x = (bf16_bits(x, SOFT).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _indexer_query_kernel(
    q_ptr,
    cos_ptr,
    sin_ptr,
    hadamard_ptr,
    w_ptr,
    q_out_ptr,
    w_out_ptr,
    n_rows,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_wt,
    stride_wh,
    inv_sqrt_d,
    head_scale,
    dim_scale,
    N_HEADS: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IN_BF16: tl.constexpr,
    UE8M0: tl.constexpr,
    SOFT: tl.constexpr,
    FAST_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * N_HEADS + head
    ok = rows < n_rows
    token, head = rows // N_HEADS, rows % N_HEADS
    cols = tl.arange(0, D)
    row_ptr = q_ptr + token * stride_qt + head * stride_qh
    x = tl.load(row_ptr[:, None] + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # read 2 BLOCK_M D

    first, partner, freq = _pair_columns(cols, R, INTERLEAVED)
    rope = ok[:, None] & (cols < R)[None, :]
    x_pair = tl.load(row_ptr[:, None] + partner[None, :], mask=rope, other=0.0).to(tl.float32)  # L1 hits
    cos = tl.load(cos_ptr + token[:, None] * stride_cs + freq[None, :], mask=rope, other=1.0)
    sin = tl.load(sin_ptr + token[:, None] * stride_cs + freq[None, :], mask=rope, other=0.0)
    x = tl.where(rope, _round_to(_rotate(x, x_pair, cos, sin, first[None, :]), IN_BF16, SOFT), x)

    h_rows = tl.arange(0, D)
    hadamard = tl.load(hadamard_ptr + h_rows[:, None] * D + h_rows[None, :])  # [D, D] +-1, cached
    if IN_BF16 and not SOFT:
        y = tl.dot(x.to(tl.bfloat16), hadamard.to(tl.bfloat16))  # exact products, float32 sums
    else:
        y = tl.dot(x, hadamard, input_precision="ieee")
    y = _round_to(y * inv_sqrt_d, IN_BF16, SOFT)

    codes, scale = quantize_block(y, 1, UE8M0, SOFT, FAST_DIV)
    tl.store(q_out_ptr + rows[:, None] * D + cols[None, :], codes, mask=ok[:, None])  # write BLOCK_M D
    w = tl.load(w_ptr + token * stride_wt + head * stride_wh, mask=ok, other=0.0)
    tl.store(w_out_ptr + rows, w * head_scale * scale * dim_scale, mask=ok)


@triton.jit
def _rope_into_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ot,
    stride_oh,
    N_HEADS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SOFT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * N_HEADS + head
    token, head = rows // N_HEADS, rows % N_HEADS
    cols = tl.arange(0, BLOCK_R)
    mask = (rows < n_rows)[:, None] & (cols < R)[None, :]
    first, partner, freq = _pair_columns(cols, R, INTERLEAVED)
    row_ptr = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # read 2 BLOCK_M R
    x_pair = tl.load(row_ptr[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)  # L1 hits
    cos = tl.load(cos_ptr + token[:, None] * stride_cs + freq[None, :], mask=mask, other=1.0)
    sin = tl.load(sin_ptr + token[:, None] * stride_cs + freq[None, :], mask=mask, other=0.0)
    y = _rotate(x, x_pair, cos, sin, first[None, :])
    out_row = out_ptr + token * stride_ot + head * stride_oh
    if OUT_BF16:
        tl.store(out_row.to(tl.pointer_type(tl.int16))[:, None] + cols[None, :], bf16_bits(y, SOFT), mask=mask)
    else:
        tl.store(out_row[:, None] + cols[None, :], y, mask=mask)  # write 2 BLOCK_M R (bf16)


# ---- host side -----------------------------------------------------------------------------------


def indexer_query_unsupported(q: torch.Tensor, rope_dim: int, scale_fmt: str) -> str | None:
    """Why :func:`indexer_query_triton` cannot run these inputs, or ``None`` when it can."""
    if q.dim() != 3:
        return f"q must be [T, Hi, D], got shape {tuple(q.shape)}"
    if q.dtype not in _DTYPES:
        return f"q dtype {q.dtype} (the kernel reads bf16 or float32)"
    if q.shape[2] != 128:
        return f"index head dim {q.shape[2]} (the kernel quantizes one 128-value block per head)"
    if rope_dim % 2 or not 0 < rope_dim <= q.shape[2]:
        return f"rope_dim {rope_dim} must be even and within the head dim {q.shape[2]}"
    if scale_fmt not in ("fp32", "ue8m0"):
        return f"unknown scale_fmt {scale_fmt!r}"
    return None


def rope_into_unsupported(out: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why :func:`rope_into_triton` cannot run these tensors, or ``None`` when it can."""
    if x.dim() != 3 or out.shape != x.shape:
        return f"x and out must be [T, H, R] of one shape, got {tuple(x.shape)} and {tuple(out.shape)}"
    if x.shape[2] % 2:
        return f"rope width {x.shape[2]} is odd"
    if x.dtype not in _DTYPES or out.dtype not in _DTYPES:
        return f"dtypes {x.dtype} -> {out.dtype} (the kernel reads and writes bf16 or float32)"
    if out.stride(2) != 1 or (out.dtype == torch.bfloat16 and out.data_ptr() % 2):
        return "out's last dim must be contiguous"
    return None


def _check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, n_tokens: int, rope_dim: int) -> None:
    want = (n_tokens, rope_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {want}, got {t.dtype} {tuple(t.shape)}")


def indexer_query_triton(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hadamard: torch.Tensor,
    head_weights: torch.Tensor,
    rope_dim: int,
    interleaved: bool,
    scale_fmt: str,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_impl.model.query_prep.indexer_query` in one kernel (see the module docstring).

    ``soft`` (default: not on CUDA) takes the interpreter-exact rounding paths; ``block_m`` and
    ``num_warps`` override :data:`QUERY_PREP_CONFIG`. Inputs it cannot run raise ``ValueError``
    naming the problem (:func:`indexer_query_unsupported`).
    """
    reason = indexer_query_unsupported(q, rope_dim, scale_fmt)
    if reason is not None:
        raise ValueError(f"indexer_query_triton: {reason}")
    n_tokens, n_heads, d = q.shape
    _check_rope_tables(cos, sin, n_tokens, rope_dim)
    if tuple(hadamard.shape) != (d, d) or tuple(head_weights.shape) != (n_tokens, n_heads):
        raise ValueError(
            f"indexer_query_triton: hadamard {tuple(hadamard.shape)} must be ({d}, {d}) and head_weights "
            f"{tuple(head_weights.shape)} must be ({n_tokens}, {n_heads})"
        )
    soft = q.device.type != "cuda" if soft is None else soft
    default_m, default_warps = QUERY_PREP_CONFIG["indexer_query"]
    block_m = block_m or default_m
    q = q if q.stride(2) == 1 else q.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    hadamard = hadamard.to(torch.float32).contiguous()
    weights = head_weights.to(torch.float32)
    q_out = torch.empty(n_tokens, n_heads, d, dtype=torch.uint8, device=q.device)
    w_out = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=q.device)
    n_rows = n_tokens * n_heads
    if n_rows:
        in_bf16 = q.dtype == torch.bfloat16
        _indexer_query_kernel[(triton.cdiv(n_rows, block_m),)](
            q,
            cos,
            sin,
            hadamard,
            weights,
            q_out,
            w_out,
            n_rows,
            q.stride(0),
            q.stride(1),
            cos.stride(0),
            weights.stride(0),
            weights.stride(1),
            1.0 / d**0.5,
            n_heads**-0.5,
            d**-0.5,
            N_HEADS=n_heads,
            D=d,
            R=rope_dim,
            INTERLEAVED=interleaved,
            IN_BF16=in_bf16,
            UE8M0=scale_fmt == "ue8m0",
            SOFT=soft,
            FAST_DIV=in_bf16 and not soft,
            BLOCK_M=block_m,
            num_warps=num_warps or default_warps,
            enable_fp_fusion=False,
        )
    return q_out.view(torch.float8_e4m3fn), w_out


def rope_into_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    *,
    soft: bool | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
) -> None:
    """:func:`reference_impl.model.query_prep.rope_into` in one kernel; arguments as
    :func:`indexer_query_triton`'s. Writes ``out`` in place (any row strides; last dim contiguous)."""
    reason = rope_into_unsupported(out, x)
    if reason is not None:
        raise ValueError(f"rope_into_triton: {reason}")
    n_tokens, n_heads, width = x.shape
    _check_rope_tables(cos, sin, n_tokens, width)
    soft = x.device.type != "cuda" if soft is None else soft
    default_m, default_warps = QUERY_PREP_CONFIG["rope_into"]
    block_m = block_m or default_m
    x = x if x.stride(2) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    n_rows = n_tokens * n_heads
    if n_rows:
        _rope_into_kernel[(triton.cdiv(n_rows, block_m),)](
            x,
            cos,
            sin,
            out,
            n_rows,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            out.stride(0),
            out.stride(1),
            N_HEADS=n_heads,
            R=width,
            BLOCK_R=triton.next_power_of_2(width),
            INTERLEAVED=interleaved,
            OUT_BF16=out.dtype == torch.bfloat16,
            SOFT=soft,
            BLOCK_M=block_m,
            num_warps=num_warps or default_warps,
            enable_fp_fusion=False,
        )
