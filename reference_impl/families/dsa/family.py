"""The DSA family behind :class:`~reference_impl.families.base.ModelFamily`: DeepSeek-V3.2, GLM-5, GLM-5.2.

What the engine gets from here, and where the phases plug in:

* the **store** (:meth:`DSAFamily.make_store`): a replica per rank (the baseline), sharded at the
  run's interleave (phase 2; phase 3 reuses the current chunk, phase 5 writes directly, phase 7
  fuses the copies), or a competing KV design (:mod:`reference_impl.cp.designs`);
* the **prefixes** (:meth:`DSAFamily.install_prefixes`): the single-device model over each cached
  prefix, chunk by chunk, its rows handed to the store as a layer makes them;
* the **layer step** (:class:`~reference_impl.families.dsa.layer_step.DSALayerStep`): project,
  all-gather the current chunk, store, view, select and attend (phase 6 bounds the indexer from
  host metadata, phase 8 prefetches the next layer's prefix pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.designs import audits_layer_loop, make_design_store
from reference_impl.cp.kv_replicated import ReplicatedKV
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.kv_store import KVStore
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.prefetch import MlaPrefetcher
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.base import ChunkInputs
from reference_impl.families.dsa import footprint
from reference_impl.families.dsa.layer_step import DSALayerStep
from reference_impl.kernels.dispatch import KERNEL_OPS
from reference_impl.kvcache.layout import KVLayout
from reference_impl.model.checkpoint import load_hf_weights
from reference_impl.model.oracle import DSAModel, OracleResult, init_weights, run_oracle
from reference_impl.model.prefix_prefill import prefill_prefix
from reference_impl.model.sparse_attention import TORCH_OPS, HostKeyBounds
from reference_impl.presets import PRESETS, ModelConfig, ScaleFmt, at_cpu_widths
from reference_impl.schedule import Chunk


def _host_key_bounds(meta: SplitMetadata, batch: BatchLocs, rank: int) -> HostKeyBounds:
    """Host copies of the local queries' key ranges ``(key_start, key_end)``, from metadata alone
    (phase 6: the indexer bounds each chunk of rows without reading the device)."""
    starts = [batch.view_offsets[meta.token_request[g]] for g in meta.local_tokens(rank)]
    ends = [batch.view_offsets[meta.token_request[g]] + meta.token_position[g] + 1 for g in meta.local_tokens(rank)]
    return starts, ends


class DSAFamily:
    """DeepSeek-V3.2, GLM-5 and GLM-5.2: MLA with the lightning indexer (see the module docstring)."""

    name = "dsa"
    title = "DeepSeek-V3.2, GLM-5, GLM-5.2 (MLA with the lightning indexer; IndexShare)"
    config_type = ModelConfig
    presets = PRESETS
    per_layer_tags = ("kv", "index_k", "materialize", "prefetch_mla", "materialize_index")
    planner_command = "python -m reference_impl plan"

    def __init__(self, prefetcher: Callable[[Any, int], MlaPrefetcher] = MlaPrefetcher) -> None:
        """``prefetcher(store, n_layers)``: phase 8's one-layer-ahead prefetcher (a walkthrough or a test passes
        one on another stream, e.g. one that never waits, to show what the wait is for)."""
        self.prefetcher = prefetcher

    # ---- configuration -------------------------------------------------------------------------
    def model_for_run(self, cfg: ModelConfig, run: RunConfig) -> ModelConfig:
        """The run's MLA scale format and indexer pattern (and, with ``cpu_widths``, tiny's widths)."""
        cfg = at_cpu_widths(cfg) if run.cpu_widths else cfg
        return dataclasses.replace(
            cfg,
            mla_scale_fmt=cast(ScaleFmt, run.mla_scale_fmt),  # RunConfig validated it
            index_topk_pattern=run.index_topk_pattern or cfg.index_topk_pattern,
        )

    def check_run(self, run: RunConfig) -> None:
        """A competing KV design keeps indexer K on every layer: it cannot run an IndexShare pattern."""
        if run.kv_design != "phases" and run.model.index_share.shares:
            raise ConfigError(
                f"kv_design={run.kv_design}: its stores keep indexer K on every layer; {run.preset}'s IndexShare "
                f"pattern {run.model.index_share.pattern} runs under the phases only (kv_design=phases)"
            )

    # ---- sizing --------------------------------------------------------------------------------
    def weight_bytes(self, cfg: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
        return footprint.weight_bytes(cfg, dtype_bytes)

    def estimate(
        self, run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
    ) -> Any:
        return footprint.estimate(run, device_type, start_method, cuda_devices, extra_process, b)

    # ---- the model -----------------------------------------------------------------------------
    def build_model(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        seed: int,
        device: torch.device,
        kernels: bool,
        fp8_projections: bool = False,
    ) -> DSAModel:
        """``fp8_projections``: the attention's projections in FP8 with 128-block scales
        (:func:`~reference_impl.model.fp8_linear.quantize_projections`, the GEMM of
        :mod:`reference_impl.kernels.fp8_gemm`), as DeepSeek runs its checkpoints."""
        with torch.device(device):
            model = DSAModel(cfg, dtype, ops=KERNEL_OPS if kernels else TORCH_OPS)
        model = init_weights(model, seed).eval()
        if fp8_projections:
            from reference_impl.kernels.fp8_gemm import block_fp8_gemm
            from reference_impl.model.fp8_linear import quantize_projections

            quantize_projections(model, cfg.index_scale_fmt, block_fp8_gemm)
        return model

    def load_weights(self, model: torch.nn.Module, checkpoint: Any, first_layer: int, head: bool) -> None:
        load_hf_weights(model, checkpoint, first_layer=first_layer, head=head)

    # ---- one rank's run ------------------------------------------------------------------------
    def make_store(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> KVStore:
        """A replica per rank (baseline) or sharded at the run's interleave (phases 2, 3, 5), or the store
        of a competing KV design (:mod:`reference_impl.cp.designs`)."""
        layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
        if run.kv_design != "phases":
            return make_design_store(run, batch, layout, group)
        if run.phases.sharded_kv:
            # Round-robin computes token t on rank t % C: at interleave 1 that is its owner, with no lanes.
            direct = run.phases.compute_owner or run.split_mode == "round-robin"
            return ShardedKV(
                batch,
                layout,
                run.model.n_layers,
                group,
                group.debug,
                reuse_current=run.phases.current_reuse,
                direct_write=direct,
                fused=run.phases.fused_kernels,
                ownership=Ownership(run.cp_size, run.interleave, run.page_size),
            )
        return ReplicatedKV(
            batch, layout, run.model.n_layers, group.device, group.debug, fused=run.phases.fused_kernels
        )

    @torch.no_grad()
    def install_prefixes(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        inputs: list[torch.Tensor],
        store: KVStore,
        chunk: Chunk,
        shared_tokens: dict[int, int],
    ) -> None:
        """Each rank runs the single-device model over the prefix tokens, chunk by chunk
        (:func:`~reference_impl.model.prefix_prefill.prefill_prefix`; deterministic, so every rank gets
        identical bytes, those of the oracle), and hands the store each chunk's rows as a layer makes
        them: memory is the prefix's KV plus one chunk, not the whole prefix's activations. Only the
        tokens past ``shared_tokens[req]`` (a shared prefix's whole pages, there by reference) are written."""
        layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
        for i, req in enumerate(chunk.requests):
            shared, prefix = shared_tokens.get(req, 0), run.requests[req].prefix
            if prefix <= shared:
                continue

            def write(layer: int, start: int, stop: int, cache: Any, i: int = i, shared: int = shared) -> None:
                lo = max(start, shared)
                if lo < stop:
                    store.write_prefix(
                        layer, i, cache.mla_rows[lo:stop], cache.index_fp8[lo:stop], cache.index_scale[lo:stop], lo
                    )

            prefill_prefix(cast(DSAModel, model), inputs[req][:prefix], layout, write)  # build_model's

    def chunk_step(self, inputs: ChunkInputs) -> DSALayerStep:
        host_bounds = (
            _host_key_bounds(inputs.meta, inputs.batch, inputs.group.rank) if audits_layer_loop(inputs.run) else None
        )
        return DSALayerStep(inputs, host_bounds, self.prefetcher)

    # ---- the check -----------------------------------------------------------------------------
    def oracle(
        self,
        model: torch.nn.Module,
        prefixes: Sequence[int],
        inputs: list[torch.Tensor],
        kv_dtype: str,
        page_size: int,
        chunk_size: int | None,
        view_dtype: torch.dtype,
    ) -> OracleResult:
        assert isinstance(model, DSAModel)
        return run_oracle(model, list(prefixes), inputs, kv_dtype, page_size, chunk_size, view_dtype)  # type: ignore[arg-type]

    def compare(
        self,
        run: RunConfig,
        meta: SplitMetadata,
        model: torch.nn.Module,
        oracle: Any,
        results: list[Any],
        compute_dtype: torch.dtype,
    ) -> Any:
        from reference_impl.check import compare

        assert isinstance(model, DSAModel)
        return compare(run, meta, model, oracle, results, compute_dtype)

    # ---- the rest of the run -------------------------------------------------------------------
    def report_fields(self, run: RunConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """The sparse MLA path the dispatch takes for this run's inputs, and the IndexShare pattern."""
        from reference_impl.kernels.dispatch import sparse_mla_kernel

        d_v, d_qk = run.model.kv_lora_rank, run.model.kv_lora_rank + run.model.qk_rope_head_dim
        probe = torch.empty(0, 1, d_qk, device=device, dtype=dtype)  # allocates nothing
        return {
            "attention_kernel": sparse_mla_kernel(probe, probe[:, 0], d_v),
            "index_topk_pattern": run.model.index_share.pattern,
            "selects": True,
        }

    def check_pd(self, run: RunConfig) -> None:
        """Every DSA run ships: MLA rows and index keys (full layers only with IndexShare)."""

    def decode_bytes(self, run: RunConfig) -> int:
        return footprint.decode_bytes(run)

    def pd_payload(self, run: RunConfig) -> None:
        return None  # the MLA rows and index K that reference_impl.pd ships


FAMILY = DSAFamily()
