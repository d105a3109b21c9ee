"""The block-scaled FP8 GEMM of DeepSeek's projections on a GPU: ``torch._scaled_mm``, or a Triton kernel.

Contract (:data:`reference_impl.model.fp8_linear.BlockGemm`, the torch emulation
:func:`~reference_impl.model.fp8_linear.emulated_block_fp8_gemm` is the reference):
``x_fp8 [M, K]`` e4m3 with ``x_scale [M, K/128]`` float32 (1 x 128 blocks), ``w_fp8 [N, K]``
e4m3 with ``w_scale [N/128, K/128]`` float32 (128 x 128 blocks; ``N`` and ``K`` multiples of 128)
-> ``[M, N]`` in ``out_dtype``, accumulated in float32.

Two paths, tried in this order by :func:`block_fp8_gemm`:

1. **cuBLAS through ``torch._scaled_mm``** (:func:`scaled_mm_block_fp8`) where it takes
   DeepSeek's recipe: Hopper (sm_90), CUDA 12.9+ and a torch that infers the 1 x 128 / 128 x 128
   block scaling from the scale shapes (2.9 and later). Its layout rules: ``x_scale`` outer-dim
   major (``[M, K/128]`` with strides ``(1, M)``); ``w_scale`` as ``[L4, N/128]`` with strides
   ``(1, L4)``, ``L4 = K/128`` rounded up to 4 (zero columns); an explicit output dtype; ``M`` a
   multiple of 4 (padded rows).
2. **A Triton kernel** (:func:`block_fp8_gemm_triton`; also under the CPU interpreter): a program
   owns a ``BLOCK_M x 128`` output tile and walks ``K`` in 128-wide steps, each one FP8 product
   (fp32 under the interpreter) scaled by the step's activation scales (a column) and weight
   scale (one number), added to an fp32 accumulator: DeepSeek's ``fp8_gemm`` structure.

A path that raises logs one warning and the next runs (:func:`~reference_impl.kernels.fallback.run_with_fallback`);
CPU tensors (outside the interpreter) take the emulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels import fallback
from reference_impl.model.fp8_linear import BLOCK, emulated_block_fp8_gemm

GPU_CONFIG = (128, 4, 8)
"""(BLOCK_M, num_stages, num_warps) of the Triton kernel on the GPU (``BLOCK_N = BLOCK_K = 128``)."""
CPU_CONFIG = (16, 1, 4)


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)  # GROUP_M row tiles share the weight tiles in L2
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * n_n)) // rows_in_group
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (kb * BLOCK_K + offs_k)[None, :], mask=m_mask[:, None], other=0.0
        )
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (kb * BLOCK_K + offs_k)[:, None])  # [BLOCK_K, BLOCK_N]
        x_scale = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=m_mask, other=0.0)
        w_scale = tl.load(ws_ptr + pid_n * stride_wsn + kb)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w) * (x_scale[:, None] * w_scale)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None]
    )


def _check(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor
) -> tuple[int, int, int]:
    (m, k), n = x_fp8.shape, w_fp8.shape[0]
    if k % BLOCK or n % BLOCK or w_fp8.shape[1] != k:
        raise ValueError(
            f"block FP8 GEMM needs K and N multiples of {BLOCK}: x {tuple(x_fp8.shape)}, w {tuple(w_fp8.shape)}"
        )
    if x_scale.shape != (m, k // BLOCK) or w_scale.shape != (n // BLOCK, k // BLOCK):
        raise ValueError(f"scales {tuple(x_scale.shape)} / {tuple(w_scale.shape)} do not match x {m}x{k} and w {n}x{k}")
    return m, n, k


def block_fp8_gemm_triton(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernel (see the module docstring) -> ``[M, N]`` ``out_dtype``. ``config``:
    ``(BLOCK_M, num_stages, num_warps)``."""
    m, n, k = _check(x_fp8, x_scale, w_fp8, w_scale)
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    on_gpu = x_fp8.device.type == "cuda"
    block_m, stages, warps = config or (GPU_CONFIG if on_gpu else CPU_CONFIG)
    x_fp8, w_fp8 = x_fp8.contiguous(), w_fp8.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    grid = (triton.cdiv(m, block_m) * (n // BLOCK),)
    _block_fp8_gemm_kernel[grid](
        x_fp8,
        x_scale,
        w_fp8,
        w_scale,
        out,
        m,
        n,
        k,
        x_fp8.stride(0),
        x_scale.stride(0),
        w_fp8.stride(0),
        w_scale.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK,
        BLOCK_K=BLOCK,
        GROUP_M=8,
        UPCAST=not on_gpu,
        num_stages=stages,
        num_warps=warps,
    )
    return out


def scaled_mm_block_fp8(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``torch._scaled_mm`` with DeepSeek's block scaling (cuBLAS, sm_90, CUDA 12.9+) -> ``[M, N]``.

    Raises where torch or the device does not take the recipe (the dispatch then runs Triton)."""
    m, n, k = _check(x_fp8, x_scale, w_fp8, w_scale)
    if not x_fp8.is_cuda or torch.cuda.get_device_capability(x_fp8.device) != (9, 0):
        raise RuntimeError("torch._scaled_mm block scaling (1x128 / 128x128) runs on sm_90 only")
    m_pad = -(-m // 4) * 4
    if m_pad != m:  # cuBLASLt wants M a multiple of 4
        x_fp8 = torch.cat([x_fp8, x_fp8.new_zeros(m_pad - m, k)])
        x_scale = torch.cat([x_scale, x_scale.new_ones(m_pad - m, k // BLOCK)])
    a_scale = x_scale.float().t().contiguous().t()  # [M, K/128], outer-dim major
    l4 = -(-(k // BLOCK) // 4) * 4
    b_scale = torch.zeros(n // BLOCK, l4, dtype=torch.float32, device=w_scale.device)
    b_scale[:, : k // BLOCK] = w_scale
    out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype)
    return out[:m]


def block_fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The GEMM :class:`~reference_impl.model.fp8_linear.Fp8BlockLinear` runs through the kernels:
    cuBLAS (``torch._scaled_mm``), else Triton, else the torch emulation (see the module docstring)."""
    _check(x_fp8, x_scale, w_fp8, w_scale)  # bad shapes are refused here, not by a fallback
    args = (x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    if not fallback.use_kernels(x_fp8.device):
        return emulated_block_fp8_gemm(*args)

    def triton_path() -> torch.Tensor:
        return fallback.run_with_fallback(
            "Triton block FP8 GEMM", lambda: block_fp8_gemm_triton(*args), lambda: emulated_block_fp8_gemm(*args)
        )

    return fallback.run_with_fallback(
        "torch._scaled_mm block FP8 GEMM", lambda: scaled_mm_block_fp8(*args), triton_path, to="the Triton kernel"
    )
