"""Model families behind one interface (:mod:`.base`), and the registry that maps every preset to its family.

Each family is one folder: ``families/dsa/`` (DeepSeek-V3.2, GLM-5, GLM-5.2) and
``families/deepseek_v4/`` (DeepSeek-V4). A family folder holds a light ``config`` module (its config
dataclass and presets: ``CONFIG_TYPE``, ``PRESETS``) and a ``family`` module whose ``FAMILY`` object
implements :class:`~reference_impl.families.base.ModelFamily`. The registry imports a family's
modules by name, when first asked, so that configuration code can list presets without importing
any model, and so that no module outside a family imports one.

A family defined elsewhere (a test, a plug-in) registers itself with :func:`register` in this
process; for the rank processes a run starts (which may not be forks of this one), name it in
``DSACP_FAMILIES`` as ``package.module:ATTRIBUTE`` (comma-separated), read when the registry is first used.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from reference_impl.errors import ConfigError
from reference_impl.families.base import ChunkInputs, ChunkStep, ModelFamily, RankStore

__all__ = [
    "ChunkInputs",
    "ChunkStep",
    "ModelFamily",
    "RankStore",
    "BUILTIN",
    "register",
    "unregister",
    "families",
    "family_of",
    "family_named",
    "get_preset",
    "preset_names",
    "all_presets",
    "is_model_config",
    "register_family",
    "family_presets",
]

BUILTIN: dict[str, str] = {  # family name -> its package (imported when first asked)
    "dsa": "reference_impl.families.dsa",
    "deepseek-v4": "reference_impl.families.deepseek_v4",
    "glm53": "reference_impl.families.glm53",
}


class _Entry:
    """A family's presets (light: its ``config`` module) and, loaded on first use, its ``FAMILY``."""

    def __init__(
        self,
        name: str,
        config_type: type,
        presets: dict[str, Any],
        package: str | None = None,
        family: ModelFamily | None = None,
    ) -> None:
        self.name, self.config_type, self.presets, self.package = name, config_type, presets, package
        self._family = family

    @property
    def family(self) -> ModelFamily:
        if self._family is None:
            assert self.package is not None
            self._family = importlib.import_module(f"{self.package}.family").FAMILY
        return self._family


_ENTRIES: dict[str, _Entry] = {}


PLUGINS_ENV = "DSACP_FAMILIES"  # families defined outside the package: "package.module:ATTRIBUTE,..."
_plugins_read: set[str] = set()


def _entries() -> dict[str, _Entry]:
    for name, package in BUILTIN.items():
        if name not in _ENTRIES:
            config = importlib.import_module(f"{package}.config")
            _ENTRIES[name] = _Entry(name, config.CONFIG_TYPE, dict(config.PRESETS), package)
    for spec in os.environ.get(PLUGINS_ENV, "").split(","):
        if spec.strip() and spec not in _plugins_read:
            _plugins_read.add(spec)
            family = _load_plugin(spec.strip())
            if family.name not in _ENTRIES:
                _ENTRIES[family.name] = _Entry(family.name, family.config_type, dict(family.presets), family=family)
    return _ENTRIES


def _load_plugin(spec: str) -> ModelFamily:
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise ConfigError(f"{PLUGINS_ENV}={spec!r}: need package.module:ATTRIBUTE")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{PLUGINS_ENV}={spec!r}: cannot load it ({exc})") from None


def __getattr__(name: str) -> Any:
    """``PRESETS``: every family's presets by name, read when asked (a registered family's included)."""
    if name == "PRESETS":
        return all_presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(family: ModelFamily) -> None:
    """Add a family defined outside the package (its presets become known to every entry point)."""
    entries = _entries()
    clash = sorted(set(family.presets) & {p for e in entries.values() for p in e.presets})
    if family.name in entries or clash:
        raise ConfigError(f"family {family.name!r}: its name or presets {clash} are registered already")
    entries[family.name] = _Entry(family.name, family.config_type, dict(family.presets), family=family)


def unregister(name: str) -> None:
    """Remove a family :func:`register` added (the built-in families stay)."""
    if name in BUILTIN:
        raise ConfigError(f"family {name!r} is built in; it cannot be removed")
    _ENTRIES.pop(name, None)
    _plugins_read.clear()  # a plug-in named in DSACP_FAMILIES loads again when next asked


def families() -> tuple[str, ...]:
    """Every registered family's name, the built-in ones first."""
    return tuple(_entries())


def family_named(name: str) -> ModelFamily:
    entries = _entries()
    if name not in entries:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(entries)}")
    return entries[name].family


def family_of(cfg: object) -> ModelFamily:
    """The family whose config type ``cfg`` is (a preset's config, ``run.model``, ``model.cfg``)."""
    for entry in _entries().values():
        if type(cfg) is entry.config_type:
            return entry.family
    raise ConfigError(
        f"{type(cfg).__name__} is no registered family's model config (families: {', '.join(_entries())})"
    )


def all_presets() -> dict[str, Any]:
    """Every preset of every family, by name (the built-in families' first, in their order)."""
    return {name: cfg for entry in _entries().values() for name, cfg in entry.presets.items()}


def family_presets(name: str) -> tuple[str, ...]:
    """The preset names of the family ``name`` (from its light config module: no model is imported)."""
    entries = _entries()
    if name not in entries:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(entries)}")
    return tuple(entries[name].presets)


def preset_names() -> tuple[str, ...]:
    return tuple(all_presets())


def get_preset(name: str) -> Any:
    """Look a preset up by name in every family; an unknown name is a :class:`ConfigError` listing the known ones."""
    presets = all_presets()
    if not isinstance(name, str) or name not in presets:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(presets))}")
    return presets[name]


def is_model_config(cfg: object) -> bool:
    """Whether ``cfg`` is a registered family's config."""
    return any(type(cfg) is e.config_type for e in _entries().values())


register_family = register  # the name the package root exports (``ri.register_family``)
