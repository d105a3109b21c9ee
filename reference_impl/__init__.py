"""Reference implementation of context-parallel prefill with shared KV for DSA models.

The package is the architecture, bottom to top (an import never runs upward; ``tests/test_layers.py``):

0. ``config``, ``presets``, ``phases``, ``errors`` -- the knobs, the models, the phase set;
   ``fp8`` -- FP8 quantization and the Hadamard rotation; ``sync_audit`` -- host-sync counting;
   ``index_share`` -- which layers run the indexer (GLM-5.2's IndexShare);
   ``machine`` -- the machine's free memory, cores and file limit (what refusals are decided from);
   ``families`` -- the model-family interface and the registry of every preset's family;
1. ``kvcache/`` -- byte layouts, paged pools, page allocator;
2. ``model/`` -- the DSA layer (MLA + lightning indexer), the single-device oracle, checkpoints;
3. ``kernels/`` -- Triton / Gluon kernels, one dispatch, one fallback rule;
4. ``cp/`` -- split, collectives, KV stores, materialization, fused ops, prefetch, remap;
5. ``pd/`` -- prefill -> decode transfer of the KV cache;
6. the engine -- ``engine`` (one rank's prefill), ``runner`` (launch, oracle, report), ``launch``,
   ``schedule`` (chunked prefill), ``workload``, ``check``, ``report``, ``footprint``,
   ``prefill_decode``;
7. the face -- ``api`` (this package's exports), ``cli``, ``demo`` (the main job), ``tables``,
   ``figures`` (plots that carry the data they draw), ``bench/``, ``planner/``.

A model family is one folder under ``families/`` behind one interface (``families/base.py``):
``families/dsa/`` (DeepSeek-V3.2, GLM-5, GLM-5.2: its interface over the DSA layer of ``model/`` and
the stores of ``cp/``) and ``families/deepseek_v4/`` (DeepSeek-V4, whole: config, cache layout,
model, kernels, CP store and step, check, footprint). Each part of a family sits in the layer of its
kind. The engine, runner, report, footprint, config, API and CLI never ask which family they run.

Where each phase lives (one module each; the phase set asks for them by name,
``run.phases.sharded_kv``):

| phase | what | module |
| --- | --- | --- |
| 0 | split, all-gather #1, replicated cache, tail gather | `cp/split.py`, `cp/kv_replicated.py`, `cp/tail.py` |
| 1 | narrow output collection | `cp/narrow_output.py` |
| 2 | KV sharded at rest, materialization, PD transfer | `cp/kv_sharded.py`, `cp/page_gather.py`, `pd/` |
| 3 | current-chunk reuse | `cp/current_reuse.py` |
| 4 | page-aligned split | `cp/page_aligned.py` |
| 5 | compute-owner layout | `cp/compute_owner.py` |
| 6 | sync-free layer loop: store locs once per batch, page-inverse remap | `cp/split_index.py`, `cp/remap.py` |
| 7 | fused Triton kernels | `cp/fused_ops.py`, `kernels/fused_*.py` |
| 8 | one-layer-ahead prefix prefetch | `cp/prefetch.py` |

Beside them: phase 0's split as data is ``cp/split_metadata.py`` and its all-gather #1 with the rerange
``cp/rerange.py``; phase 2's owner of each token is ``cp/ownership.py``; ``sync_audit.py`` counts the host
syncs phase 6 takes out of the layer loop.

Reading order for a newcomer: ``config`` -> ``model/attention.py`` -> ``model/oracle.py`` ->
``cp/split.py`` -> ``engine.py`` -> the phase modules in the table -> ``runner.py``.

The public names below load on first use, so ``import reference_impl.config`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # configuration
    "RunConfig": "reference_impl.config",
    "Request": "reference_impl.config",
    "parse_requests": "reference_impl.config",
    "ConfigError": "reference_impl.errors",
    "PhaseSet": "reference_impl.phases",
    "Phase": "reference_impl.phases",
    "ModelConfig": "reference_impl.presets",
    "PRESETS": "reference_impl.families",
    "get_preset": "reference_impl.families",
    "family_of": "reference_impl.families",
    "register_family": "reference_impl.families",
    # the model and the oracle
    "make_model": "reference_impl.api",
    "make_inputs": "reference_impl.api",
    "oracle": "reference_impl.api",
    "load_hf_weights": "reference_impl.model.checkpoint",
    "DSAModel": "reference_impl.model.oracle",
    "DSAAttention": "reference_impl.model.attention",
    "LayerCache": "reference_impl.model.cache",
    "OracleResult": "reference_impl.model.oracle",
    "KVLayout": "reference_impl.kvcache.layout",
    # the split and a CP prefill
    "build_split": "reference_impl.cp.split",
    "SplitMetadata": "reference_impl.cp.split",
    "run_prefill": "reference_impl.runner",
    "run_prefills": "reference_impl.runner",
    "PrefillResult": "reference_impl.runner",
    # the planner and the main job
    "plan_capacity": "reference_impl.planner",
    "PlannerConfig": "reference_impl.planner",
    "load_rates": "reference_impl.planner",
    "run_demo": "reference_impl.demo",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'reference_impl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if name != "PRESETS":  # every family's presets, read each time (a registered family's included)
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
