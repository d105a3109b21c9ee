"""The run configuration: requests, the knobs of one CP prefill, and their validation.

Every knob has one name. The config field ``cp_size`` is the CLI flag ``--cp-size`` and the
environment variable ``DSACP_CP_SIZE``; :func:`knob_names` spells the three forms and
``docs/knobs.md`` lists them all.

Errors for impossible configurations are :class:`ConfigError` (a ``ValueError``) with a message
that names the problem; the CLI turns them into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from reference_impl.errors import ConfigError
from reference_impl.families import ModelFamily, family_of, get_preset
from reference_impl.fp8 import SCALE_FMTS
from reference_impl.machine import cpu_cores

if TYPE_CHECKING:  # annotations only: this module does not import torch at the top
    import torch
from reference_impl.phases import PhaseSet, available_levels

__all__ = [
    "BACKENDS",
    "COMPUTE_DTYPES",
    "DESIGN_PHASES",
    "DEVICES",
    "KV_DESIGNS",
    "KV_DTYPES",
    "LIBRARY_ENV",
    "MAX_BATCH_TOKENS",
    "MAX_CHUNKS",
    "MAX_HBM_GIB",
    "MAX_LAYERS",
    "MAX_PLAN_CP",
    "MAX_SEED",
    "SPLIT_MODES",
    "ConfigError",
    "EnvKnob",
    "KVDesign",
    "KVDtype",
    "PhaseSet",
    "Request",
    "RunConfig",
    "SplitMode",
    "available_levels",
    "ascii_int",
    "check_choice",
    "check_environment",
    "env_choice",
    "env_flag",
    "env_int",
    "env_knob",
    "env_value",
    "get_preset",
    "knob_names",
    "parse_batches",
    "parse_int_list",
    "parse_requests",
    "validate_interleave",
    "validate_kv_design",
    "SCALE_FMTS",
    "validate_scale_fmt",
    "validate_page_size",
]

KVDtype = Literal["bf16", "fp8"]
SplitMode = Literal["in-seq", "round-robin"]
KVDesign = Literal["phases", "layer-split", "rotated-shard", "dcp-gather"]

# How the KV of a CP prefill is kept and gathered (``reference_impl.cp.designs``): this package's
# phases, or one of the engines' competing designs, each with its own store, gather and materialization.
KV_DESIGNS: tuple[str, ...] = ("phases", "layer-split", "rotated-shard", "dcp-gather")
# The phases a competing design runs beside it: narrow output (1), the page-aligned split (4) and the
# fused rerange / store kernels (7). The design replaces the KV path of phases 2, 3, 5, 6 and 8 (it
# shards, reuses, plans once per batch and prefetches in its own way).
DESIGN_PHASES: frozenset[int] = frozenset({1, 4, 7})

# The enumerated knobs' values: RunConfig, the CLI's flags and the environment variables all check
# against these tuples (a new value is added here, once).
KV_DTYPES: tuple[str, ...] = ("bf16", "fp8")
SPLIT_MODES: tuple[str, ...] = ("in-seq", "round-robin")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
BACKENDS: tuple[str, ...] = ("auto", "gloo", "nccl")
COMPUTE_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16")

ENV_PREFIX = "DSACP_"
MIN_PAGE_SIZE = 4
MAX_PAGE_SIZE = 4096
# Sizes refused by arithmetic, before anything proportional to them is built:
MAX_SEED = 2**63 - 2  # the inputs' generator takes ``seed + 1``, a signed 64-bit value on every path
MAX_BATCH_TOKENS = 2**31 - 1  # top-k indices are int32 rows of a batch's full view (every request's tokens)
MAX_CHUNKS = 1 << 16  # chunked prefill: chunks per run (each is a CP batch through every layer)
MAX_PLAN_CP = 4096  # the planner's CP ranks: it walks every rank of every level and context
MAX_HBM_GIB = 1 << 20  # the planner's GiB per GPU (1 PiB): past it, byte counts leave float's exact integers
# Layers of a model (the deepest DSA model has 78): a config's layer pattern, weights and every loop
# are per layer, so a count past this is refused by arithmetic instead of built.
MAX_LAYERS = 1024


def ascii_int(text: str) -> int:
    """``int(text)`` for ASCII text only. Python's ``int`` also reads other scripts' digits (``'٣'``
    is 3), which a number typed here never means; such text raises ``ValueError`` as ``int`` does."""
    if not text.isascii():
        raise ValueError(f"{text!r}: not ASCII digits")
    return int(text)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a :class:`ConfigError` naming ``name`` and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r}: use {_one_of(choices)}")
    return value


def _one_of(choices: tuple[str, ...]) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def validate_page_size(page_size: int) -> None:
    """Raise :class:`ConfigError` unless ``page_size`` is a power of two in ``[4, 4096]``."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ConfigError(f"page_size={page_size} must be a power of two")
    if page_size < MIN_PAGE_SIZE:
        raise ConfigError(
            f"page_size={page_size} is below {MIN_PAGE_SIZE}: an index page's scale block of page_size "
            "float32 values must fill whole 16-byte vectors"
        )
    if page_size > MAX_PAGE_SIZE:
        raise ConfigError(f"page_size={page_size} exceeds {MAX_PAGE_SIZE} tokens")


