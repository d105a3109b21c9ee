"""Configuration: model presets, the phase set, and the run configuration.

Every knob has one name. The config field ``cp_size`` is the CLI flag ``--cp-size`` and the
environment variable ``DSACP_CP_SIZE``; :func:`knob_names` spells the three forms and
``docs/knobs.md`` lists them all.

Errors for impossible configurations are :class:`ConfigError` (a ``ValueError``) with a message
that names the problem; the CLI turns them into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Literal

KVDtype = Literal["bf16", "fp8"]
SplitMode = Literal["in-seq", "round-robin"]

ENV_PREFIX = "DSACP_"


class ConfigError(ValueError):
    """A configuration or input that the reference implementation refuses, with the reason."""


# --------------------------------------------------------------------------------------------
# Model presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and semantics of one DSA attention layer (MLA + lightning indexer).

    Field names follow DeepSeek-V3.2's ``ModelArgs`` where one exists.
    """

    name: str
    n_layers: int
    dim: int  # hidden size
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_rope_interleaved: bool  # False for DeepSeek-V3.2 (fixed 2025-11), True for GLM-5
    index_scale_fmt: Literal["ue8m0", "fp32"] = "ue8m0"  # FP8 scales of indexer q/k
    vocab_size: int = 129280  # only the logits of collected output rows use it
    rope_theta: float = 10000.0
    rope_factor: float = 40.0  # YaRN factor; 1.0 disables YaRN
    original_seq_len: int = 4096
    max_seq_len: int = 163840
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kv_lora_rank % 128:
            raise ConfigError(
                f"kv_lora_rank={self.kv_lora_rank} is not a multiple of 128: the packed FP8 layout "
                "keeps one scale per 128 latent values"
            )
        if self.index_head_dim % 128 or self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError(
                f"index_head_dim={self.index_head_dim} must be a power of two and a multiple of 128 "
                "(Hadamard rotation, FP8 block 128)"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit the indexer head")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Width of one token's MLA cache entry before quantization: latent + rope (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        if self.max_seq_len <= self.original_seq_len or self.rope_factor <= 1.0:
            return 1.0
        return 0.1 * self.mscale * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale ``qk_head_dim^-0.5 * mscale^2`` (192^-0.5 * mscale^2 for V3.2)."""
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    def with_layers(self, n_layers: int) -> "ModelConfig":
        return dataclasses.replace(self, n_layers=n_layers)


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3.2": ModelConfig(
        name="deepseek-v3.2",
        n_layers=61,
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        index_rope_interleaved=False,
    ),
    # GLM-5 shares the DSA layer; RoPE settings below are placeholders that only move positions
    # (override them from the checkpoint's config): no layout or CP logic depends on them.
    "glm-5": ModelConfig(
        name="glm-5",
        n_layers=78,
        dim=6144,
        n_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        index_rope_interleaved=True,
        vocab_size=154880,
        rope_theta=1_000_000.0,
        rope_factor=1.0,
        max_seq_len=202752,
    ),
    # Small enough for CPU tests, big enough that top-k (32) selects a strict subset.
    "tiny": ModelConfig(
        name="tiny",
        n_layers=2,
        dim=256,
        n_heads=4,
        q_lora_rank=96,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        index_n_heads=16,  # enough heads that ReLU-zero index scores (exact ties) are rare
        index_head_dim=128,
        index_topk=32,
        index_rope_interleaved=False,
        vocab_size=512,
        rope_factor=4.0,
        original_seq_len=64,
        max_seq_len=8192,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Look a preset up by name; an unknown name is a :class:`ConfigError` listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------

PHASE_NAMES: dict[int, str] = {
    1: "narrow output collection",
    2: "KV sharded at rest",
    3: "current-chunk reuse",
    4: "page-aligned split",
    5: "compute-owner layout",
    6: "sort-free remap",
    7: "fused Triton kernels",
    8: "one-layer-ahead prefix prefetch",
}

# Each phase's hard prerequisites (other phases that must be on).
PHASE_REQUIRES: dict[int, frozenset[int]] = {
    1: frozenset(),
    2: frozenset(),
    3: frozenset({2}),
    4: frozenset(),
    5: frozenset({2, 4}),
    6: frozenset({2}),
    7: frozenset(),
    8: frozenset({2, 3}),
}

# Phases whose code exists in this version of the package; asking for another is refused.
IMPLEMENTED_PHASES: frozenset[int] = frozenset({1, 2, 3, 4, 5, 6, 7, 8})


@dataclass(frozen=True)
class PhaseSet:
    """A set of enabled phases (1..8), validated against :data:`PHASE_REQUIRES`."""

    enabled: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        unknown = sorted(p for p in self.enabled if p not in PHASE_NAMES)
        if unknown:
            raise ConfigError(f"unknown phase(s) {unknown}; phases are 1..8")
        for p in sorted(self.enabled):
            missing = sorted(PHASE_REQUIRES[p] - self.enabled)
            if missing:
                raise ConfigError(
                    f"phase {p} ({PHASE_NAMES[p]}) needs phase(s) {missing} "
                    f"({', '.join(PHASE_NAMES[m] for m in missing)}) enabled"
                )

    def check_implemented(self) -> None:
        """Refuse phases whose code does not exist in this version."""
        not_built = sorted(self.enabled - IMPLEMENTED_PHASES)
        if not_built:
            raise ConfigError(
                f"phase(s) {not_built} are not implemented in this version; available: "
                f"{sorted(IMPLEMENTED_PHASES)}"
            )

    @classmethod
    def level(cls, k: int) -> "PhaseSet":
        """Cumulative phase level ``k``: phases 1..k on (level 0 is the baseline)."""
        if not 0 <= k <= 8:
            raise ConfigError(f"phase level {k} is out of range 0..8")
        return cls(frozenset(range(1, k + 1)))

    @classmethod
    def parse(cls, spec: str) -> "PhaseSet":
        """Parse ``"3"`` (a level), ``"1,3"`` or ``"+2,+3"`` (explicit phases), ``""``/``"0"`` (baseline)."""
        spec = spec.strip()
        if spec in ("", "0", "baseline"):
            return cls()
        try:
            if "," in spec or spec.startswith("+"):
                return cls(frozenset(int(p.strip().lstrip("+")) for p in spec.split(",") if p.strip()))
            return cls.level(int(spec))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed phase spec {spec!r}: use a level 0..8 or a list like '1,2'") from None

    def __contains__(self, phase: object) -> bool:
        return phase in self.enabled

    def __str__(self) -> str:
        return ",".join(str(p) for p in sorted(self.enabled)) or "0"

    @property
    def max_level(self) -> int:
        """The largest k such that phases 1..k are all on."""
        k = 0
        while k + 1 in self.enabled:
            k += 1
        return k


def available_levels() -> list[int]:
    """Cumulative phase levels whose phases are all implemented."""
    levels = [0]
    while levels[-1] + 1 in IMPLEMENTED_PHASES:
        levels.append(levels[-1] + 1)
    return levels


# --------------------------------------------------------------------------------------------
# Requests and run configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request of a prefill batch: ``prefix`` tokens already cached, ``extend`` tokens to compute."""

    prefix: int
    extend: int

    def __post_init__(self) -> None:
        if self.prefix < 0 or self.extend <= 0:
            raise ConfigError(f"request prefix={self.prefix} extend={self.extend}: need prefix >= 0 and extend >= 1")

    @property
    def total(self) -> int:
        return self.prefix + self.extend


def parse_requests(spec: str) -> list[Request]:
    """Parse ``"0+128,64+200"`` (prefix+extend pairs) or ``"128,200"`` (extend only)."""
    requests: list[Request] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split("+")
        try:
            if len(parts) == 1:
                requests.append(Request(0, int(parts[0])))
            elif len(parts) == 2:
                requests.append(Request(int(parts[0]), int(parts[1])))
            else:
                raise ValueError
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"malformed request {item!r}: use PREFIX+EXTEND (e.g. 64+128) or EXTEND, comma separated"
            ) from None
    if not requests:
        raise ConfigError(f"malformed request spec {spec!r}: no requests")
    return requests


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
    n_layers: int | None = None  # None: the preset's layer count
    chunk_size: int | None = None  # chunked prefill: extend tokens per request per chunk (None: one chunk)
    seed: int = 0
    debug: bool = False
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    compute_dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "fp32" | "bf16"
    check: bool = True  # compare with the single-device oracle
    backend: str = "auto"  # "auto" | "gloo" | "nccl"
    # Per-request output needs (phase 1 eligibility): any True forces the full tail gather.
    return_hidden_states: bool = False
    input_logprobs: bool = False

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if self.cp_size < 1:
            raise ConfigError(f"cp_size={self.cp_size}: need at least one rank")
        if self.kv_dtype not in ("bf16", "fp8"):
            raise ConfigError(f"kv_dtype={self.kv_dtype!r}: use 'bf16' or 'fp8'")
        if self.split_mode not in ("in-seq", "round-robin"):
            raise ConfigError(f"split_mode={self.split_mode!r}: use 'in-seq' or 'round-robin'")
        from reference_impl.kvcache.layout import validate_page_size

        validate_page_size(self.page_size)
        if not self.requests:
            raise ConfigError("a batch needs at least one request")
        if self.split_mode == "round-robin" and 4 in self.phases:
            raise ConfigError("round-robin split cannot run phase 4 (page-aligned split): it is an in-seq split; use --split-mode in-seq")
        sharded = {2, 3, 5, 6, 8} & self.phases.enabled
        if self.split_mode == "round-robin" and sharded:
            raise ConfigError(
                f"round-robin split cannot run shared-KV phases {sorted(sharded)}: its materialization and "
                "PD-transfer contracts are not wired; use --split-mode in-seq"
            )
        if self.compute_dtype not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"compute_dtype={self.compute_dtype!r}: use 'auto', 'fp32' or 'bf16'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda'")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend={self.backend!r}: use 'auto', 'gloo' or 'nccl'")
        if self.n_layers is not None and self.n_layers < 1:
            raise ConfigError(f"n_layers={self.n_layers}: need at least one layer")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"chunk_size={self.chunk_size}: need at least one token per chunk")
        self.phases.check_implemented()

    @property
    def model(self) -> ModelConfig:
        cfg = get_preset(self.preset)
        return cfg.with_layers(self.n_layers) if self.n_layers is not None else cfg

    def replace(self, **changes: object) -> "RunConfig":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def knob_names(field_name: str) -> tuple[str, str, str]:
    """The three spellings of a knob: config field, CLI flag, environment variable."""
    return field_name, "--" + field_name.replace("_", "-"), ENV_PREFIX + field_name.upper()


def env_flag(field_name: str, default: bool = False) -> bool:
    """Read a boolean knob from its environment variable (``1/true/yes/on`` are true)."""
    value = os.environ.get(knob_names(field_name)[2])
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
