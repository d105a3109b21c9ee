"""What the CP orchestration asks of a model family: :class:`ModelFamily`, and the per-chunk
layer step :class:`ChunkStep` it hands the engine.

A **model family** is every model whose attention layers share one semantics, one set of caches
and one single-device oracle (DeepSeek-V3.2, GLM-5 and GLM-5.2 are one family: an MLA layer with
the lightning indexer; DeepSeek-V4 is another: sliding, CSA and HCA layers over compressed
entries). The engine, the runner, the launcher, the report, the memory estimate, the API and the
CLI never ask which family they run: they look the family up by its config
(:func:`reference_impl.families.family_of`) and call it through this interface. The CP machinery
every family shares (split, ownership, page tables, collectives, narrow output, prefetch) lives
outside the families and names none.

Contract, in the order a run uses it:

1. **configuration**: ``presets`` (name -> config), ``config_type``; :meth:`ModelFamily.model_for_run`
   applies the run's knobs to the preset's config; :meth:`ModelFamily.check_run` refuses knobs the
   family has no use for (:class:`~reference_impl.errors.ConfigError`, naming the knob);
2. **sizing**: :meth:`ModelFamily.weight_bytes` and :meth:`ModelFamily.estimate` (arithmetic only:
   the run is refused before anything is built when it cannot fit);
3. **the model**: :meth:`ModelFamily.build_model` (deterministic weights from a seed, its compute
   cores through the family's kernel table or the torch references), :meth:`ModelFamily.load_weights`
   (the checkpoint's tensor names);
4. **one rank's run**: :meth:`ModelFamily.make_store` (the rank's caches for the run),
   :meth:`ModelFamily.install_prefixes` (cached prefixes, as an earlier prefill left them), and per
   chunk :meth:`ModelFamily.chunk_step` -> a :class:`ChunkStep` whose ``step(layer, block, x)`` runs
   one layer for the rank's tokens;
5. **the check**: :meth:`ModelFamily.oracle` (the single-device run) and :meth:`ModelFamily.compare`
   (every rank's outputs, top-k and stored bytes against it);
6. **the rest of the run**: :meth:`ModelFamily.report_fields`, :meth:`ModelFamily.check_pd` (what a
   prefill -> decode transfer of this family needs, or a refusal) and :meth:`ModelFamily.pd_payload`
   (what its prefill ranks ship to the decode and how the decode lays it out: a :class:`PDPayload`,
   or ``None`` for the DSA rows, MLA latent and index K, that :mod:`reference_impl.pd` moves itself).

``docs/adding-a-family.md`` walks through writing one; ``tests/test_model_family.py`` defines a small
family inside the test and runs it through the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only: the families import the engine's types, not the other way round
    from reference_impl.config import RunConfig
    from reference_impl.cp.batch import BatchLocs
    from reference_impl.cp.comm import CPGroup
    from reference_impl.cp.split import SplitMetadata
    from reference_impl.cp.split_index import SplitIndex
    from reference_impl.schedule import Chunk


@runtime_checkable
class RankStore(Protocol):
    """What the orchestration reads of a rank's caches, whatever the family keeps in them.

    A family's store adds its own per-layer operations (the DSA family's
    :class:`~reference_impl.cp.kv_store.KVStore`, DeepSeek-V4's compressed-entry store); the engine
    only binds it to each chunk's batch, reads its byte counts, and asks for the rows it stores
    (check runs).
    """

    name: str
    materialized_bytes: int  # bytes read from storage to build full views, all layers so far
    transient_bytes: int  # gather buffers of the last layer beyond its view

    @property
    def sharded(self) -> bool:
        """Every cache row lives on exactly one rank (read-only: a store may compute it)."""
        ...

    @property
    def kv_bytes(self) -> int:
        """KV (or compressed-entry) bytes at rest on this rank, all layers."""
        ...

    @property
    def index_bytes(self) -> int:
        """Indexer key bytes at rest on this rank, all layers."""
        ...

    @property
    def store_path(self) -> str:
        """How the current tokens reach the caches (``"replicated"``, ``"gathered"``, ``"direct"``, ...)."""
        ...

    def bind(self, batch: BatchLocs) -> None:
        """Serve the next chunk's batch (the same pools, new locs)."""
        ...

    def breakdown(self) -> dict[str, int]:
        """Family-specific byte counts for the run report (``{}`` where there is nothing beyond kv/index)."""
        ...

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> dict[int, tuple[Any, ...]]:
        """Per request: the rows this rank stores of ``layer`` (check runs compare them with the oracle's)."""
        ...


