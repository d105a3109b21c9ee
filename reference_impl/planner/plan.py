"""The plan: the planner's knobs (:class:`PlannerConfig`) and the predictions for every phase level.

:func:`plan_capacity` turns a :class:`PlannerConfig` and the rates into a JSON-ready dict: per level,
the longest request whose KV fits the budget and, per context, KV and transient bytes per rank and
the slowest rank's layer time with its terms (:func:`~reference_impl.planner.model.layer_terms`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from reference_impl.config import (
    KV_DTYPES,
    MAX_HBM_GIB,
    MAX_PLAN_CP,
    SPLIT_MODES,
    ConfigError,
    KVDtype,
    check_choice,
    validate_page_size,
)
from reference_impl.cp.capacity import index_bytes_per_rank, kv_bytes_per_rank, max_context_per_rank, page_bytes
from reference_impl.families import family_of
from reference_impl.phases import IMPLEMENTED_PHASES, IN_SEQ_ONLY, PHASE_NAMES
from reference_impl.planner.model import (
    activation_bytes,
    layer_terms,
    local_queries,
    projection_macs,
    slowest_rank,
    tail_ms,
    transient_bytes,
)
from reference_impl.planner.rates import PlannerRates
from reference_impl.presets import ModelConfig, get_preset

GIB = 2**30
DEFAULT_RESERVED_GIB = 93.0
DEFAULT_CONTEXTS = (8192, 131072, 1048576)
LEVELS = tuple(range(9))


def level_status(level: int) -> str:
    """``"built"`` when every phase of the cumulative level exists in this version."""
    return "built" if set(range(1, level + 1)) <= IMPLEMENTED_PHASES else "predicted, not built"


MAX_CONTEXT = 1 << 27  # 128M tokens: far past any model's window; the planner walks pages one by one


def parse_contexts(spec: str, name: str = "contexts") -> tuple[int, ...]:
    """``"8192,128K,1M"`` -> ``(8192, 131072, 1048576)`` (``K`` = 1024, ``M`` = 1024^2); errors name
    ``name`` (the CLI passes its flag or variable)."""
    if not isinstance(spec, str):
        raise ConfigError(f"{name}={spec!r}: need a string like '8192,128K,1M'")
    out = []
    if not spec.strip():
        raise ConfigError(f"{name} is empty")
    for position, item in enumerate((s.strip() for s in spec.split(",")), 1):
        if not item:
            raise ConfigError(f"{name} {spec!r}: entry {position} is empty (doubled or trailing comma?)")
        scale = {"k": 1024, "m": 1024**2}.get(item[-1].lower(), 1)
        try:
            out.append(int(item[:-1] if scale > 1 else item) * scale)
        except ValueError:
            raise ConfigError(f"malformed context {item!r} in {name}: use integers like 8192, 128K or 1M") from None
        if not 0 < out[-1] <= MAX_CONTEXT:
            raise ConfigError(f"{name}: {item} tokens is outside 1 .. {MAX_CONTEXT:,} (128M)")
    return tuple(out)


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's knobs (each field is a CLI flag ``--field-name`` and ``DSACP_FIELD_NAME``).

    The KV budget per GPU is ``hbm_gib - reserved_gib`` GiB, or ``hbm_gib x kv_budget_fraction``
    when the fraction is given (then ``reserved_gib`` must be ``None``). ``reserved_gib`` stands for
    weights, activations and workspace; ``None`` for both means ``DEFAULT_RESERVED_GIB`` (93).
    """

    preset: str = "deepseek-v3.2"
    cp_size: int = 8
    hbm_gib: float = 141.0
    reserved_gib: float | None = None
    kv_budget_fraction: float | None = None
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    kv_dtype: KVDtype = "fp8"
    page_size: int = 64
    split_mode: str = "in-seq"  # round-robin: KV sharded at interleave 1, no phases 4 and 5
    # IndexShare: F / S per layer (reference_impl.index_share); None: the preset's pattern
    index_topk_pattern: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        cfg = get_preset(self.preset)
        if not isinstance(cfg, ModelConfig):  # this planner models the DSA cache; another family plans elsewhere
            raise ConfigError(
                f"{self.preset}: its capacity terms are in `{family_of(cfg).planner_command} --preset {self.preset}`"
            )
        _ = self.model  # the pattern against the preset's layer count, by name
        check_choice("split_mode", self.split_mode, SPLIT_MODES)
        check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        if not 1 <= self.cp_size <= MAX_PLAN_CP:
            raise ConfigError(f"cp_size={self.cp_size}: need 1 <= cp_size <= {MAX_PLAN_CP:,} ranks")
        for name in ("hbm_gib", "reserved_gib"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value <= MAX_HBM_GIB):
                raise ConfigError(f"{name}={value!r}: need a finite number of GiB, at most {MAX_HBM_GIB:,} (1 PiB)")
        if not self.hbm_gib > 0:
            raise ConfigError(f"hbm_gib={self.hbm_gib}: HBM per GPU must be a positive number of GiB")
        if self.reserved_gib is not None and self.kv_budget_fraction is not None:
            raise ConfigError("give reserved_gib or kv_budget_fraction, not both")
        if self.kv_budget_fraction is not None and not 0 < self.kv_budget_fraction <= 1:
            raise ConfigError(f"kv_budget_fraction={self.kv_budget_fraction}: need a fraction in (0, 1]")
        if self.reserved_gib is not None and self.reserved_gib < 0:
            raise ConfigError(f"reserved_gib={self.reserved_gib}: need >= 0 GiB")
        if self.kv_budget_fraction is None and self.reserved >= self.hbm_gib:
            raise ConfigError(
                f"reserved_gib={self.reserved:g} (weights, activations) is not below hbm_gib={self.hbm_gib:g}: "
                "no HBM left for the KV cache"
            )
        validate_page_size(self.page_size)
        large = [c for c in self.contexts if c > MAX_CONTEXT]
        if large:
            raise ConfigError(f"contexts {large}: at most {MAX_CONTEXT:,} tokens (128M)")
        small = [c for c in self.contexts if c < 2 * self.cp_size]
        if not self.contexts or small:
            raise ConfigError(f"contexts {small or '()'}: each needs at least 2C = {2 * self.cp_size} tokens")

    def _check_types(self) -> None:
        """Wrong types fail here, by name (a list of contexts becomes a tuple)."""
        if isinstance(self.contexts, list):
            object.__setattr__(self, "contexts", tuple(self.contexts))
        if isinstance(self.contexts, str):
            raise ConfigError(
                f"contexts={self.contexts!r}: need a tuple of ints (from a spec string: "
                f"parse_contexts({self.contexts!r}))"
            )
        if not isinstance(self.contexts, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in self.contexts
        ):
            raise ConfigError(f"contexts={self.contexts!r}: need a tuple of ints (tokens)")
        for name, kinds, optional in (
            ("preset", (str,), False),
            ("split_mode", (str,), False),
            ("kv_dtype", (str,), False),
            ("cp_size", (int,), False),
            ("page_size", (int,), False),
            ("hbm_gib", (int, float), False),
            ("reserved_gib", (int, float), True),
            ("kv_budget_fraction", (int, float), True),
            ("index_topk_pattern", (str,), True),
        ):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if not isinstance(value, kinds) or isinstance(value, bool):
                need = "a number" if float in kinds else f"an {kinds[0].__name__}" if kinds[0] is int else "a str"
                raise ConfigError(f"{name}={value!r}: need {need}, got {type(value).__name__}")

    @property
    def model(self) -> ModelConfig:
        """The preset, with ``index_topk_pattern`` when given."""
        cfg = get_preset(self.preset)
        return dataclasses.replace(cfg, index_topk_pattern=self.index_topk_pattern) if self.index_topk_pattern else cfg

    @property
    def reserved(self) -> float:
        return DEFAULT_RESERVED_GIB if self.reserved_gib is None else self.reserved_gib

    @property
    def kv_budget_bytes(self) -> int:
        if self.kv_budget_fraction is not None:
            return int(self.hbm_gib * self.kv_budget_fraction * GIB)
        return int((self.hbm_gib - self.reserved) * GIB)

    @property
    def budget_rule(self) -> str:
        if self.kv_budget_fraction is not None:
            return f"{self.hbm_gib:g} GiB HBM x {self.kv_budget_fraction:g}"
        default = " (default)" if self.reserved_gib is None else ""
        return f"{self.hbm_gib:g} GiB HBM - {self.reserved:g} GiB reserved for weights and activations{default}"