def validate_kv_design(value: object) -> str:
    """``value`` if it names a KV design (:data:`KV_DESIGNS`), else a :class:`ConfigError` listing them
    (an empty value too)."""
    if not isinstance(value, str) or value not in KV_DESIGNS:
        raise ConfigError(f"kv_design={value!r}: use one of {', '.join(KV_DESIGNS)}")
    return value


def validate_scale_fmt(value: object) -> str:
    """``value`` if it names an MLA cache scale format (:data:`SCALE_FMTS`), else a :class:`ConfigError`."""
    return check_choice("mla_scale_fmt", value, SCALE_FMTS)


def validate_interleave(interleave: int, page_size: int) -> None:
    """Raise :class:`ConfigError` unless ``interleave`` (tokens per ownership run of a sharded KV
    cache) is a power of two that divides ``page_size``."""
    if interleave < 1 or interleave & (interleave - 1) or page_size % interleave:
        raise ConfigError(f"kv_interleave={interleave} must be a power of two that divides the page size {page_size}")


# --------------------------------------------------------------------------------------------
# Requests and run configuration
# --------------------------------------------------------------------------------------------


def _check_type(name: str, value: object, kind: type) -> None:
    """``ConfigError`` unless ``value`` is a ``kind`` (a bool is not an int here)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r}: need {kind.__name__}, got {type(value).__name__}")


@dataclass(frozen=True)
class Request:
    """One request of a prefill batch: ``prefix`` tokens already cached, ``extend`` tokens to compute.

    ``shares``: the run-global index of an earlier batch's request whose first ``prefix`` tokens
    this one starts with (spec ``rN:P+E``); its whole pages are reused by reference.
    """

    prefix: int
    extend: int
    shares: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefix", "extend"):
            _check_type(f"Request.{name}", getattr(self, name), int)
        if self.prefix < 0 or self.extend <= 0:
            raise ConfigError(f"request prefix={self.prefix} extend={self.extend}: need prefix >= 0 and extend >= 1")
        if self.shares is not None:
            _check_type("Request.shares", self.shares, int)
            if self.shares < 0 or self.prefix < 1:
                raise ConfigError(
                    f"request r{self.shares}:{self.prefix}+{self.extend}: need N >= 0 and a prefix of at least 1"
                )

    @property
    def total(self) -> int:
        return self.prefix + self.extend


def _list_items(spec: str, what: str) -> list[str]:
    """Comma-separated items of ``spec``; an empty spec or an empty item (``a,,b``, ``a,``) is refused."""
    if not isinstance(spec, str):
        raise ConfigError(f"{what}={spec!r}: need a string (e.g. '0+128,64+200')")
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip():
        raise ConfigError(f"{what} is empty")
    for position, item in enumerate(items, 1):
        if not item:
            raise ConfigError(f"{what} {spec!r}: entry {position} is empty (doubled or trailing comma?)")
    return items


def parse_int_list(spec: str, what: str, minimum: int = 0) -> list[int]:
    """``"11,13"`` -> ``[11, 13]``; refuses empty entries, non-integers and values below ``minimum``."""
    values = []
    for item in _list_items(spec, what):
        try:
            value = ascii_int(item)
        except ValueError:
            raise ConfigError(f"{what} {spec!r}: {item!r} is not an integer") from None
        if value < minimum:
            raise ConfigError(f"{what} {spec!r}: {value} is below {minimum}")
        values.append(value)
    return values


def parse_requests(spec: str) -> list[Request]:
    """Parse ``"0+128,64+200"`` (prefix+extend pairs), ``"128,200"`` (extend only), or ``"r0:64+50"``
    (the first 64 tokens of request 0 of an earlier batch, then 50 new ones)."""
    requests: list[Request] = []
    for item in _list_items(spec, "request spec"):
        shares = None
        body = item
        if item.startswith("r"):
            head, _, body = item[1:].partition(":")
            try:
                shares = ascii_int(head)
            except ValueError:
                raise ConfigError(f"malformed request {item!r}: use rN:PREFIX+EXTEND (N an earlier request)") from None
            if "+" not in body:
                raise ConfigError(f"malformed request {item!r}: use rN:PREFIX+EXTEND (N an earlier request)")
        parts = body.split("+")
        try:
            if len(parts) == 1:
                requests.append(Request(0, ascii_int(parts[0])))
            elif len(parts) == 2:
                requests.append(Request(ascii_int(parts[0]), ascii_int(parts[1]), shares))
            else:
                raise ValueError
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"malformed request {item!r}: use PREFIX+EXTEND, EXTEND or rN:PREFIX+EXTEND with integers"
            ) from None
    if not requests:
        raise ConfigError(f"malformed request spec {spec!r}: no requests")
    return requests


def parse_batches(spec: str) -> tuple[list[Request], tuple[int, ...]]:
    """``"0+96,40+70;r0:64+50,13+37"`` -> (every request in run order, requests per batch)."""
    batches = [part.strip() for part in spec.split(";")]
    if any(not part for part in batches):
        raise ConfigError(f"batches {spec!r}: a batch is empty (doubled or trailing ';'?)")
    parsed = [parse_requests(part) for part in batches]
    return [r for batch in parsed for r in batch], tuple(len(batch) for batch in parsed)


@dataclass(frozen=True)
class RunConfig:
    """Everything one CP prefill run needs besides the weights and inputs."""

    preset: str = "tiny"
    cp_size: int = 2
    requests: tuple[Request, ...] = (Request(0, 96), Request(40, 70))
    kv_dtype: KVDtype = "fp8"
    split_mode: SplitMode = "in-seq"
    phases: PhaseSet = field(default_factory=PhaseSet)
    page_size: int = 64
    # KV sharded at rest (phase 2): consecutive slots per ownership run (token t of a request on
    # rank (t // I) % C). None: the page size with the in-seq split, 1 with round-robin.
    kv_interleave: int | None = None
    # The KV design: "phases" (this package's phase set) or an engine's competing design, which
    # replaces the KV path of phases 2, 3, 5, 6 and 8 (reference_impl.cp.designs).
    kv_design: KVDesign = "phases"
    n_layers: int | None = None  # None: the preset's layer count
    chunk_size: int | None = None  # chunked prefill: extend tokens per request per chunk (None: one chunk)
    # Several batches in sequence on one pool per rank: requests per batch, in order (None: one
    # batch). A request that shares an earlier batch's prefix (Request.shares) reuses its pages.
    batch_sizes: tuple[int, ...] | None = None
    # The long-lived pool's budget in pages per rank's page table (None: room for every request). With a
    # budget, finished requests stay cached for later prefix hits and are evicted least recently used first
    # when a batch needs their pages; a request whose shared prefix was evicted recomputes it.
    pool_pages: int | None = None
    seed: int = 0
    debug: bool = False
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    compute_dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "fp32" | "bf16"
    check: bool = True  # compare with the single-device oracle
    backend: str = "auto"  # "auto" | "gloo" | "nccl"
    timeout_s: float = 600.0  # a run whose ranks have not all finished by then is stopped
    # Per-request output needs (phase 1 eligibility): any True forces the full tail gather.
    return_hidden_states: bool = False
    input_logprobs: bool = False
    # FP8 scales of the MLA cache's latent blocks (kv_dtype fp8): "ue8m0" (powers of two, DeepSeek's
    # inference code) or "fp32" (amax / 448, SGLang's); the 656-byte row layout is the same.
    mla_scale_fmt: str = "ue8m0"
    # IndexShare: one letter per layer, F (runs the indexer) or S (reuses the previous F layer's
    # top-k); None: the preset's pattern (GLM-5.2's, or every layer full).
    index_topk_pattern: str | None = None
    # Run a real preset on a CPU: tiny's widths (hidden, heads, q_lora, indexer heads, top-k, vocab),
    # the preset's own head dims, byte layouts and semantics (presets.at_cpu_widths).
    cpu_widths: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        get_preset(self.preset)
        if self.cp_size < 1:
            raise ConfigError(f"cp_size={self.cp_size}: need at least one rank")
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        check_choice("split_mode", self.split_mode, SPLIT_MODES)
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"seed={self.seed}: need 0 <= seed <= {MAX_SEED} (2**63 - 2: the inputs' generator takes "
                "seed + 1, a signed 64-bit value)"
            )
        validate_page_size(self.page_size)
        if not self.requests:
            raise ConfigError("a batch needs at least one request")
        if self.split_mode == "round-robin" and self.phases.page_aligned:
            raise ConfigError(
                "round-robin split cannot run phase 4 (page-aligned split): it is an in-seq split; "
                "use --split-mode in-seq"
            )
        validate_kv_design(self.kv_design)
        self._check_design()
        if self.kv_interleave is not None:
            if not (self.phases.sharded_kv or self.kv_design == "dcp-gather"):
                raise ConfigError(
                    "kv_interleave shapes KV sharded at rest: it needs phase 2 (e.g. --phases 2) "
                    "or kv_design=dcp-gather"
                )
            validate_interleave(self.kv_interleave, self.page_size)
        if self.phases.compute_owner and self.interleave != self.page_size:
            raise ConfigError(
                f"phase 5 (compute-owner layout) allocates whole pages in compute-rank lanes: it needs kv_interleave "
                f"equal to the page size {self.page_size}, got {self.interleave}"
            )
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        check_choice("device", self.device, DEVICES)
        check_choice("backend", self.backend, BACKENDS)
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"chunk_size={self.chunk_size}: need at least one token per chunk")
        validate_scale_fmt(self.mla_scale_fmt)
        if self.mla_scale_fmt != "ue8m0" and self.kv_dtype == "bf16":
            raise ConfigError(
                f"mla_scale_fmt={self.mla_scale_fmt}: the scale format is the FP8 cache's; "
                "kv_dtype=bf16 stores no scales: drop one of the two"
            )
        self.family.check_run(self)  # the knobs the run's model family has no use for, by name
        _ = self.model  # the indexer pattern against the layer count, by name
        self._check_batches()
        self._check_sizes()
        self._check_pool()
        self.phases.check_implemented()

    def _check_design(self) -> None:
        """A competing KV design runs only beside the phases it does not replace (:data:`DESIGN_PHASES`)."""
        if self.kv_design == "phases":
            return
        self.family.check_run(self)  # a family whose caches no design models refuses by name first
        clash = sorted(self.phases.enabled - DESIGN_PHASES)
        if clash:
            raise ConfigError(
                f"kv_design={self.kv_design} replaces the KV path of phases 2, 3, 5, 6 and 8 (it shards, reuses the "
                f"current chunk, plans once per batch and prefetches its own way); "
                f"phase(s) {clash} cannot run with it: "
                f"use phases from {sorted(DESIGN_PHASES)} (e.g. --phases 1,7)"
            )

    def _check_types(self) -> None:
        """Wrong types fail here, by name, not later inside a rank."""
        if isinstance(self.requests, list):  # a list of requests is fine: keep the config hashable
            object.__setattr__(self, "requests", tuple(self.requests))
        if (
            isinstance(self.requests, str)
            or not isinstance(self.requests, tuple)
            or not all(isinstance(r, Request) for r in self.requests)
        ):
            raise ConfigError(
                f"requests={self.requests!r}: need a tuple of Request "
                f"(from a spec string: parse_requests({self.requests!r}))"
                if isinstance(self.requests, str)
                else f"requests={self.requests!r}: need a tuple of Request"
            )
        if not isinstance(self.phases, PhaseSet):
            hint = f" (e.g. PhaseSet.level({self.phases}))" if isinstance(self.phases, int) else ""
            raise ConfigError(f"phases={self.phases!r}: need a PhaseSet{hint}")
        for name, kind in (
            ("preset", str),
            ("kv_dtype", str),
            ("split_mode", str),
            ("device", str),
            ("compute_dtype", str),
            ("backend", str),
            ("mla_scale_fmt", str),
            ("cp_size", int),
            ("page_size", int),
            ("seed", int),
            ("debug", bool),
            ("check", bool),
            ("return_hidden_states", bool),
            ("input_logprobs", bool),
            ("cpu_widths", bool),
        ):
            _check_type(name, getattr(self, name), kind)
        if (
            not isinstance(self.timeout_s, (int, float))
            or isinstance(self.timeout_s, bool)
            or not (0 < self.timeout_s < float("inf"))
        ):
            raise ConfigError(f"timeout_s={self.timeout_s!r}: need a positive, finite number of seconds")
        for name in ("n_layers", "chunk_size", "kv_interleave", "pool_pages"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.n_layers is not None and not 1 <= self.n_layers <= MAX_LAYERS:  # before the model is derived
            raise ConfigError(
                f"n_layers={self.n_layers}: need 1 <= n_layers <= {MAX_LAYERS} (the deepest DSA model has 78 layers)"
            )
        if self.index_topk_pattern is not None:
            _check_type("index_topk_pattern", self.index_topk_pattern, str)
            if not self.index_topk_pattern.strip():
                raise ConfigError(
                    "index_topk_pattern='': empty; give one letter per layer (F or S), or leave it "
                    "unset for the preset's own pattern"
                )

    def _check_batches(self) -> None:
        """Batch sizes that tile the requests; each shared prefix from an earlier batch, no longer than its source."""
        sizes = self.batch_sizes
        if sizes is not None:
            if isinstance(sizes, list):
                object.__setattr__(self, "batch_sizes", sizes := tuple(sizes))
            if not isinstance(sizes, tuple) or not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise ConfigError(f"batch_sizes={sizes!r}: need a tuple of positive request counts")
            if sum(sizes) != len(self.requests):
                raise ConfigError(f"batch_sizes={sizes} cover {sum(sizes)} requests, the run has {len(self.requests)}")
        for index, request in enumerate(self.requests):
            if request.shares is None:
                continue
            batch = self.batch_of(index)
            if request.shares >= len(self.requests) or self.batch_of(request.shares) >= batch:
                raise ConfigError(
                    f"request r{index} = r{request.shares}:{request.prefix}+{request.extend}: "
                    f"r{request.shares} must be a "
                    "request of an earlier batch (batches are separated by ';')"
                )
            source = self.requests[request.shares]
            if request.prefix > source.total:
                raise ConfigError(
                    f"request r{index} starts with {request.prefix} tokens of r{request.shares}, "
                    f"which has {source.total}"
                )

    def _check_sizes(self) -> None:
        """Sizes no machine runs, refused by arithmetic (nothing here is proportional to them)."""
        first = 0
        for batch, size in enumerate(self.batches):
            members = self.requests[first : first + size]
            first += size
            tokens = sum(r.total for r in members)
            if tokens > MAX_BATCH_TOKENS:
                where = f"batch {batch}'s requests" if len(self.batches) > 1 else "the requests"
                raise ConfigError(
                    f"{where} hold {tokens:,} tokens (prefix + extend): at most {MAX_BATCH_TOKENS:,} (2**31 - 1), "
                    "because top-k indices are int32 rows of the batch's full view"
                )
        if self.chunk_size is not None:
            chunks, first = 0, 0
            for size in self.batches:
                chunks += -(-max(r.extend for r in self.requests[first : first + size]) // self.chunk_size)
                first += size
            if chunks > MAX_CHUNKS:
                raise ConfigError(
                    f"chunk_size={self.chunk_size} cuts the run into {chunks:,} chunks (each a CP batch through every "
                    f"layer): at most {MAX_CHUNKS:,}; use a larger chunk size"
                )

    def _check_pool(self) -> None:
        """A pool budget holds every batch's own pages (its requests' pages at once, plus the lane slack
        of phase 5 or a KV design's lanes): cached pages can be evicted, a running batch's cannot."""
        if self.pool_pages is None:
            return
        lanes = self.phases.compute_owner or self.kv_design != "phases"
        first, need, worst = 0, 0, 0
        for batch, size in enumerate(self.batches):
            members = self.requests[first : first + size]
            first += size
            pages = sum(-(-r.total // self.page_size) for r in members)
            pages += 2 * self.cp_size * (size + 1) if lanes else 0
            if pages > need:
                need, worst = pages, batch
        if self.pool_pages < need:
            where = f"batch {worst}'s requests need" if len(self.batches) > 1 else "the requests need"
            slack = " (with the lane slack of phase 5 or a KV design)" if lanes else ""
            raise ConfigError(
                f"pool_pages={self.pool_pages} is too small for one batch: {where} {need} pages of "
                f"{self.page_size} tokens{slack}; give at least {need}"
            )

    @property
    def batches(self) -> tuple[int, ...]:
        """Requests per batch, in order: ``batch_sizes``, or one batch of every request."""
        return self.batch_sizes or (len(self.requests),)

    def batch_of(self, request: int) -> int:
        """The batch (0-based) that computes request ``request`` (run order)."""
        bound = 0
        for batch, size in enumerate(self.batches):
            bound += size
            if request < bound:
                return batch
        raise ConfigError(f"request {request} is beyond the run's {len(self.requests)} requests")

    @property
    def interleave(self) -> int:
        """Tokens per ownership run of the sharded KV: ``kv_interleave``, else the page size (in-seq)
        or 1 (round-robin: every rank stores the tokens it computes)."""
        if self.kv_interleave is not None:
            return self.kv_interleave
        if self.kv_design == "dcp-gather":
            return 1  # vLLM's default --cp-kv-cache-interleave-size
        return 1 if self.split_mode == "round-robin" else self.page_size

    @property
    def family(self) -> ModelFamily:
        """The model family of the run's preset (:func:`reference_impl.families.family_of`)."""
        return family_of(get_preset(self.preset))

    @property
    def model(self) -> Any:
        """The preset's config with this run's layer count and the knobs its family applies (the DSA
        family: the MLA scale format, the indexer pattern and, with ``cpu_widths``, tiny's widths)."""
        cfg = get_preset(self.preset)
        cfg = cfg.with_layers(self.n_layers) if self.n_layers is not None else cfg
        return family_of(cfg).model_for_run(cfg, self)

    def replace(self, **changes: object) -> RunConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def knob_names(field_name: str) -> tuple[str, str, str]:
    """The three spellings of a knob: config field, CLI flag, environment variable."""
    return field_name, "--" + field_name.replace("_", "-"), ENV_PREFIX + field_name.upper()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_value(field_name: str) -> str | None:
    """The raw value of a knob's environment variable (``DSACP_<FIELD>``), or ``None`` when unset."""
    return os.environ.get(knob_names(field_name)[2])


