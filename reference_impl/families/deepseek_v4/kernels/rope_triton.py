"""Triton per-head norm and tail RoPE for DeepSeek-V4: one read and one write of each head.

Contract: :func:`reference_impl.families.deepseek_v4.model.rope_tail.rope_tail`. ``x [T, ..., D]`` (float32 or bf16,
the last dim contiguous) is viewed as ``N = T x heads`` rows of ``D``; a program takes
``BLOCK_R`` rows:

* loads the rows ``[BLOCK_R, D]`` once (float32 in registers); with ``RMS`` multiplies each by
  ``rsqrt(mean(row^2) + eps)``; rounds to ``x``'s dtype and then to the output's (the reference's
  two casts) and stores the first ``D - ROPE`` dims;
* reloads the tail's even and odd elements (from L1/L2, the row was just read), applies the same
  scale and roundings, rotates the pairs by the token's ``cos, sin`` and stores them interleaved.

Bytes: ``N x D x (in + out)`` element bytes plus the ``[T, ROPE/2]`` cos/sin tables, against about
ten passes of the torch reference. Not bit-exact: the mean's sum order differs, and on a GPU the
compiler may fuse the rotation's multiply-adds (the V3.2 query kernel turns that off to be
bit-exact; this one does not), so a float32 result may differ in its last bit and a bf16 output
by one step (the GPU tier allows one step and asks 99% of elements bit-equal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels import interpreter_compat  # noqa: F401  (repairs triton < 3.7's interpreter)

BLOCK_ROWS = 8
"""Rows (heads) per program: 8 x 512 bf16 = 8 KiB in, 8 KiB out."""

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rope_tail_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    heads,
    stride_x,
    stride_out,
    stride_cs,
    eps,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RMS: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < n_rows
    token = rows // heads
    offs = tl.arange(0, BLOCK_D)
    mask = r_mask[:, None] & (offs < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.full([BLOCK_R], 1.0, tl.float32)
    if RMS:
        scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * scale[:, None]).to(IN_DTYPE).to(OUT_DTYPE)
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :], y, mask=mask & (offs < D - ROPE)[None, :])

    pair = tl.arange(0, ROPE // 2)
    tail = D - ROPE + 2 * pair
    p_mask = r_mask[:, None]
    src = x_ptr + rows[:, None] * stride_x + tail[None, :]
    a = tl.load(src, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=p_mask, other=0.0).to(tl.float32)
    a = (a * scale[:, None]).to(IN_DTYPE).to(OUT_DTYPE).to(tl.float32)
    b = (b * scale[:, None]).to(IN_DTYPE).to(OUT_DTYPE).to(tl.float32)
    c = tl.load(cos_ptr + token[:, None] * stride_cs + pair[None, :], mask=p_mask, other=0.0)
    s = tl.load(sin_ptr + token[:, None] * stride_cs + pair[None, :], mask=p_mask, other=0.0)
    dst = out_ptr + rows[:, None] * stride_out + tail[None, :]
    tl.store(dst, (a * c - b * s).to(OUT_DTYPE), mask=p_mask)
    tl.store(dst + 1, (a * s + b * c).to(OUT_DTYPE), mask=p_mask)


def rope_tail_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    rms_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The kernel behind :func:`~reference_impl.families.deepseek_v4.model.rope_tail.rope_tail`'s contract."""
    out_dtype = out_dtype or x.dtype
    d = x.shape[-1]
    if x.dtype not in _TL_DTYPES or out_dtype not in _TL_DTYPES:
        raise ValueError(f"rope_tail_triton takes float32/bf16/fp16, got {x.dtype} -> {out_dtype}")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > d or (rope_dim // 2) & (rope_dim // 2 - 1):
        raise ValueError(f"rope_dim={rope_dim}: need an even power-of-two pair count within the last dim {d}")
    n_tok = x.shape[0]
    if cos.shape != (n_tok, rope_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)}: need [{n_tok}, {rope_dim // 2}]")
    rows = x.reshape(-1, d) if x.numel() else x.new_empty(0, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows = rows.shape[0]
    if n_rows == 0:
        return out
    heads = n_rows // n_tok
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _rope_tail_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
        rows,
        cos,
        sin,
        out.view(-1, d),
        n_rows,
        heads,
        rows.stride(0),
        d,
        cos.stride(0),
        0.0 if rms_eps is None else rms_eps,
        D=d,
        ROPE=rope_dim,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_R=BLOCK_ROWS,
        RMS=rms_eps is not None,
        IN_DTYPE=_TL_DTYPES[x.dtype],
        OUT_DTYPE=_TL_DTYPES[out_dtype],
        num_warps=4,
    )
    return out
