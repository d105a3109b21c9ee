"""IndexShare: the lightning indexer runs on "full" layers only; a "shared" layer reuses the top-k of
the nearest full layer before it (GLM-5.2).

Semantics, as Hugging Face ``transformers`` 5.25 implements them in ``glm_moe_dsa``:

* ``GlmMoeDsaConfig.indexer_types`` lists ``"full"`` / ``"shared"`` per layer. Without it the
  config derives it from ``index_topk_pattern`` (a string, ``F`` / ``S`` per layer) or else from
  ``index_topk_freq`` and ``index_skip_topk_offset``: layer ``i`` is full when
  ``max(i - offset + 1, 0) % freq == 0`` (:func:`pattern_from_freq`).
* ``GlmMoeDsaAttention``: a shared layer has no indexer (no parameters, no index K cache) and takes
  ``prev_topk_indices``, the top-k the previous layer returned, which is the last full layer's; a
  shared layer with no full layer before it is an error.

This module holds the pattern and every decision that follows from it: which layers project,
gather, store and materialize indexer K (:meth:`IndexShare.is_full`), whose top-k a shared layer
reuses (:meth:`IndexShare.source`), and which row of a pool's index buffer holds a full layer's
keys (:meth:`IndexShare.index_slot`). The model, the KV layouts, the stores and the planner ask it;
the engine only passes the previous layer's top-k along.

Without a pattern every layer is full, which is DeepSeek-V3.2 and GLM-5.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference_impl.errors import ConfigError

FULL, SHARED = "F", "S"


def pattern_from_freq(n_layers: int, freq: int, offset: int) -> str:
    """The pattern ``GlmMoeDsaConfig`` derives from ``index_topk_freq`` and ``index_skip_topk_offset``:
    layer ``i`` is full when ``max(i - offset + 1, 0) % freq == 0`` (``freq <= 1``: every layer)."""
    if n_layers < 1:
        raise ConfigError(f"n_layers={n_layers}: need at least one layer")
    if offset < 0:
        raise ConfigError(f"index_skip_topk_offset={offset} must be >= 0")
    freq = max(freq, 1)
    return "".join(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n_layers))


def check_pattern(pattern: str, n_layers: int, what: str = "index_topk_pattern") -> str:
    """``pattern`` (surrounding blanks dropped), after checking it: one ``F`` or ``S`` per layer, the first ``F``.

    :class:`ConfigError` names what is wrong (a foreign letter, the length, a leading shared layer).
    The letters are upper case, exactly: every enumerated knob takes its values' exact spelling.
    """
    if not isinstance(pattern, str):
        raise ConfigError(f"{what}={pattern!r}: need a string of F (full) and S (shared), one letter per layer")
    text = pattern.strip()
    bad = sorted({c for c in text if c not in (FULL, SHARED)})
    if not text or bad:
        raise ConfigError(
            f"{what}={pattern!r}: use one letter per layer, F (runs the indexer) or S (reuses the previous F "
            f"layer's top-k), upper case" + (f"; found {', '.join(map(repr, bad))}" if bad else "")
        )
    if len(text) != n_layers:
        raise ConfigError(f"{what}={pattern!r} has {len(text)} letters for {n_layers} layers: give one per layer")
    if text[0] != FULL:
        raise ConfigError(f"{what}={pattern!r}: layer 0 is shared, but a shared layer needs a full layer before it")
    return text


@dataclass(frozen=True)
class IndexShare:
    """The indexer pattern of a model: ``pattern[i]`` is ``F`` (full) or ``S`` (shared) for layer ``i``."""

    pattern: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", check_pattern(self.pattern, len(self.pattern)))

    @classmethod
    def every_layer(cls, n_layers: int) -> IndexShare:
        """No sharing: every layer runs its indexer."""
        return cls(FULL * n_layers)

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    @property
    def shares(self) -> bool:
        """Whether any layer reuses another's top-k."""
        return SHARED in self.pattern

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers that run the indexer (and keep indexer K), ascending."""
        return tuple(i for i, c in enumerate(self.pattern) if c == FULL)

    @property
    def n_full(self) -> int:
        return self.pattern.count(FULL)

    def is_full(self, layer: int) -> bool:
        """Whether ``layer`` runs the indexer: projects, gathers, stores and materializes indexer K."""
        self._check(layer)
        return self.pattern[layer] == FULL

    def source(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` uses: itself when full, else the nearest full layer before it."""
        self._check(layer)
        return self.pattern.rindex(FULL, 0, layer + 1)

    def index_slot(self, layer: int) -> int:
        """The row of an index buffer that stores only full layers (``[n_full, ...]``) holding ``layer``'s keys."""
        if not self.is_full(layer):
            raise ConfigError(f"layer {layer} is shared (IndexShare pattern {self.pattern}): it keeps no indexer K")
        return self.pattern.count(FULL, 0, layer)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ConfigError(
                f"layer {layer} is outside the {self.n_layers} layers of IndexShare pattern {self.pattern}"
            )
