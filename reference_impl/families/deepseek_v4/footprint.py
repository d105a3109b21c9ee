"""DeepSeek-V4's memory model: each process's weights, their initialization and the inputs, four times
over for its activations; its compressed caches are small beside them. A coarser model than the DSA
family's (:mod:`reference_impl.families.dsa.footprint`), not checked against measured peaks."""

from __future__ import annotations

import torch

from reference_impl.config import RunConfig
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.footprint import CUDA_CONTEXT, PROCESS_BASE, SAFETY, Footprint


def _v4_params(cfg: V4ModelConfig) -> tuple[int, int]:
    """DeepSeek-V4's ``(parameters, the largest one)``, counted on the meta device (no memory)."""
    from reference_impl.families.deepseek_v4.model.oracle import V4Model

    with torch.device("meta"):
        sizes = [p.numel() for p in V4Model(cfg).parameters()]  # type: ignore[arg-type]
    return sum(sizes), max(sizes)


def weight_bytes(cfg: V4ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """``(the parameters in the compute dtype, the transient of their initialization)``."""
    count, biggest = _v4_params(cfg)
    return count * dtype_bytes, biggest * (4 + (dtype_bytes if dtype_bytes != 4 else 0))


def estimate(
    run: RunConfig,
    device_type: str,
    start_method: str,
    cuda_devices: int,
    extra_process: int,
    b: int,
) -> Footprint:
    """DeepSeek-V4 (compressed caches, :mod:`reference_impl.families.deepseek_v4.model`): each process's weights, their
    initialization and the inputs, four times over for its activations; its caches are small beside
    them. A coarser model than the DSA one above, not checked against measured peaks."""
    cfg, c = run.model, run.cp_size
    weights, draw = weight_bytes(cfg, b)
    tokens = sum(r.total for r in run.requests)
    inputs = tokens * cfg.dim * b
    base = CUDA_CONTEXT if device_type == "cuda" else PROCESS_BASE[start_method if c > 1 else "inline"]
    rank = int(SAFETY * (base + weights + max(draw, 4 * inputs)))
    parent = int(SAFETY * (PROCESS_BASE["parent"] + (weights + max(draw, 4 * inputs) if run.check else 0)))
    terms = {"rank 0 weights": weights, "rank 0 weight init": draw, "rank 0 inputs": inputs}
    host = (c + 1) * PROCESS_BASE["spawn"] + extra_process if device_type == "cuda" else c * rank + parent
    ranks_per_device = -(-c // max(1, cuda_devices)) if device_type == "cuda" else c
    return Footprint(
        (rank,) * c,
        int(SAFETY * PROCESS_BASE["parent"]) + extra_process,
        parent,
        host,
        device_type,
        ranks_per_device,
        terms,
    )
