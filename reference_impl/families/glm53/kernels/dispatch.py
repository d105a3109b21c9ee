"""GLM-5.3's KDA cores with the kernels plugged in (:data:`KDA_KERNEL_OPS`), one fallback rule.

* ``chunked``: :func:`~reference_impl.families.glm53.kernels.kda_triton.kda_chunked_triton` where
  :func:`~reference_impl.kernels.fallback.use_kernels` says so (CUDA, Triton, not forced to torch), the
  torch reference (:func:`~reference_impl.families.glm53.model.kda.kda_chunked`) otherwise or when the
  kernel raises (one warning per process);
* ``span_map``: :func:`~reference_impl.families.glm53.kernels.kda_triton.span_map_triton` by the same
  rule, the torch :func:`~reference_impl.families.glm53.model.kda.span_map` otherwise.

Inputs are checked by name (:func:`~reference_impl.families.glm53.model.kda.check_kda_inputs`) before
a path is picked, so bad shapes are refused alike on both paths rather than sent to the fallback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from reference_impl.families.glm53.model import kda as reference
from reference_impl.families.glm53.model.kda import KDAOps, check_kda_inputs
from reference_impl.kernels import fallback

Pair = tuple[torch.Tensor, torch.Tensor]


def _kernel(name: str) -> Callable[..., Pair]:
    """``<name>`` of :mod:`.kda_triton`, looked up when called: Triton is imported only where kernels
    run, and a test may stand a function in for it."""
    return getattr(importlib.import_module(f"{__package__}.kda_triton"), name)


def _dispatch(
    what: str, device: torch.device, force_torch: bool, kernel: Callable[[], Pair], torch_path: Callable[[], Pair]
) -> Pair:
    if not fallback.use_kernels(device, force_torch=force_torch):
        return torch_path()
    return fallback.run_with_fallback(what, kernel, torch_path)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    force_torch: bool = False,
) -> Pair:
    """:func:`~reference_impl.families.glm53.model.kda.kda_chunked`, by the Triton kernel where it runs."""
    check_kda_inputs(q, k, v, g, beta, state)
    args = (q, k, v, g, beta, state)
    return _dispatch(
        "Triton GLM-5.3 KDA",
        q.device,
        force_torch,
        lambda: _kernel("kda_chunked_triton")(*args),
        lambda: reference.kda_chunked(*args),
    )


def span_map(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, force_torch: bool = False
) -> Pair:
    """:func:`~reference_impl.families.glm53.model.kda.span_map`, by the Triton kernel where it runs."""
    if k.dim() == 3 and v.dim() == 3:  # else check_kda_inputs names the argument with the wrong rank
        state = k.new_zeros((k.shape[1], k.shape[2], v.shape[2]), dtype=torch.float32)
    else:
        state = k.new_zeros((0, 0, 0), dtype=torch.float32)
    check_kda_inputs(k, k, v, g, beta, state)
    args = (k, v, g, beta)
    return _dispatch(
        "Triton GLM-5.3 KDA span map",
        k.device,
        force_torch,
        lambda: _kernel("span_map_triton")(*args),
        lambda: reference.span_map(*args),
    )


def kda_kernel_name(device: torch.device | str, *, force_torch: bool = False) -> str:
    """What :func:`kda_chunked` and :func:`span_map` run for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


KDA_KERNEL_OPS = KDAOps("kernels", kda_chunked, span_map)
