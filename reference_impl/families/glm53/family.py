"""GLM-5.3 behind :class:`~reference_impl.families.base.ModelFamily`.

What the engine gets from here: the store (:class:`~.cp.store.Glm53Store`: KDA states replicated,
latent rows and pooled group keys sharded by owner with phase 2), the prefixes (the oracle over each
prefix, each rank keeping its share), the layer step (:class:`~.cp.step.Glm53Step`: the KDA state
hand-off and halo, the pooled indexer) and the comparison (:mod:`.check`).

Built: levels 0-8 (what each phase does here: :mod:`.cp.step`), the in-seq split and the round-robin
split (its KDA layers re-split into contiguous blocks and back: :mod:`.cp.step`; phases 4 and 5 are in-seq
only), chunked prefill, cached prefixes, FP8 latent rows (``kv_dtype="fp8"``, the default: 512 e4m3 codes
and four float32 tile scales, 528 bytes, :mod:`.cache_layout`; scales in ``mla_scale_fmt``) and bf16 rows
(``kv_dtype="bf16"``). Refused by name: the competing KV designs, several batches, IndexShare patterns
from the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from reference_impl.config import ConfigError, RunConfig, compute_dtype, env_flag
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.base import ChunkInputs
from reference_impl.families.glm53 import footprint
from reference_impl.families.glm53.cache_layout import LatentRows, check_fp8_width
from reference_impl.families.glm53.config import GLM53_PRESETS, Glm53Config
from reference_impl.families.glm53.cp.step import PER_LAYER_TAGS, Glm53Step
from reference_impl.families.glm53.cp.store import Glm53Store
from reference_impl.families.glm53.model.oracle import (
    DSACache,
    Glm53Model,
    Glm53OracleResult,
    KDACache,
    build_glm53_model,
    run_glm53_oracle,
)
from reference_impl.families.glm53.pd import Glm53PDPayload, request_bytes
from reference_impl.footprint import PROCESS_BASE, SAFETY
from reference_impl.schedule import Chunk

BUILT_PHASES = frozenset(range(1, 9))  # every phase; what each does here: the step module's docstring


def latent_rows(cfg: Glm53Config, kv_dtype: str) -> LatentRows:
    """How a run stores its latent rows: the store and the oracle encode with the same one."""
    return LatentRows.for_run(cfg.kv_lora_rank, kv_dtype, cfg.mla_scale_fmt)


class Glm53Family:
    """GLM-5.3-Flash and ``tiny-glm53`` (see the module docstring)."""

    name = "glm53"
    title = "GLM-5.3 (KDA linear-attention layers and MLA layers with a pooled-key DSA indexer)"
    config_type = Glm53Config
    presets = GLM53_PRESETS
    per_layer_tags = PER_LAYER_TAGS
    planner_command = "python -m reference_impl.planner.glm53"

    # ---- configuration -------------------------------------------------------------------------
    def model_for_run(self, cfg: Glm53Config, run: RunConfig) -> Glm53Config:
        """The FP8 row's scale format travels with the model (the oracle's cache key and its rows)."""
        return dataclasses.replace(cfg, mla_scale_fmt=run.mla_scale_fmt)

    def check_run(self, run: RunConfig) -> None:
        extra = sorted(run.phases.enabled - BUILT_PHASES)
        if extra:
            raise ConfigError(f"phases {extra}: {run.preset} builds phases 1-8 only; drop them")
        if run.kv_dtype == "fp8":
            check_fp8_width(run.model.kv_lora_rank, f"kv_dtype=fp8: {run.preset}'s kv_lora_rank")
        if run.kv_design != "phases":
            raise ConfigError(f"kv_design={run.kv_design}: {run.preset} runs under the phases only")
        if run.batch_sizes is not None or any(r.shares is not None for r in run.requests):
            raise ConfigError(
                f"{run.preset}: several batches and shared prefixes (rN:P+E) are not wired; run one batch"
            )
        if run.index_topk_pattern is not None:
            raise ConfigError(f"index_topk_pattern: {run.preset}'s IndexShare is set by its indexer_types; drop it")
        if run.cpu_widths:
            raise ConfigError(f"cpu_widths: {run.preset} has no CPU-width variant; use tiny-glm53")
        if env_flag("fp8_projections"):
            raise ConfigError(f"DSACP_FP8_PROJECTIONS=1: {run.preset}'s projections are not quantized; unset it")

    # ---- sizing --------------------------------------------------------------------------------
    def weight_bytes(self, cfg: Glm53Config, dtype_bytes: int) -> tuple[int, int]:
        return footprint.weight_bytes(cfg, dtype_bytes)

    def estimate(
        self, run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
    ) -> Any:
        return footprint.estimate(run, device_type, start_method, cuda_devices, extra_process, b)

    def decode_bytes(self, run: RunConfig) -> int:
        """The decode process: its base, the model, and its arena of every request's cache (:mod:`.pd`)."""
        params, _ = footprint.weight_bytes(run.model, compute_dtype(run, torch.device(run.device)).itemsize)
        arena = sum(request_bytes(run, r.total) for r in run.requests)
        return int(SAFETY * (PROCESS_BASE["spawn"] + params + arena))

    def pd_payload(self, run: RunConfig) -> Glm53PDPayload:
        from reference_impl.families.glm53.check import decode_cache_mismatches

        return Glm53PDPayload(run, decode_cache_mismatches)

    # ---- the model -----------------------------------------------------------------------------
    def build_model(
        self,
        cfg: Glm53Config,
        dtype: torch.dtype,
        seed: int,
        device: torch.device,
        kernels: bool,
        fp8_projections: bool = False,
    ) -> Glm53Model:
        """The KDA recurrence through :data:`~.kernels.dispatch.KDA_KERNEL_OPS` (the torch references off
        CUDA) or the torch references (:data:`~.model.kda.KDA_TORCH_OPS`); the other cores are torch."""
        from reference_impl.families.glm53.kernels.dispatch import KDA_KERNEL_OPS
        from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS

        return build_glm53_model(cfg, dtype, seed, device, KDA_KERNEL_OPS if kernels else KDA_TORCH_OPS)

    def load_weights(self, model: torch.nn.Module, checkpoint: Any, first_layer: int, head: bool) -> None:
        from reference_impl.families.glm53.model.checkpoint import load_glm53_hf_weights

        load_glm53_hf_weights(model, checkpoint, first_layer=first_layer, head=head)

    # ---- one rank's run ------------------------------------------------------------------------
    def make_store(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> Glm53Store:
        return Glm53Store(run, batch, group)

    @torch.no_grad()
    def install_prefixes(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        inputs: list[torch.Tensor],
        store: Glm53Store,
        chunk: Chunk,
        shared_tokens: dict[int, int],
    ) -> None:
        """Each cached prefix as an earlier prefill left it: the oracle over the prefix, each rank keeping
        its share (its latent rows and the groups whose last token it owns; the KDA states and the
        incomplete group's raw rows everywhere)."""
        assert isinstance(model, Glm53Model)
        P = run.model.index_kpool
        for i, req in enumerate(chunk.requests):
            prefix = run.requests[req].prefix
            if not prefix:
                continue
            oracle = run_glm53_oracle(model, [0], [inputs[req][:prefix]], store.rows)
            locs = store.batch.request_locs[i][:prefix]
            for layer, caches in enumerate(oracle.caches):
                cache = caches[0]
                if isinstance(cache, KDACache):
                    store.kda[(layer, int(locs[0]))] = KDACache(cache.state.clone(), cache.conv.clone())
                    continue
                assert isinstance(cache, DSACache)
                store.write_latent(layer, locs, cache.latent)
                if cache.group_keys is not None:
                    assert cache.pending_k is not None and cache.pending_gate is not None
                    ends = locs[P - 1 :: P][: len(cache.group_keys)]
                    mine = store.mine(ends)
                    store.write_group_keys(layer, ends[mine], cache.group_keys[mine])
                    store.set_pending(layer, locs, cache.pending_k.clone(), cache.pending_gate.clone())

    def chunk_step(self, inputs: ChunkInputs) -> Glm53Step:
        return Glm53Step(inputs)

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
    ) -> Glm53OracleResult:
        assert isinstance(model, Glm53Model)
        return run_glm53_oracle(model, list(prefixes), inputs, latent_rows(model.cfg, kv_dtype), chunk_size)

    def compare(
        self,
        run: RunConfig,
        meta: SplitMetadata,
        model: torch.nn.Module,
        oracle: Any,
        results: list[Any],
        compute_dtype: torch.dtype,
    ) -> Any:
        from reference_impl.families.glm53.check import compare_glm53

        return compare_glm53(run, meta, model, oracle, results, compute_dtype)

    # ---- the rest of the run -------------------------------------------------------------------
    def report_fields(self, run: RunConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """``attention_kernel``: the path the KDA recurrence takes (a run builds its model with the kernel
        table, :data:`~.kernels.dispatch.KDA_KERNEL_OPS`): ``glm53-kda-triton`` on CUDA, ``glm53-kda-torch``
        off it or under ``DSACP_FORCE_TORCH=1``. The indexed layers' attention is the torch reference."""
        from reference_impl.families.glm53.kernels.dispatch import kda_kernel_name

        return {
            "attention_kernel": "glm53-kda-" + kda_kernel_name(device),
            "index_topk_pattern": None,
            "selects": run.model.count("indexed_attention") > 0,
        }

    def check_pd(self, run: RunConfig) -> None:
        """The rows transfer ships every part of a GLM-5.3 cache (:mod:`.pd`); the page transfer mirrors the
        DSA pool's pages, which a GLM-5.3 store does not have (``run_prefill_and_decode`` asks before)."""
        self.check_run(run)


FAMILY = Glm53Family()
