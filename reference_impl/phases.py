"""The phase set: which of the eight phases a run enables, with their prerequisites.

Phases are cumulative levels (``PhaseSet.level(k)`` = phases 1..k) or explicit sets; an impossible
combination is a :class:`~reference_impl.errors.ConfigError` naming the missing prerequisite.
Code asks a phase set by name (``phases.sharded_kv``), never by number.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from reference_impl.errors import ConfigError


class Phase(IntEnum):
    """The eight phases, by what they add (the number is the phase's place in the cumulative order)."""

    NARROW_OUTPUT = 1  # the tail gathers only the rows downstream needs
    SHARDED_KV = 2  # KV sharded at rest, full view materialized per layer
    CURRENT_REUSE = 3  # the gathered current chunk fills the view; only history is materialized
    PAGE_ALIGNED = 4  # zigzag block boundaries on absolute page boundaries
    COMPUTE_OWNER = 5  # new pages in their compute rank's lane, written directly
    SORT_FREE_REMAP = 6  # device-resident metadata: no host sync in the layer loop, page-inverse remap
    FUSED_KERNELS = 7  # Triton store, rerange and materialize
    PREFETCH = 8  # one-layer-ahead history prefetch on a side stream


PHASE_NAMES: dict[int, str] = {
    1: "narrow output collection",
    2: "KV sharded at rest",
    3: "current-chunk reuse",
    4: "page-aligned split",
    5: "compute-owner layout",
    6: "sync-free layer loop",
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

# The in-seq split's own phases: round-robin refuses them (its interleave-1 shards already give
# every rank the tokens it computes).
IN_SEQ_ONLY: frozenset[int] = frozenset({Phase.PAGE_ALIGNED, Phase.COMPUTE_OWNER})

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
                f"phase(s) {not_built} are not implemented in this version; available: {sorted(IMPLEMENTED_PHASES)}"
            )

    @classmethod
    def level(cls, k: int) -> PhaseSet:
        """Cumulative phase level ``k``: phases 1..k on (level 0 is the baseline)."""
        if not isinstance(k, int) or isinstance(k, bool):
            hint = f" (a spec string: PhaseSet.parse({k!r}))" if isinstance(k, str) else ""
            raise ConfigError(f"phase level {k!r}: need an int 0..8, got {type(k).__name__}{hint}")
        if not 0 <= k <= 8:
            raise ConfigError(f"phase level {k} is out of range 0..8")
        return cls(frozenset(range(1, k + 1)))

    @classmethod
    def parse(cls, spec: str) -> PhaseSet:
        """Parse ``"3"`` (a level), ``"1,3"`` or ``"+2,+3"`` (explicit phases), ``"0"``/``"baseline"``
        (no phase). An empty spec, or an empty entry (``"1,,2"``, ``"1,"``, ``","``), is refused."""
        if not isinstance(spec, str):
            raise ConfigError(f"phase spec {spec!r}: need a string like '3' or '1,2', got {type(spec).__name__}")
        spec = spec.strip()
        if not spec:
            raise ConfigError("phase spec is empty: use 0 (baseline), a level 1..8 or a list like '1,2'")
        if spec in ("0", "baseline"):
            return cls()
        try:
            if "," in spec or spec.startswith("+"):
                items = [p.strip() for p in spec.split(",")]
                empty = [i for i, p in enumerate(items, 1) if not p.lstrip("+")]
                if empty:
                    raise ConfigError(f"phase spec {spec!r}: entry {empty[0]} is empty (doubled or trailing comma?)")
                return cls(frozenset(int(p.lstrip("+")) for p in items))
            return cls.level(int(spec))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed phase spec {spec!r}: use a level 0..8 or a list like '1,2'") from None

    def for_split(self, split_mode: str) -> PhaseSet:
        """These phases as ``split_mode`` runs them: round-robin drops :data:`IN_SEQ_ONLY`."""
        return PhaseSet(self.enabled - IN_SEQ_ONLY) if split_mode == "round-robin" else self

    def __contains__(self, phase: object) -> bool:
        return phase in self.enabled

    @property
    def narrow_output(self) -> bool:
        """Phase 1: the tail all-gather moves only the rows downstream needs."""
        return Phase.NARROW_OUTPUT in self.enabled

    @property
    def sharded_kv(self) -> bool:
        """Phase 2: each rank stores only the pages it owns; the full view is materialized per layer."""
        return Phase.SHARDED_KV in self.enabled

    @property
    def current_reuse(self) -> bool:
        """Phase 3: the current chunk comes from the all-gather; only history is materialized."""
        return Phase.CURRENT_REUSE in self.enabled

    @property
    def page_aligned(self) -> bool:
        """Phase 4: the zigzag blocks end on absolute page boundaries."""
        return Phase.PAGE_ALIGNED in self.enabled

    @property
    def compute_owner(self) -> bool:
        """Phase 5: new pages are allocated in their compute rank's lane and written directly."""
        return Phase.COMPUTE_OWNER in self.enabled

    @property
    def sort_free_remap(self) -> bool:
        """Phase 6: device-resident metadata (no host sync in the layer loop, audited) and the page-inverse remap."""
        return Phase.SORT_FREE_REMAP in self.enabled

    @property
    def fused_kernels(self) -> bool:
        """Phase 7: the fused Triton store, rerange and materialize."""
        return Phase.FUSED_KERNELS in self.enabled

    @property
    def prefetch(self) -> bool:
        """Phase 8: one-layer-ahead prefetch of the history MLA KV."""
        return Phase.PREFETCH in self.enabled

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
