"""The workload of one run: device, compute dtype, model weights and layer-0 inputs.

Everything is derived from the :class:`~reference_impl.config.RunConfig` and its seed, so every
rank (and the oracle) builds the same model and inputs without exchanging them.
"""

from __future__ import annotations

import torch

from reference_impl.config import RunConfig, compute_dtype, env_flag
from reference_impl.families import family_of


def resolve_device(run: RunConfig) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(run.device)


@torch.no_grad()
def build_model(run: RunConfig, device: torch.device) -> torch.nn.Module:
    """The run's model with deterministic weights from ``run.seed``, built by its family
    (:meth:`~reference_impl.families.base.ModelFamily.build_model`), its compute cores through the
    family's kernel dispatch (the torch references off CUDA).

    With ``DSACP_FP8_PROJECTIONS=1`` the attention's projections become FP8 with 128-block scales, as
    DeepSeek runs its checkpoints (families without them refuse the variable); every rank and the
    oracle build the same model, so they still agree. Off by default: bf16 is the reference."""
    cfg = run.model
    return family_of(cfg).build_model(
        cfg, compute_dtype(run, device), run.seed, device, kernels=True, fp8_projections=env_flag("fp8_projections")
    )


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