@dataclass
class ChunkInputs:
    """Everything the engine has built for one chunk on one rank, handed to :meth:`ModelFamily.chunk_step`."""

    group: CPGroup
    run: RunConfig
    model: Any  # the family's model (:meth:`ModelFamily.build_model`)
    store: Any  # the family's store (:meth:`ModelFamily.make_store`)
    chunk: Chunk
    meta: SplitMetadata  # the chunk's split (identical on every rank)
    batch: BatchLocs  # the chunk's locs in the rank's pools
    index: SplitIndex  # device tensors of the rank's tokens in the split
    positions: torch.Tensor  # [T_local] the rank's tokens' positions in their requests
    on_layer_stored: Any = None  # a :class:`~reference_impl.engine.LayerStoredHook` (PD), or None


class ChunkStep(Protocol):
    """One chunk's layer loop on one rank, one layer per :meth:`step` call (the engine owns the loop,
    its clock, the host-sync audit and the tail).

    ``begin`` runs before layer 0 (a prefetch's first launch), ``step`` per layer, ``end`` after the
    last layer, before anything waits for the device.
    """

    transient_bytes: int  # the last step's transient bytes (gathers, views, the store's buffers), for the report

    def begin(self) -> None: ...

    def step(self, layer: int, block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T_local, dim] -> (x after the layer, its selection)``. On a check run (``run.check``) the
        selection is ``[T_local, K]`` key positions in the request, ``-1`` for none (``[T_local, 0]`` on a
        layer that selects nothing); otherwise whatever the layer selected (the engine does not read it)."""
        ...

    def end(self) -> None: ...

    def prefetch_wait_ms(self) -> list[float]:
        """Per layer, the time the loop waited for a prefetch (empty without one)."""
        ...


class PDDecoder(Protocol):
    """The decode process's side of a family's PD transfer (:meth:`PDPayload.decoder`): its own cache
    of every request, filled from the prefill ranks' row blocks."""

    bytes_received: int

    @property
    def blocks_per_rank(self) -> int:
        """Row blocks each prefill rank sends (a two-sided transport's receive count)."""
        ...

    def receive(self, block: Any) -> None:
        """Place a :class:`~reference_impl.pd.transport.RowBlock` (two-sided transports)."""
        ...

    def mooncake_receiver(self, engine: Any) -> Any:
        """Register the decode's memory with a Mooncake engine: an object with ``target`` (what the
        prefill ranks write to), ``wait(requests, prefill_ranks, n_layers, deadline_s)`` and ``close()``."""
        ...

    def check_complete(self) -> None:
        """Raise :class:`~reference_impl.errors.ConfigError` unless every row arrived exactly once."""
        ...

    def caches(self) -> Any:
        """The assembled caches (``[layer][request]``, the family's cache type)."""
        ...

    def next_token(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's next token (``inputs[req]``: its layer-0 input) through every layer against
        the assembled caches: its final hidden state."""
        ...


class PDPayload(Protocol):
    """What a family's prefill ranks ship to a PD decode, per layer and request, and how the decode
    lays it out and continues (``transfer="rows"``), for one run.

    Optional: ``oracle_check_kind``, how :meth:`oracle_mismatches` compares, for the report's verdict
    (``"byte for byte"`` where a payload has none; GLM-5.3's caches agree within its check's bounds)."""

    def sender(self, transport: Any, decode_rank: int) -> Any:
        """A prefill rank's layer-wise send: an engine ``LayerStoredHook`` with ``bytes_sent``,
        ``rows_sent``, ``blocks_sent``, ``overlap`` and ``wait_all()``."""
        ...

    def bytes_at_rest(self, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
        """What ``rank`` is to ship, counted from the ownership of every request's locs (``request_locs``:
        request -> its logical locs as the run left them; the check of what it sent)."""
        ...

    def decoder(self, device: torch.device) -> PDDecoder: ...

    def next_inputs(self, device: torch.device) -> list[torch.Tensor]:
        """Per request, the layer-0 input of the token the decode continues with."""
        ...

    def store_mismatches(self, decoded: Any, ranks_stored: list[Any]) -> list[str]:
        """Where the decode's caches differ from the rows the prefill ranks held at rest (``RankResult.stored``)."""
        ...

    def oracle_mismatches(self, decoded: Any, oracle: Any) -> list[str]:
        """Where the decode's caches differ from the family's oracle's, byte for byte."""
        ...

    def next_token_error(
        self, model: torch.nn.Module, oracle: Any, inputs: Sequence[torch.Tensor], got: Sequence[torch.Tensor]
    ) -> float:
        """The decode's next-token hidden states against the oracle's step over its own caches
        (largest difference over the reference's largest value)."""
        ...


