"""The GPU tier's shared runs: every phase level on CUDA at DeepSeek-V3.2 dimensions, launched once.

Two ranks share the one GPU over gloo (NCCL refuses two ranks on one device), so the collectives
stage through the host; the runs check agreement with the oracle and the host-sync audit, not
speed. :func:`engine_reports` runs every configuration in one launch (the ranks start and compile
their kernels once) and returns the reports by name.

The runs compute in bf16, the production dtype. On a GPU the CP run and the oracle batch rows into
GEMMs differently, so they are compared with the rounding-tolerant rule of
:mod:`reference_impl.check` (calibrated on an H200: ``docs/results/check_calibration.json``).
"""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet, Request, RunConfig


@pytest.fixture(scope="module", autouse=True)
def _release_cached_cuda_memory():
    """After each module, hand the caching allocator's free blocks back to the GPU: another pytest-xdist
    worker's ranks size themselves against the GPU's free memory."""
    yield
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# Two requests at DeepSeek-V3.2 dims, two layers. "prefix": prefixes that end mid-page (a partial
# page whose owner is fixed), uneven extends; "current-only": no history at all.
PREFIX = (Request(1000, 2100), Request(64, 900))
CURRENT_ONLY = (Request(0, 2048), Request(0, 1500))
V32 = RunConfig(preset="deepseek-v3.2", n_layers=2, cp_size=2, requests=PREFIX, page_size=64, device="cuda")


def engine_configs() -> dict[str, RunConfig]:
    configs = {f"level{k}": V32.replace(phases=PhaseSet.level(k)) for k in range(9)}
    for k in (0, 5, 8):
        configs[f"current-only-level{k}"] = V32.replace(phases=PhaseSet.level(k), requests=CURRENT_ONLY)
    for k in (3, 8):
        configs[f"chunked-level{k}"] = V32.replace(phases=PhaseSet.level(k), chunk_size=1024)
    for k in (6, 7, 8):
        configs[f"debug-level{k}"] = V32.replace(phases=PhaseSet.level(k), debug=True)
    # Round-robin with KV sharded at interleave 1 (docs/round-robin-shared-kv.md): its level 8
    # drops the in-seq phases 4 and 5; one chunked.
    round_robin8 = V32.replace(split_mode="round-robin", phases=PhaseSet.parse("+1,2,3,6,7,8"))
    configs["round-robin-level3"] = round_robin8.replace(phases=PhaseSet.level(3))
    configs["round-robin-level8"] = round_robin8
    configs["chunked-round-robin-level8"] = round_robin8.replace(chunk_size=1024)
    return configs


@pytest.fixture(scope="session")
def engine_reports() -> dict[str, dict]:
    from reference_impl.runner import run_prefills

    configs = engine_configs()
    return dict(zip(configs, run_prefills(list(configs.values()), timeout_s=900)))
