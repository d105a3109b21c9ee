"""GLM-5.3's memory model: each process's weights, their initialization and the inputs, four times over
for its activations (as DeepSeek-V4's: a coarse bound, not checked against measured peaks); its caches
(a latent row per token on indexed layers, a state per request on KDA layers) are small beside them
at the sizes this reference runs."""

from __future__ import annotations

import torch

from reference_impl.config import RunConfig
from reference_impl.families.glm53.cache_layout import fp8_row_bytes
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.footprint import CUDA_CONTEXT, PROCESS_BASE, SAFETY, Footprint


def _params(cfg: Glm53Config) -> tuple[int, int]:
    """``(parameters, the largest one)``, counted on the meta device (no memory)."""
    from reference_impl.families.glm53.model.oracle import Glm53Model

    with torch.device("meta"):
        sizes = [p.numel() for p in Glm53Model(cfg).parameters()]
    return sum(sizes), max(sizes)


def weight_bytes(cfg: Glm53Config, dtype_bytes: int) -> tuple[int, int]:
    count, biggest = _params(cfg)
    return count * dtype_bytes, biggest * (4 + (dtype_bytes if dtype_bytes != 4 else 0))


def latent_row_bytes(cfg: Glm53Config, kv_dtype: str) -> int:
    """One stored latent row per token and indexed layer: the FP8 row (528 bytes at ``kv_lora_rank`` 512)
    with ``kv_dtype="fp8"``, else bf16 values (1,024 bytes)."""
    return fp8_row_bytes(cfg.kv_lora_rank) if kv_dtype == "fp8" else cfg.kv_lora_rank * 2


def estimate(
    run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
) -> Footprint:
    cfg, c = run.model, run.cp_size
    weights, draw = weight_bytes(cfg, b)
    tokens = sum(r.total for r in run.requests)
    inputs = tokens * cfg.dim * b
    row = latent_row_bytes(cfg, run.kv_dtype) + cfg.index_head_dim * 4  # a latent row and a float32 index key
    caches = tokens * cfg.count("indexed_attention") * row
    caches += len(run.requests) * cfg.count("linear_attention") * cfg.kda_state_bytes
    base = CUDA_CONTEXT if device_type == "cuda" else PROCESS_BASE[start_method if c > 1 else "inline"]
    rank = int(SAFETY * (base + weights + caches + max(draw, 4 * inputs)))
    parent = int(SAFETY * (PROCESS_BASE["parent"] + (weights + caches + max(draw, 4 * inputs) if run.check else 0)))
    terms = {"rank 0 weights": weights, "rank 0 weight init": draw, "rank 0 inputs": inputs, "rank 0 caches": caches}
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
