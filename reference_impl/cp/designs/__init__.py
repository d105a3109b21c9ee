"""The engines' competing KV designs for DSA prefill CP, as KV stores of this engine.

``RunConfig.kv_design`` (``--kv-design``, ``DSACP_KV_DESIGN``) picks how a rank keeps and gathers
the KV cache. ``"phases"`` is this package's phase set (:mod:`reference_impl.cp.kv_sharded` and the
phases on top); the others are the designs the engines merged or have in review, each with its own
store, gather and materialization, behind the same :class:`~reference_impl.cp.kv_store.KVStore`
interface, so the layer loop, the oracle check and the report do not change:

| design | what a rank keeps | per-layer movement |
| --- | --- | --- |
| ``layer-split`` | every token of its block of layers | owner broadcasts the layer's history pages, a layer ahead |
| ``rotated-shard`` | its pages (owners cyclic) | one regular owner-major all-gather of history pages, a layer ahead |
| ``dcp-gather`` | its token-interleaved DCP shard | one padded all-gather of every shard (prefix and current) |

Each design lives in the module of its name (:mod:`.layer_split`, :mod:`.rotated_shard`, :mod:`.dcp_gather`);
``rotated-shard`` cycles the owners with a rotated page allocator, and ``dcp-gather`` gathers into a
rank-major workspace.

A design replaces the KV path of phases 2, 3, 5, 6 and 8; phases 1, 4 and 7 run beside it
(:data:`reference_impl.config.DESIGN_PHASES`). Each design plans once per batch (in ``bind``),
so the layer loop runs without host syncs; the engine audits it as it audits phase 6.
The fourth design the engines ship, a shared CUDA VMM view of every rank's pages, cannot run
across ranks on one GPU: the planner models it (:mod:`reference_impl.planner.designs`).
"""

from __future__ import annotations

from reference_impl.config import RunConfig
from reference_impl.cp.batch import BatchLocs, PageLanes
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.designs.dcp_gather import DcpGatherKV
from reference_impl.cp.designs.layer_split import LayerSplitKV, layer_owner, layer_shard_range
from reference_impl.cp.designs.rotated_shard import RotatedShardKV, owners_cyclic, rotated_page_lanes
from reference_impl.cp.kv_store import KVStore
from reference_impl.kvcache.layout import KVLayout

__all__ = [
    "DcpGatherKV",
    "LayerSplitKV",
    "RotatedShardKV",
    "audits_layer_loop",
    "design_page_lanes",
    "layer_owner",
    "layer_shard_range",
    "make_design_store",
    "owners_cyclic",
    "rotated_page_lanes",
]


def make_design_store(run: RunConfig, batch: BatchLocs, layout: KVLayout, group: CPGroup) -> KVStore:
    """The KV store of ``run.kv_design`` (not ``"phases"``: :func:`reference_impl.engine.make_kv_store`
    builds those)."""
    n_layers, fused = run.model.n_layers, run.phases.fused_kernels
    if run.kv_design == "layer-split":
        return LayerSplitKV(batch, layout, n_layers, group, group.debug, fused)
    if run.kv_design == "rotated-shard":
        return RotatedShardKV(batch, layout, n_layers, group, group.debug, fused)
    if run.kv_design == "dcp-gather":
        return DcpGatherKV(batch, layout, n_layers, group, group.debug, fused, interleave=run.interleave)
    raise ValueError(f"kv_design={run.kv_design!r} has no design store")


def design_page_lanes(run: RunConfig) -> PageLanes | None:
    """The allocator a design requires, as lanes: the rotated allocation of ``rotated-shard``; ``None``
    (lowest free ids, or phase 5's lanes) for the others."""
    return rotated_page_lanes if run.kv_design == "rotated-shard" else None


def audits_layer_loop(run: RunConfig) -> bool:
    """Whether the layer loop runs host-sync-free and audited: phase 6, or any competing design."""
    return run.phases.sort_free_remap or run.kv_design != "phases"