class ModelFamily(Protocol):
    """A model family (see the module docstring for the contract, in the order a run uses it)."""

    name: str  # the family's name ("dsa", "deepseek-v4")
    title: str  # for people: the models it covers
    planner_command: str  # the command that plans this family's capacity per rank

    # Read-only members (a family's class attributes satisfy them, whatever their narrower types).
    @property
    def config_type(self) -> type:
        """The family's config dataclass: its presets' type."""
        ...

    @property
    def presets(self) -> Mapping[str, Any]:
        """Preset name -> config."""
        ...

    @property
    def per_layer_tags(self) -> tuple[str, ...]:
        """The collectives' tags that count as per-layer gather traffic."""
        ...

    # ---- configuration -------------------------------------------------------------------------
    def model_for_run(self, cfg: Any, run: RunConfig) -> Any:
        """The preset's config with the run's knobs applied (layer count already applied)."""
        ...

    def check_run(self, run: RunConfig) -> None:
        """Refuse, by name, the run knobs this family has no use for or cannot run."""
        ...

    # ---- sizing --------------------------------------------------------------------------------
    def weight_bytes(self, cfg: Any, dtype_bytes: int) -> tuple[int, int]:
        """``(the parameters in the compute dtype, the transient of their initialization)``."""
        ...

    def estimate(
        self, run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
    ) -> Any:
        """The run's peak memory per process (a :class:`~reference_impl.footprint.Footprint`), by arithmetic."""
        ...

    # ---- the model -----------------------------------------------------------------------------
    def build_model(
        self,
        cfg: Any,
        dtype: torch.dtype,
        seed: int,
        device: torch.device,
        kernels: bool,
        fp8_projections: bool = False,
    ) -> torch.nn.Module:
        """The model with deterministic weights from ``seed``; ``kernels``: its compute cores through
        the family's kernel table (the torch references off CUDA), else the torch references;
        ``fp8_projections``: FP8 projection weights where the family has them (refused in ``check_run``
        where it has not)."""
        ...

    def load_weights(self, model: torch.nn.Module, checkpoint: Any, first_layer: int, head: bool) -> None:
        """Overwrite the model's weights from a checkpoint (a path or a mapping, the checkpoint's names)."""
        ...

    # ---- one rank's run ------------------------------------------------------------------------
    def make_store(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> RankStore:
        """The rank's caches for the run, serving ``batch`` (the first chunk's)."""
        ...

    def install_prefixes(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        inputs: list[torch.Tensor],
        store: Any,
        chunk: Chunk,
        shared_tokens: dict[int, int],
    ) -> None:
        """Fill the caches with the cached prefixes of ``chunk``'s requests, as an earlier prefill left them
        (``shared_tokens[req]``: leading tokens already there by reference)."""
        ...

    def chunk_step(self, inputs: ChunkInputs) -> ChunkStep:
        """The layer step of one chunk on one rank."""
        ...

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
    ) -> Any:
        """The single-device run every CP run is compared with."""
        ...

    def compare(
        self,
        run: RunConfig,
        meta: SplitMetadata,
        model: torch.nn.Module,
        oracle: Any,
        results: list[Any],
        compute_dtype: torch.dtype,
    ) -> Any:
        """The ranks' results against the oracle (an :class:`~reference_impl.check.Agreement`)."""
        ...

    # ---- the rest of the run -------------------------------------------------------------------
    def report_fields(self, run: RunConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Family-specific fields of the run report: ``attention_kernel`` (the path the dispatch takes on
        ``device`` for ``dtype``), ``index_topk_pattern`` (IndexShare, or None) and ``selects`` (whether any
        layer selects keys: without, the report gives no top-k figure)."""
        ...

    def check_pd(self, run: RunConfig) -> None:
        """Refuse, by name, what a prefill -> decode transfer of this family cannot ship."""
        ...

    def pd_payload(self, run: RunConfig) -> PDPayload | None:
        """What the rows transfer ships for this family (after :meth:`check_pd`); ``None``: the DSA rows
        (MLA latent, index K on the layers that keep it) of :mod:`reference_impl.pd`."""
        ...

    def decode_bytes(self, run: RunConfig) -> int:
        """The memory of a PD decode process beside the ranks (its cache of every request)."""
        ...