def plan_capacity(config: PlannerConfig, rates: PlannerRates) -> dict[str, Any]:
    """Predictions for every phase level 0..8 at every context -> a JSON-ready dict.

    Per level: ``max_context`` (tokens of one request whose KV fits the budget on every rank) and,
    per context, ``kv_bytes_per_rank``, ``transient_bytes_per_layer``, ``fits`` (KV + transient
    within the budget), ``layer_ms`` with its ``terms_ms`` on ``slowest_rank``, and
    ``tail_ms_per_forward``.
    """
    if not isinstance(config, PlannerConfig):
        raise ConfigError(f"config={config!r:.80}: need a PlannerConfig")
    if not isinstance(rates, PlannerRates):
        raise ConfigError(f"rates={rates!r:.80}: need PlannerRates (reference_impl.load_rates())")
    cfg, c, dt, ps = config.model, config.cp_size, config.kv_dtype, config.page_size
    share = cfg.index_share
    mode = config.split_mode
    interleave = 1 if mode == "round-robin" else None  # round-robin shards at interleave 1
    budget = config.kv_budget_bytes
    levels = []
    for level in LEVELS:
        if mode == "round-robin" and level in IN_SEQ_ONLY:
            continue  # the in-seq split's phases: round-robin's levels are 0-3 and 6-8
        sharded = level >= 2
        points = []
        for ctx in config.contexts:
            rank, terms = slowest_rank(cfg, rates, c, ctx, level, dt, ps, mode)
            kv = kv_bytes_per_rank(cfg, ctx, c, sharded, dt, ps, interleave=interleave)
            index = index_bytes_per_rank(cfg, ctx, c, sharded, dt, ps, interleave=interleave)
            transient = transient_bytes(cfg, ctx, level, dt, ps, cp_size=c, interleave=interleave if sharded else None)
            t_local = local_queries(ctx, c, ps, level, rank, mode)
            points.append(
                {
                    "context": ctx,
                    "kv_bytes_per_rank": kv,
                    "index_bytes_per_rank": index,
                    "transient_bytes_per_layer": transient,
                    "activation_bytes_per_layer": activation_bytes(cfg, t_local, ctx),
                    "fits": kv + transient <= budget,
                    "layer_ms": sum(terms.values()),
                    "slowest_rank": rank,
                    "terms_ms": terms,
                    "tail_ms_per_forward": tail_ms(cfg, rates, c, ctx, level, ps),
                }
            )
            if share.shares:  # IndexShare: layer_ms is the mean over the layers; each kind apart
                points[-1]["layer_ms_by_kind"] = {
                    kind: sum(layer_terms(cfg, rates, c, ctx, level, rank, dt, ps, mode, indexer=full).values())
                    for kind, full in (("full", True), ("shared", False))
                }
        levels.append(
            {
                "level": level,
                "adds": PHASE_NAMES.get(level, "baseline"),
                "status": level_status(level),
                "kv_at_rest": "sharded" if sharded else "replicated",
                "max_context": max_context_per_rank(cfg, budget, c, sharded, dt, ps),
                "contexts": points,
            }
        )
    return {
        "inputs": {
            **dataclasses.asdict(config),
            "reserved_gib": None if config.kv_budget_fraction else config.reserved,
            "kv_budget_bytes": budget,
            "budget_rule": config.budget_rule,
            "n_layers": cfg.n_layers,
            "index_layers": share.n_full,
            "index_pattern": share.pattern,
            "page_bytes": page_bytes(cfg, dt, ps),
            "max_seq_len": cfg.max_seq_len,
        },
        "rates": {k: {"value": v, "source": rates.sources[k]} for k, v in rates.values().items()},
        "scenario": f"one request of S tokens prefilled in one chunk (no prefix), {mode} split; slowest rank",
        "assumptions": _assumptions(config, cfg),
        "levels": levels,
    }