def env_flag(field_name: str, default: bool = False) -> bool:
    """Read a boolean knob from its environment variable: ``1/true/yes/on`` or ``0/false/no/off``
    (any case); anything else, the empty string included, is a :class:`ConfigError` naming the
    variable, never a silent false."""
    value = env_value(field_name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{knob_names(field_name)[2]}={value!r}: use 1/0, true/false, yes/no or on/off")


def env_choice(field_name: str, choices: tuple[str, ...], default: str) -> str:
    """Read an enumerated knob from its environment variable: one of ``choices`` exactly (surrounding
    blanks ignored); anything else, the empty string included, is a :class:`ConfigError` naming the
    variable and the choices."""
    value = env_value(field_name)
    if value is None:
        return default
    if value.strip() not in choices:
        raise ConfigError(f"{knob_names(field_name)[2]}={value!r}: use {_one_of(choices)}")
    return value.strip()


def env_int(
    field_name: str, default: int | None, minimum: int = 1, maximum: int | None = None, why: str = ""
) -> int | None:
    """Read an integer knob from its environment variable, within ``[minimum, maximum]``; anything
    else, the empty string included, is a :class:`ConfigError` naming the variable (``why`` says
    where the maximum comes from)."""
    value = env_value(field_name)
    if value is None:
        return default
    name = knob_names(field_name)[2]
    try:
        number = ascii_int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r}: need an integer >= {minimum}") from None
    if number < minimum:
        raise ConfigError(f"{name}={value!r}: need an integer >= {minimum}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name}={value!r}: at most {maximum}{f' ({why})' if why else ''}")
    return number


