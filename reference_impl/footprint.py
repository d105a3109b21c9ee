"""Before any rank starts: does the run fit the machine at all?

:func:`lower_bound_bytes` adds up what a run allocates for certain, per device: every process's
model weights, its copy of the layer-0 inputs (every rank builds all of them from the seed), its
KV pools (a replica per rank, or its owned pages with phase 2), and the parent's oracle (the same
model, inputs and a dense cache). Activations, full views and gather buffers come on top, so a run
this refuses could never have run; a run it lets through may still be tight. :func:`check_fits`
compares the bound with the free memory of the device (CUDA: ``torch.cuda.mem_get_info``; CPU:
the host's available pages) and refuses with the numbers, instead of letting a rank die of an
allocation after minutes.
"""

from __future__ import annotations

import os

import torch

from reference_impl.config import ConfigError, RunConfig
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.layout import KVLayout
from reference_impl.presets_v4 import is_v4

GIB = 1 << 30


def _param_count(run: RunConfig) -> int:
    cfg = run.model
    if is_v4(cfg):  # counted on the meta device: no memory
        from reference_impl.model.v4.oracle import V4Model

        with torch.device("meta"):
            return sum(p.numel() for p in V4Model(cfg).parameters())  # type: ignore[arg-type]
    h, qk, c, r = cfg.n_heads, cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    per_layer = (
        cfg.dim * cfg.q_lora_rank + cfg.q_lora_rank * h * qk  # wq_a, wq_b
        + cfg.dim * (c + r) + c * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # wkv_a, wkv_b
        + h * cfg.v_head_dim * cfg.dim  # wo
    )
    indexer = (  # IndexShare: full layers only
        cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + cfg.dim * cfg.index_head_dim + cfg.dim * cfg.index_n_heads
    )
    return cfg.n_layers * per_layer + cfg.index_share.n_full * indexer + cfg.vocab_size * cfg.dim


def lower_bound_bytes(run: RunConfig, device_type: str) -> int:
    """Bytes the run certainly allocates on one device of type ``device_type`` (see the module docstring)."""
    dtype_bytes = 2 if (run.compute_dtype == "bf16" or (run.compute_dtype == "auto" and device_type == "cuda")) else 4
    cfg = run.model
    tokens = sum(r.total for r in run.requests)
    if is_v4(cfg):  # weights and inputs per process, the oracle's copy; caches are small beside them
        per_process = _param_count(run) * dtype_bytes + tokens * cfg.dim * dtype_bytes
        ranks = run.cp_size if device_type == "cpu" else max(1, run.cp_size // max(1, torch.cuda.device_count()))
        return ranks * per_process + (per_process if run.check else 0)
    layout = KVLayout.from_config(cfg, run.kv_dtype, run.page_size)
    pages = sum(-(-r.total // run.page_size) for r in run.requests)
    page_bytes = cfg.n_layers * layout.mla_page_bytes + cfg.index_share.n_full * layout.index_page_bytes
    per_process = _param_count(run) * dtype_bytes + tokens * cfg.dim * dtype_bytes
    ranks = run.cp_size if device_type == "cpu" else max(1, run.cp_size // max(1, torch.cuda.device_count()))
    if run.phases.sharded_kv:
        ownership = Ownership(run.cp_size, run.interleave, run.page_size)
        pools = sum(ownership.pages_held(pages, rank) for rank in range(ranks)) * page_bytes
    else:
        pools = ranks * pages * page_bytes
    oracle = (per_process + pages * page_bytes) if run.check else 0
    return ranks * per_process + pools + oracle


def free_bytes(device_type: str) -> int | None:
    """Free memory of one device of this type, or ``None`` where it cannot be read."""
    if device_type == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(run: RunConfig, device_type: str) -> None:
    """Raise :class:`~reference_impl.config.ConfigError` when the run cannot fit the device."""
    need, free = lower_bound_bytes(run, device_type), free_bytes(device_type)
    if free is not None and need > free:
        tokens = sum(r.total for r in run.requests)
        raise ConfigError(
            f"a run of {tokens:,} tokens ({run.preset}, {run.model.n_layers} layers, C={run.cp_size}) needs at least "
            f"{need / GIB:,.1f} GiB on {device_type}, which has {free / GIB:,.1f} GiB free: use fewer tokens or layers"
        )
