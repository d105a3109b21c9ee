"""The workload of one run: device, compute dtype, model weights and layer-0 inputs.

Everything is derived from the :class:`~reference_impl.config.RunConfig` and its seed, so every
rank (and the oracle) builds the same model and inputs without exchanging them.
"""

from __future__ import annotations

import torch

from reference_impl.config import RunConfig, env_flag
from reference_impl.kernels.dispatch import KERNEL_OPS
from reference_impl.model.oracle import DSAModel, init_weights
from reference_impl.model.v4.oracle import build_v4_model
from reference_impl.kernels.v4_dispatch import V4_KERNEL_OPS
from reference_impl.model.v4.ops import V4Ops
from reference_impl.presets_v4 import is_v4


def resolve_device(run: RunConfig) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(run.device)


def compute_dtype(run: RunConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (tight oracle agreement), bfloat16 on CUDA (the real model's)."""
    if run.compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[run.compute_dtype]


@torch.no_grad()
def build_model(run: RunConfig, device: torch.device) -> DSAModel:
    """The run's model with deterministic weights from ``run.seed``; its indexer top-k and sparse
    attention go through the kernel dispatch (:data:`~reference_impl.kernels.dispatch.KERNEL_OPS`).
    A DeepSeek-V4 preset gives a :class:`~reference_impl.model.v4.oracle.V4Model`.

    With ``DSACP_FP8_PROJECTIONS=1`` the attention's projections become FP8 with 128-block scales
    (:func:`~reference_impl.model.fp8_linear.quantize_projections`, the GEMM of
    :mod:`reference_impl.kernels.fp8_gemm`), as DeepSeek runs its checkpoints; every rank and the
    oracle build the same model, so they still agree. Off by default: bf16 is the reference."""
    if is_v4(run.model):
        return build_v4_model(run.model, compute_dtype(run, device), run.seed, device, build_v4_ops(device))  # type: ignore[return-value]
    with torch.device(device):
        model = DSAModel(run.model, compute_dtype(run, device), ops=KERNEL_OPS)
    model = init_weights(model, run.seed).eval()
    if env_flag("fp8_projections"):
        from reference_impl.kernels.fp8_gemm import block_fp8_gemm
        from reference_impl.model.fp8_linear import quantize_projections

        quantize_projections(model, run.model.index_scale_fmt, block_fp8_gemm)
    return model


def build_inputs(run: RunConfig, device: torch.device) -> list[torch.Tensor]:
    """Layer-0 hidden states per request, ``[prefix + extend, dim]``, ~N(0, 1), from ``run.seed + 1``;
    a request that shares an earlier one's prefix starts with that request's rows."""
    gen = torch.Generator(device=device).manual_seed(run.seed + 1)
    dtype = compute_dtype(run, device)
    inputs = [torch.randn(r.total, run.model.dim, generator=gen, device=device).to(dtype) for r in run.requests]
    for r, x in zip(run.requests, inputs):
        if r.shares is not None:  # ``rN:P+E``: the same first P tokens as request N
            x[: r.prefix] = inputs[r.shares][: r.prefix]
    return inputs


def build_v4_ops(device: torch.device) -> V4Ops:
    """The V4 layer's compute cores: the kernel dispatch (:data:`~reference_impl.kernels.v4_dispatch.V4_KERNEL_OPS`,
    which takes the torch references off CUDA)."""
    return V4_KERNEL_OPS
