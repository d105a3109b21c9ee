"""GLM-5.3 behind :class:`~reference_impl.families.base.ModelFamily`.

What the engine gets from here: the store (:class:`~.cp.store.Glm53Store`: KDA states replicated,
latent rows and pooled group keys sharded by owner with phase 2), the prefixes (the oracle over each
prefix, each rank keeping its share), the layer step (:class:`~.cp.step.Glm53Step`: the KDA state
hand-off and halo, the pooled indexer) and the comparison (:mod:`.check`).

Built: levels 0-8 (what each phase does here: :mod:`.cp.step`), the in-seq split and the round-robin split
(its KDA layers re-split into contiguous blocks and back: :mod:`.cp.step`; phases 4 and 5 are in-seq only),
chunked prefill, cached prefixes, several batches on one pool with prefix hits ``rN:P+E`` and eviction under
``pool_pages`` (:meth:`Glm53Family.install_prefixes`), FP8 latent rows (``kv_dtype="fp8"``, the default: 512
e4m3 codes and four float32 tile scales, 528 bytes, :mod:`.cache_layout`; scales in ``mla_scale_fmt``) and
bf16 rows (``kv_dtype="bf16"``), the prefill -> decode transfer over torch and Mooncake (:mod:`.pd`), and the
KDA recurrence and the pooled indexer through Triton kernels where kernels run (:mod:`.kernels.dispatch`).
Refused by name: the competing KV designs, a hit inside another hit, IndexShare patterns from the command
line.
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
from reference_impl.families.glm53.cp.store import Glm53Store, hit_points
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
        if run.kv_dtype == "fp8":
            check_fp8_width(run.model.kv_lora_rank, f"kv_dtype=fp8: {run.preset}'s kv_lora_rank")
        if run.kv_design != "phases":
            raise ConfigError(f"kv_design={run.kv_design}: {run.preset} runs under the phases only")
        for i, r in enumerate(run.requests):
            source = run.requests[r.shares] if r.shares is not None else None
            if source is not None and source.shares is not None and r.prefix <= source.prefix:
                raise ConfigError(  # the source took that state from its own source and kept none there
                    f"requests: r{i} = r{r.shares}:{r.prefix}+{r.extend} hits inside r{r.shares}'s own hit of "
                    f"r{source.shares} ({source.prefix} tokens); on {run.preset} write it as "
                    f"r{source.shares}:{r.prefix}+{r.extend}"
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
        """The KDA recurrence and the indexer's scoring and selection through the kernel tables
        (:data:`~.kernels.dispatch.KDA_KERNEL_OPS`, :data:`~.kernels.dispatch.INDEXER_KERNEL_OPS`: the torch
        references off CUDA) or the torch references (:data:`~.model.kda.KDA_TORCH_OPS`,
        :data:`~.model.dsa.INDEXER_TORCH_OPS`); the other cores are torch."""
        from reference_impl.families.glm53.kernels.dispatch import INDEXER_KERNEL_OPS, KDA_KERNEL_OPS
        from reference_impl.families.glm53.model.dsa import INDEXER_TORCH_OPS
        from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS

        if kernels:
            return build_glm53_model(cfg, dtype, seed, device, KDA_KERNEL_OPS, INDEXER_KERNEL_OPS)
        return build_glm53_model(cfg, dtype, seed, device, KDA_TORCH_OPS, INDEXER_TORCH_OPS)

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
        """A batch's first chunk: each request that hits an earlier request's prefix copies what it needs
        from the store (:meth:`~.cp.store.Glm53Store.take_hit`), requests freed or evicted since are dropped,
        and every other cached prefix (a miss's whole prefix among them) is installed as an earlier prefill
        left it: the oracle over the prefix, each rank keeping its share (its latent rows and the groups whose
        last token it owns; the KDA states and the incomplete group's raw rows everywhere), with the
        checkpoints at the hit points inside it. The rules: docs/glm-5.3.md, "Prefix hits and eviction"."""
        from reference_impl.pool_timeline import pool_timeline  # the engine's page table, replayed

        assert isinstance(model, Glm53Model)
        if store.timeline is None:  # pure metadata, the same on every rank
            store.timeline = pool_timeline(run)
        hits = store.timeline.hits[chunk.batch]
        locs_of = {req: store.batch.request_locs[i] for i, req in enumerate(chunk.requests)}
        taken = {  # before anything is dropped: a source the same batch evicts serves its hits first
            req: store.take_hit(req, source, run.requests[req].prefix, shared_tokens.get(req, 0))
            for req in chunk.requests
            if req in hits and (source := run.requests[req].shares) is not None
        }
        by_reference = [locs_of[req][: hit.shared].cpu() for req, hit in taken.items()]
        store.keep_only(store.timeline.resident_at(chunk), by_reference)
        for req, hit in taken.items():
            store.put_hit(req, locs_of[req], hit)
        points = hit_points(run)
        for req in chunk.requests:
            prefix = run.requests[req].prefix
            if not prefix or req in hits:
                continue
            locs = locs_of[req][:prefix]
            self._install(run, model, inputs[req][:prefix], store, req, locs)
            for q in sorted(q for q in points.get(req, ()) if q <= prefix):  # that earlier prefill's checkpoints
                at_q = run_glm53_oracle(model, [0], [inputs[req][:q]], store.rows)
                for layer, (cache,) in enumerate(at_q.caches):
                    if isinstance(cache, KDACache):
                        store.checkpoint(req, q)[layer] = KDACache(cache.state.clone(), cache.conv.clone())
                    elif cache.pending_k is not None and cache.pending_gate is not None:
                        store.checkpoint(req, q)[layer] = (cache.pending_k.clone(), cache.pending_gate.clone())

    @staticmethod
    def _install(
        run: RunConfig, model: Glm53Model, tokens: torch.Tensor, store: Glm53Store, req: int, locs: torch.Tensor
    ) -> None:
        """Request ``req``'s cached prefix ``tokens`` at ``locs``: the oracle over it, each rank keeping its share."""
        P = run.model.index_kpool
        oracle = run_glm53_oracle(model, [0], [tokens], store.rows)
        for layer, caches in enumerate(oracle.caches):
            cache = caches[0]
            if isinstance(cache, KDACache):
                store.kda[(layer, req)] = KDACache(cache.state.clone(), cache.conv.clone())
                continue
            assert isinstance(cache, DSACache)
            store.write_latent(layer, locs, cache.latent)
            if cache.group_keys is not None:
                assert cache.pending_k is not None and cache.pending_gate is not None
                ends = locs[P - 1 :: P][: len(cache.group_keys)]
                mine = store.mine_keys(ends)
                store.write_group_keys(layer, ends[mine], cache.group_keys[mine])
                store.set_pending_of(layer, req, cache.pending_k.clone(), cache.pending_gate.clone())
        store.locs[req] = locs.cpu()

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
        """``attention_kernel``: the paths the KDA recurrence and the indexer's scoring and selection take (a
        run builds its model with the kernel tables, :data:`~.kernels.dispatch.KDA_KERNEL_OPS` and
        :data:`~.kernels.dispatch.INDEXER_KERNEL_OPS`): ``glm53-kda-triton+indexer-triton`` on CUDA,
        ``glm53-kda-torch+indexer-torch`` off it or under ``DSACP_FORCE_TORCH=1``. The indexed layers'
        attention is the torch reference."""
        from reference_impl.families.glm53.kernels.dispatch import indexer_kernel_name, kda_kernel_name

        return {
            "attention_kernel": f"glm53-kda-{kda_kernel_name(device)}+indexer-{indexer_kernel_name(device)}",
            "index_topk_pattern": None,
            "selects": run.model.count("indexed_attention") > 0,
        }

    def check_pd(self, run: RunConfig) -> None:
        """The rows transfer ships every part of a GLM-5.3 cache (:mod:`.pd`); the page transfer mirrors the
        DSA pool's pages, which a GLM-5.3 store does not have (``run_prefill_and_decode`` asks before)."""
        self.check_run(run)


FAMILY = Glm53Family()
