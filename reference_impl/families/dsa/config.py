"""The DSA family's config type and presets (the registry reads ``CONFIG_TYPE`` and ``PRESETS``)."""

from __future__ import annotations

from reference_impl.presets import PRESETS, ModelConfig

CONFIG_TYPE = ModelConfig

__all__ = ["CONFIG_TYPE", "PRESETS"]