def _assumptions(config: PlannerConfig, cfg: ModelConfig) -> list[str]:
    out = [
        f"KV budget: {config.budget_rule}; the reserved part is not modeled, only subtracted.",
        (
            "Terms are added: no overlap of compute and communication. Not modeled: the MoE/MLP half of the layer, "
            "norms, RoPE, Hadamard and q quantization, launch overheads."
        ),
        (
            f"Projections: {sum(projection_macs(cfg).values()):,} multiply-adds per token at the bf16 8192^3 matmul "
            "rate (skinny or FP8 GEMMs run at other rates)."
        ),
        "Top-k and remap scale linearly from their measured points (T_local x S, and T).",
        (
            "Levels 0-1 rebuild the full view from the local replica; from level 3 it is filled from the gathered "
            "chunk (no history), so phase 8 has nothing to prefetch and level 8 equals level 7."
        ),
        (
            "Level >= 7: fused rerange and stores; the full-view fill from the gathered chunk stays on the torch "
            "path, as in this package."
        ),
        (
            "Levels 2-5 remap with sort + searchsorted per layer (the production baseline phase 6 replaces; "
            "this package computes locs arithmetically)."
        ),
    ]
    if config.kv_dtype == "bf16":
        out.append("The full-view build of a bf16 cache runs at the measured fp8 materialize rate (bf16 not measured).")
    if max(config.contexts) > cfg.max_seq_len:
        out.append(
            f"Contexts above the preset's max_seq_len ({cfg.max_seq_len:,}) exceed the model's trained context; "
            "the arithmetic still holds."
        )
    return out
