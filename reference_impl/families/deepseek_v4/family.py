"""DeepSeek-V4 behind :class:`~reference_impl.families.base.ModelFamily`.

What the engine gets from here: the compressed-entry store (:class:`~.cp.store.V4Store`: CSA entries
sharded by their compute owner with phase 2, HCA entries, window tails and compressor states
replicated), the prefixes (the oracle over each prefix, each rank keeping its share, or synthetic
entries of the right shapes for benchmarks: :data:`PrefixSource`; a request ``rN:P+E`` of a later
batch hits request ``N``'s cache instead, by the rules of :mod:`~.cp.store`), and the layer step
(:class:`~.cp.layer.V4ChunkRunner`: halos, compression, the sharded CSA indexer, attention with sinks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from reference_impl.config import ConfigError, RunConfig, env_flag
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.base import ChunkInputs, PDPayload
from reference_impl.families.deepseek_v4 import footprint
from reference_impl.families.deepseek_v4.config import V4_PRESETS, V4ModelConfig
from reference_impl.families.deepseek_v4.cp.layer import PER_LAYER_TAGS_V4, V4ChunkRunner
from reference_impl.families.deepseek_v4.cp.store import (
    V4Store,
    install_hits,
    install_synthetic_prefixes,
    install_v4_prefixes,
)
from reference_impl.families.deepseek_v4.model.oracle import V4Model, V4OracleResult, build_v4_model, run_v4_oracle
from reference_impl.families.deepseek_v4.pd import V4PDPayload
from reference_impl.footprint import PROCESS_BASE, SAFETY
from reference_impl.schedule import Chunk

PrefixSource = Callable[[RunConfig, torch.nn.Module, list[torch.Tensor], V4Store, Chunk], None]
"""How the store gets a chunk's cached prefixes: :func:`~.cp.store.install_v4_prefixes` (the oracle's
bytes) or :func:`synthetic_prefixes` (random entries of the right shapes and codecs, for benchmarks)."""


def synthetic_prefixes(
    run: RunConfig, model: torch.nn.Module, inputs: list[torch.Tensor], store: V4Store, chunk: Chunk
) -> None:
    """A :data:`PrefixSource` for benchmarks: computing a 1M-token prefix with the oracle takes hours,
    and no timing or byte count depends on the values."""
    install_synthetic_prefixes(run, store, chunk)


class _V4Step:
    """:class:`~.cp.layer.V4ChunkRunner` as the engine's :class:`~reference_impl.families.base.ChunkStep`;
    ``on_layer_stored`` (a PD send) hears of each layer once the store holds it."""

    def __init__(self, runner: V4ChunkRunner, store: V4Store, on_layer_stored: Any = None) -> None:
        self.runner, self.store, self.on_layer_stored = runner, store, on_layer_stored
        self.transient_bytes = 0

    def begin(self) -> None:
        pass

    def step(self, layer: int, block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, topk = self.runner.step(layer, block, x)
        self.transient_bytes = self.runner.transient_bytes + self.store.transient_bytes
        if self.on_layer_stored is not None:
            self.on_layer_stored.layer_stored(layer)
        return x, topk

    def end(self) -> None:
        pass

    def prefetch_wait_ms(self) -> list[float]:
        return []


class DeepSeekV4Family:
    """DeepSeek-V4-Flash and -Pro, and ``tiny-v4`` (see the module docstring)."""

    name = "deepseek-v4"
    title = "DeepSeek-V4 (sliding-window, CSA and HCA layers over compressed entries)"
    config_type = V4ModelConfig
    presets = V4_PRESETS
    per_layer_tags = PER_LAYER_TAGS_V4
    planner_command = "python -m reference_impl.planner.v4"

    def __init__(self, prefixes: PrefixSource = install_v4_prefixes) -> None:
        self.prefixes = prefixes

    # ---- configuration -------------------------------------------------------------------------
    def model_for_run(self, cfg: V4ModelConfig, run: RunConfig) -> V4ModelConfig:
        return cfg  # its own cache format and no IndexShare: the DSA knobs are refused by name (check_run)

    def check_run(self, run: RunConfig) -> None:
        """The DSA-cache knobs a DeepSeek-V4 preset has no use for are refused by name, not ignored."""
        if run.mla_scale_fmt != "ue8m0":
            raise ConfigError(
                f"mla_scale_fmt={run.mla_scale_fmt}: {run.preset}'s FP8 entries keep power-of-two "
                "scales (ue8m0) as FlashMLA stores them; drop the flag"
            )
        if run.index_topk_pattern is not None:
            raise ConfigError(
                f"index_topk_pattern: {run.preset} has no IndexShare (its layer types are set by "
                "compress_ratios); drop the flag"
            )
        if run.cpu_widths:
            raise ConfigError(
                f"cpu_widths: {run.preset} has no CPU-width variant"
                + (
                    "; tiny-v4 is already small enough for a CPU: drop the flag"
                    if run.preset == "tiny-v4"
                    else "; use the tiny-v4 preset"
                )
            )
        if env_flag("fp8_projections"):
            raise ConfigError(
                f"DSACP_FP8_PROJECTIONS=1: {run.preset}'s projections are not quantized here (FP8 "
                "projections are built for the DSA layer); unset it"
            )
        if run.kv_design != "phases":
            raise ConfigError(
                f"kv_design={run.kv_design} is built for the DSA cache (MLA latent + indexer K); {run.preset}'s "
                "compressed caches run under the phases only (kv_design=phases)"
            )
        for i, r in enumerate(run.requests):
            source = run.requests[r.shares] if r.shares is not None else None
            if source is not None and source.shares is not None and r.prefix <= source.prefix:
                raise ConfigError(
                    f"requests: r{i} = r{r.shares}:{r.prefix}+{r.extend} hits inside r{r.shares}'s own hit of "
                    f"r{source.shares} ({source.prefix} tokens); on {run.preset} write it as "
                    f"r{source.shares}:{r.prefix}+{r.extend}"
                )

    # ---- sizing --------------------------------------------------------------------------------
    def weight_bytes(self, cfg: V4ModelConfig, dtype_bytes: int) -> tuple[int, int]:
        return footprint.weight_bytes(cfg, dtype_bytes)

    def estimate(
        self, run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
    ) -> Any:
        return footprint.estimate(run, device_type, start_method, cuda_devices, extra_process, b)

    def decode_bytes(self, run: RunConfig) -> int:
        return int(SAFETY * PROCESS_BASE["spawn"])

    # ---- the model -----------------------------------------------------------------------------
    def build_model(
        self,
        cfg: V4ModelConfig,
        dtype: torch.dtype,
        seed: int,
        device: torch.device,
        kernels: bool,
        fp8_projections: bool = False,
    ) -> V4Model:
        """Its compute cores through :data:`~.kernels.dispatch.V4_KERNEL_OPS` (the torch references off
        CUDA) or the torch references (:data:`~.model.ops.V4_TORCH_OPS`)."""
        from reference_impl.families.deepseek_v4.kernels.dispatch import V4_KERNEL_OPS
        from reference_impl.families.deepseek_v4.model.ops import V4_TORCH_OPS

        return build_v4_model(cfg, dtype, seed, device, V4_KERNEL_OPS if kernels else V4_TORCH_OPS)

    def load_weights(self, model: torch.nn.Module, checkpoint: Any, first_layer: int, head: bool) -> None:
        from reference_impl.families.deepseek_v4.model.checkpoint import load_v4_hf_weights

        load_v4_hf_weights(cast(V4Model, model), checkpoint, first_layer=first_layer, head=head)  # build_model's

    # ---- one rank's run ------------------------------------------------------------------------
    def make_store(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> V4Store:
        return V4Store.for_run(run, batch, group)

    def install_prefixes(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        inputs: list[torch.Tensor],
        store: V4Store,
        chunk: Chunk,
        shared_tokens: dict[int, int],
    ) -> None:
        """A batch's first chunk: requests that start with an earlier request's prefix served from the store
        (the hit rules of :mod:`~.cp.store`), then requests freed or evicted since dropped with their pages,
        then cached prefixes installed (:data:`PrefixSource`), a miss's whole prefix among them (what goes
        together and why: :mod:`~.cp.store`)."""
        from reference_impl.pool_timeline import pool_timeline  # the engine's page table, replayed

        if store.timeline is None:  # pure metadata, the same on every rank
            store.timeline = pool_timeline(run)
        store.begin_chunk(list(chunk.requests), list(store.batch.request_locs))
        store.hits = store.timeline.hits[chunk.batch]
        install_hits(run, store, chunk, shared_tokens)
        store.forget_freed({req: shared_tokens.get(req, 0) for req in chunk.requests})
        store.keep_only(store.timeline.resident_at(chunk))
        self.prefixes(run, model, inputs, store, chunk)

    def chunk_step(self, inputs: ChunkInputs) -> _V4Step:
        if inputs.store.timeline is not None:  # a later chunk's pages may have evicted a cached request
            inputs.store.keep_only(inputs.store.timeline.resident_at(inputs.chunk))
        runner = V4ChunkRunner.for_run(
            inputs.group, inputs.run, inputs.store, inputs.meta, inputs.batch, inputs.chunk.requests
        )
        return _V4Step(runner, inputs.store, inputs.on_layer_stored)

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
    ) -> V4OracleResult:
        assert isinstance(model, V4Model)
        return run_v4_oracle(model, list(prefixes), inputs, kv_dtype, chunk_size, view_dtype)

    def compare(
        self,
        run: RunConfig,
        meta: SplitMetadata,
        model: torch.nn.Module,
        oracle: Any,
        results: list[Any],
        compute_dtype: torch.dtype,
    ) -> Any:
        from reference_impl.families.deepseek_v4.check import compare_v4

        assert isinstance(model, V4Model)
        return compare_v4(run, meta, model, oracle, results, compute_dtype)

    # ---- the rest of the run -------------------------------------------------------------------
    def report_fields(self, run: RunConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from reference_impl.families.deepseek_v4.kernels.dispatch import attention_kernel_name

        # Only CSA layers select entries (sliding-window and HCA layers attend to every entry they hold).
        return {
            "attention_kernel": "v4-" + attention_kernel_name(device),
            "index_topk_pattern": None,
            "selects": run.model.count("csa") > 0,
        }

    def check_pd(self, run: RunConfig) -> None:
        """The rows transfer ships every part of a V4 cache (:mod:`~.pd`); the page transfer mirrors the
        DSA pool's pages, which a V4 store does not have (``run_prefill_and_decode`` asks before)."""

    def pd_payload(self, run: RunConfig) -> PDPayload:
        return V4PDPayload(run)


FAMILY = DeepSeekV4Family()
