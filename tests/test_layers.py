"""The package's layering: every import runs downward (or within a layer), and no modules import each other.

Layers, bottom to top (the package docstring draws the same map):

0. ``errors``, ``presets``, ``phases``, ``config``, ``fp8``, ``sync_audit``, ``index_share``, ``machine``,
   ``families`` (the family interface and the registry) -- configuration, numerics and the machine's facts;
1. ``kvcache`` -- byte layouts, pools, allocator;
2. ``model`` -- the DSA layer and the single-device oracle (pure torch);
3. ``kernels`` -- Triton / Gluon kernels, their dispatch and fallback;
4. ``cp`` -- split, collectives, KV stores, materialization, fused ops, prefetch;
5. ``pd`` -- prefill -> decode transfer;
6. the engine: ``engine``, ``runner``, ``launch``, ``schedule``, ``workload``, ``check``, ``report``,
   ``prefill_decode``, ``footprint``;
7. the face: ``cli``, ``tool_args``, ``tables``, ``bench``, ``planner``, ``api``, ``demo``, ``figures`` and the
   package root.

A model family's folder (``families/<name>/``) spans the layers, each of its parts in the layer of
its kind (:data:`FAMILY_PARTS`: its ``config`` at 0, ``cache_layout`` at 1, ``model`` at 2, ``kernels``
at 3, ``cp`` at 4, ``pd`` at 5, the family object, its check and footprint at 6, its tools at 7); the registry finds a
family by name (``importlib``), so configuration code lists presets without importing any model.

Every ``import`` statement counts, the ones inside functions too: a lazy import that runs upward
is still a dependency that runs upward. Only imports under ``if TYPE_CHECKING:`` do not (they name
types for annotations and never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "reference_impl"

LAYERS: dict[str, int] = {
    "errors": 0,
    "presets": 0,
    "phases": 0,
    "config": 0,
    "fp8": 0,
    "sync_audit": 0,
    "index_share": 0,
    "machine": 0,
    "families": 0,
    "kvcache": 1,
    "model": 2,
    "kernels": 3,
    "cp": 4,
    "pd": 5,
    "engine": 6,
    "runner": 6,
    "launch": 6,
    "schedule": 6,
    "workload": 6,
    "check": 6,
    "report": 6,
    "prefill_decode": 6,
    "pool_timeline": 6,
    "footprint": 6,
    "rank_processes": 6,
    "cli": 7,
    "tables": 7,
    "bench": 7,
    "planner": 7,
    "api": 7,
    "demo": 7,
    "figures": 7,
    "tool_args": 7,
    "__main__": 7,
    "": 7,
}


FAMILY_PARTS: dict[str, int] = {
    "config": 0,
    "cache_layout": 1,
    "model": 2,
    "kernels": 3,
    "cp": 4,
    "pd": 5,
    "check": 6,
    "footprint": 6,
    "layer_step": 6,
    "family": 6,
    "bench": 7,
    "planner": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str | None = None) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every import of the package in ``path``
    (read as module ``name``, by default the module at ``path``)."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    annotations_only = {  # imports under ``if TYPE_CHECKING:`` never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}")]
            targets = submodules or [module]  # ``from pkg import mod`` depends on mod, not on pkg's names
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            if target.split(".")[0] == "reference_impl" and _is_module(target):
                found.append((target, node.lineno, id(node) in top_level))
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _layer(module: str) -> int:
    parts = module.removeprefix("reference_impl").lstrip(".").split(".")
    if parts[0] == "families" and len(parts) > 2:  # families.<name>.<part>: the part's layer
        if parts[2] not in FAMILY_PARTS:
            raise AssertionError(f"{module}: a family's part must be one of {sorted(FAMILY_PARTS)}")
        return FAMILY_PARTS[parts[2]]
    first = parts[0]
    if first not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and the package docstring)")
    return LAYERS[first]


def _all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _all_modules(), ids=lambda p: _module_name(p))
def test_imports_run_downward(path: Path) -> None:
    here = _module_name(path)
    upward = [
        f"line {line}: {target} (layer {_layer(target)})"
        for target, line, _ in _imports(path)
        if _layer(target) > _layer(here)
    ]
    assert not upward, f"{here} (layer {_layer(here)}) imports upward: " + "; ".join(upward)


def test_no_import_cycles() -> None:
    graph = {_module_name(p): {t for t, _, top in _imports(p) if top} for p in _all_modules()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule can fail: a kvcache module with a lazy import of the engine is caught."""
    fake = tmp_path / "pool.py"
    fake.write_text(
        (PACKAGE / "kvcache" / "pool.py").read_text() + "\n\ndef _late():\n    from ..engine import run_rank\n"
    )
    found = {t for t, _, top in _imports(fake, "reference_impl.kvcache.pool") if not top}
    assert "reference_impl.engine" in found and _layer("reference_impl.engine") > _layer("reference_impl.kvcache.pool")


def test_the_phase_map_names_modules_that_exist() -> None:
    """The package docstring's "where is phase N" table names files of the tree, every phase once."""
    import re

    import reference_impl

    rows = [line for line in reference_impl.__doc__.splitlines() if re.match(r"\| \d \|", line)]
    assert [int(row.split("|")[1]) for row in rows] == list(range(9))
    for row in rows:
        names = re.findall(r"`([\w/.*]+)`", row.split("|")[3])
        assert names, row
        for name in names:
            paths = list(PACKAGE.glob(name)) if "*" in name else [PACKAGE / name]
            assert paths and all(p.exists() for p in paths), f"phase map names {name!r}, which is not in the tree"