@dataclass(frozen=True)
class EnvKnob:
    """A knob the library reads from its environment variable where it is used (not only the CLI).

    One entry of :data:`LIBRARY_ENV` per knob: a boolean (``default`` a bool, read by
    :func:`env_flag`), an enumerated knob (``choices``, read by :func:`env_choice`) or an integer
    (``default`` an int or ``None``, read by :func:`env_int` within ``[minimum, maximum()]``).
    :func:`check_environment` reads every one that is set, so a bad value is refused by name before
    any work starts, also where the code that reads it would never run (a GPU-only knob on a CPU).
    A new library knob is one :func:`EnvKnob.register` call next to its reader, plus its row in
    ``docs/knobs.md``.
    """

    field: str
    default: bool | str | int | None
    choices: tuple[str, ...] = ()
    minimum: int = 1
    maximum: Callable[[], tuple[int, str]] | None = None  # (bound, why) from the machine

    def read(self) -> bool | str | int | None:
        """The knob's value: its environment variable, parsed and checked, or ``default``."""
        if isinstance(self.default, bool):
            return env_flag(self.field, self.default)
        if self.choices:
            return env_choice(self.field, self.choices, str(self.default))
        bound, why = self.maximum() if self.maximum is not None else (None, "")
        return env_int(self.field, self.default, self.minimum, bound, why)  # type: ignore[arg-type]

    def register(self) -> EnvKnob:
        LIBRARY_ENV[self.field] = self
        return self


