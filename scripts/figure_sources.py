"""Which results field each figure on the pages reads, so that one metric has one source across pages.

A page's figure is an expression over ``docs/results/*.json`` (``scripts/render_docs.py``). Two
pages can quote "the 128K layer at level 7" from two different files (two runs of the same
measurement) and disagree. This module evaluates every marker with results whose fields record
their reads, and names each read by its **metric**: the field's last keys (up to three, after the
last list) plus what identifies it, the identifying fields of the list elements on its path
(``level``, ``op``, ``T``, a workload's ``prefix`` / ``extend`` ...) and the run configuration
found on the way (``preset``, ``cp_size``, ``n_layers``, ``wire_gbps``, ``split_mode``).

:func:`conflicts` returns every metric that two or more pages quote from two or more results
files. A file that measures a *different* configuration under the same field names (an ablation,
an earlier kernel) is declared in :data:`VARIANTS`, and its reads become metrics of their own.

    python3 scripts/figure_sources.py     # print every conflict; exit 1 if any
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import render_docs  # noqa: E402
from render_docs import FIG, Doc, Items, Sources, page_paths  # noqa: E402

#: Fields of a list element that say which element it is.
IDENTIFYING = ("level", "op", "T", "S", "tokens", "C", "name", "batch", "workload", "kind", "shape")
#: Fields of a run that say what configuration it measured.
CONFIGURATION = ("preset", "cp_size", "n_layers", "wire_gbps", "split_mode")
#: Results that measure another configuration under the same field names: ``(file, path prefix)`` ->
#: the variant's name. Their reads are metrics of their own. A rerun of the same configuration is not a
#: variant: quote one run of it everywhere. An experiment that ran before later kernels landed measured
#: the engine of its time, which the page that quotes it says.
VARIANTS: dict[tuple[str, str], str] = {
    ("glue_h200", "layer.before"): "before the glue kernels",
    ("glue_h200", "layer.off"): "glue kernels off",
    ("glue_h200", "layer.on"): "glue kernels on, before the later attention and top-k kernels",
    ("glue_h200", "profile_before"): "before the glue kernels",
    ("sparse_mla_ws_h200", "layer.gluon."): "the first Gluon attention kernel",
    ("sparse_mla_ws_h200", "layer.gluon_ws"): "the warp-specialized attention kernel, with torch.topk",
    ("topk_select_h200", "layer.torch_topk"): "torch.topk",
    ("topk_select_h200", "layer.select_kernel"): "the top-k selection kernel, before the fused current-rows fill",
    ("topk_select_one_program_h200", ""): "the earlier one-program top-k kernel",
    ("fused_bound_h200", ""): "the fused-bound experiment",
}
#: Reads that are not measurements: configuration, launch parameters and a workload's definition.
_NOT_MEASURED = re.compile(r"(^|\.)(config|sweep_settings|args|workload)(\.|$)|^$")


@dataclass(frozen=True)
class Read:
    source: str  # the results file's stem
    path: str  # dotted, ``[]`` for a list element
    metric: tuple[str, tuple[tuple[str, Any], ...]]


def _identity(element: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if isinstance(element, dict):
        for key in IDENTIFYING:
            value = element.get(key)
            if isinstance(value, dict):
                found.update({k: v for k, v in value.items() if k in ("prefix", "extend", "name")})
            elif value is not None and not isinstance(value, list):
                found[key] = value
    return found


class _Recorder:
    def __init__(self) -> None:
        self.reads: list[Read] = []

    def wrap(self, value: Any, source: str, path: tuple[str, ...], ids: dict[str, Any]) -> Any:
        if isinstance(value, dict):
            return _TracedDoc(value, self, source, path, ids)
        if isinstance(value, list):
            return _TracedItems(value, self, source, path, ids)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.reads.append(self.read(source, path, ids))
        return value

    @staticmethod
    def read(source: str, path: tuple[str, ...], ids: dict[str, Any]) -> Read:
        dotted = ".".join(path)
        tail: list[str] = []
        for key in reversed(path):
            if key == "[]":
                break
            tail.append(key)
        name = ".".join(reversed(tail[:3]))
        ids = dict(ids)
        for (file, prefix), variant in VARIANTS.items():
            if file == source and dotted.startswith(prefix):
                ids["variant"] = variant
        return Read(source, dotted, (name, tuple(sorted((k, str(v)) for k, v in ids.items()))))


class _TracedDoc(Doc):
    def __init__(
        self, data: dict, recorder: _Recorder, source: str, path: tuple[str, ...], ids: dict[str, Any]
    ) -> None:
        dict.__init__(self, data)
        config = {k: data[k] for k in CONFIGURATION if k in data and not isinstance(data[k], (dict, list))}
        self._trace = (recorder, source, path, {**ids, **config})

    def _child(self, key: str, value: Any) -> Any:
        recorder, source, path, ids = self._trace
        return recorder.wrap(value, source, (*path, str(key)), ids)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            value = dict.__getitem__(self, name)
        except KeyError:
            raise AttributeError(f"no field {name!r}") from None
        return self._child(name, value)

    def __getitem__(self, key: Any) -> Any:
        return self._child(key, dict.__getitem__(self, key))

    def items(self):  # noqa: ANN201
        return [(k, self._child(k, v)) for k, v in dict.items(self)]

    def values(self):  # noqa: ANN201
        return [self._child(k, v) for k, v in dict.items(self)]


class _TracedItems(Items):
    def __init__(
        self, data: list, recorder: _Recorder, source: str, path: tuple[str, ...], ids: dict[str, Any]
    ) -> None:
        list.__init__(self, data)
        self._trace = (recorder, source, path, ids)

    def _child(self, value: Any) -> Any:
        recorder, source, path, ids = self._trace
        return recorder.wrap(value, source, (*path, "[]"), {**ids, **_identity(value)})

    def __getitem__(self, i: Any) -> Any:
        value = list.__getitem__(self, i)
        return [self._child(v) for v in value] if isinstance(i, slice) else self._child(value)

    def __iter__(self):  # noqa: ANN204
        return (self._child(v) for v in list.__iter__(self))


def figure_reads(pages: list[Path] | None = None, sources: Sources | None = None) -> dict[str, list[Read]]:
    """Every results field each page's markers read (numbers only), by page (relative to the repository)."""
    recorder = _Recorder()
    names = (sources or Sources()).namespace()
    for key, value in list(names.items()):
        if isinstance(value, Doc):
            names[key] = _TracedDoc(value, recorder, key, (), {})
    reads: dict[str, list[Read]] = {}
    for page in pages or page_paths():
        recorder.reads = []
        for m in FIG.finditer(page.read_text()):
            eval(m["spec"], {"__builtins__": {}, **names})  # noqa: S307 - our own pages, our own results
        rel = page.relative_to(render_docs.ROOT).as_posix() if page.is_relative_to(render_docs.ROOT) else str(page)
        reads[rel] = [
            r
            for r in recorder.reads
            if r.path.rsplit(".", 1)[-1] not in (*IDENTIFYING, *CONFIGURATION) and not _NOT_MEASURED.search(r.metric[0])
        ]
    return reads


def conflicts(reads: dict[str, list[Read]]) -> dict[tuple, dict[tuple[str, str], set[str]]]:
    """Metrics quoted on two or more pages from two or more results files: metric -> (file, path) -> pages."""
    by_metric: dict[tuple, dict[tuple[str, str], set[str]]] = defaultdict(lambda: defaultdict(set))
    for page, page_reads in reads.items():
        for r in page_reads:
            by_metric[r.metric][(r.source, r.path)].add(page)
    found = {}
    for metric, where in by_metric.items():
        files = {source for source, _ in where}
        pages = set().union(*where.values())
        if len(files) > 1 and len(pages) > 1:
            found[metric] = dict(where)
    return found


def explain(found: dict[tuple, dict[tuple[str, str], set[str]]]) -> str:
    lines = []
    for (name, ids), where in sorted(found.items(), key=str):
        lines.append(f"{name} {dict(ids)} is quoted from {len({s for s, _ in where})} results files:")
        lines += [
            f"    {source}: {path} on {', '.join(sorted(pages))}" for (source, path), pages in sorted(where.items())
        ]
    return "\n".join(lines)


def main() -> int:
    found = conflicts(figure_reads())
    if found:
        print(explain(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
