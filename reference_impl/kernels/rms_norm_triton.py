"""RMSNorm in one pass: a Triton kernel for :func:`reference_impl.model.norm.rms_norm`.

As torch ops the norm is an upcast copy, ``pow``, ``mean``, ``rsqrt``, two products and a downcast:
about seven passes over a float32 copy of the input. On one rank's 16K tokens the hidden state's
``attn_norm`` alone moves about 4 GB that way, for 235 MB in and 235 MB out (bf16, 7,168 wide).
Here each program reads ``BLOCK_M`` whole rows once, reduces in registers and writes the rows once.
Read ``2 n`` bytes per row (bf16) and the ``4 n`` weight (cached), write ``2 n``.

Rounding: the products, the mean (the sum times ``1 / n``) and the final product follow the
reference's float32 steps, but the sum runs in another order than torch's reduction and
``rsqrt`` is the hardware's, so a result can differ from torch's in its last bits; rounded to
bf16, most values are equal and the rest one bf16 step apart. The GPU tier checks that bound; the
CPU tier checks the kernel under the interpreter to float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels.triton_helpers import bf16_bits

ROW_ELEMENTS = 8192
"""Values one program holds: ``BLOCK_M = max(1, ROW_ELEMENTS // BLOCK_N)`` rows of ``BLOCK_N`` columns."""


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_out,
    inv_n,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SOFT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # read 2 n
    mean_sq = tl.sum(x * x, axis=1) * inv_n
    y = x * tl.math.rsqrt(mean_sq + eps)[:, None]
    out = tl.load(w_ptr + cols, mask=col_ok, other=0.0)[None, :] * y
    out_row = out_ptr + rows[:, None] * stride_out
    if OUT_BF16:
        tl.store(out_row.to(tl.pointer_type(tl.int16)) + cols[None, :], bf16_bits(out, SOFT), mask=mask)  # write 2 n
    else:
        tl.store(out_row + cols[None, :], out, mask=mask)


def rms_norm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`rms_norm_triton` cannot run these tensors, or ``None`` when it can."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"x dtype {x.dtype} (the kernel reads bf16 or float32)"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.dtype != torch.float32:
        return f"weight must be float32 [{x.shape[-1]}], got {weight.dtype} {tuple(weight.shape)}"
    if x.shape[-1] > 4 * ROW_ELEMENTS:
        return f"rows of {x.shape[-1]} values (the kernel holds a row of at most {4 * ROW_ELEMENTS} in registers)"
    return None


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, soft: bool | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """:func:`reference_impl.model.norm.rms_norm` in one kernel -> a new tensor shaped and typed like ``x``.

    ``soft`` (default: not on CUDA) rounds to bf16 with the interpreter-exact integer path;
    ``num_warps`` defaults to 4 per 2,048 values of a program (1 to 16).
    """
    reason = rms_norm_unsupported(x, weight)
    if reason is not None:
        raise ValueError(f"rms_norm_triton: {reason}")
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        block_n = triton.next_power_of_2(n)
        block_m = max(1, ROW_ELEMENTS // block_n)
        warps = num_warps or min(16, max(1, block_m * block_n // 2048 * 4))
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_m),)](
            rows,
            weight.contiguous(),
            out,
            rows.shape[0],
            n,
            rows.stride(0),
            out.stride(0),
            1.0 / n,
            eps,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            OUT_BF16=x.dtype == torch.bfloat16,
            SOFT=not x.is_cuda if soft is None else soft,
            num_warps=warps,
        )
    return out.view(x.shape)