LIBRARY_ENV: dict[str, EnvKnob] = {}
"""Every knob the library reads from its environment variable, by field name (:class:`EnvKnob`);
:func:`check_environment` checks each one that is set."""


def env_knob(field_name: str) -> bool | str | int | None:
    """The value of the library knob ``field_name`` (registered in :data:`LIBRARY_ENV`)."""
    return LIBRARY_ENV[field_name].read()


def check_environment() -> None:
    """Refuse every set library variable (:data:`LIBRARY_ENV`) whose value is outside its set, by name."""
    for knob in LIBRARY_ENV.values():
        knob.read()


def _cores() -> tuple[int, str]:
    cores = cpu_cores()
    return cores, f"this machine has {cores} core{'s' * (cores != 1)}"


for _knob in (
    EnvKnob("debug", False),
    EnvKnob("force_torch", False),
    EnvKnob("no_gluon", False),
    EnvKnob("no_gluon_ws", False),
    EnvKnob("triton_topk", True),
    EnvKnob("fused_bound", False),
    EnvKnob("no_fused_glue", False),
    EnvKnob("notebook_smoke", False),
    EnvKnob("rank_threads", None, maximum=_cores),
    EnvKnob("fp8_projections", False),
):
    _knob.register()


def compute_dtype(run: RunConfig, device: torch.device) -> torch.dtype:
    """The run's compute dtype on ``device``. ``auto``: float32 on CPU (tight oracle agreement), bfloat16 on
    CUDA (the real model's)."""
    import torch  # here, not at the top: configuration code imports this module without torch

    if run.compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[run.compute_dtype]
