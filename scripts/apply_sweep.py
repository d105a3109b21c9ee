"""Write the launch configs a benchmark sweep found into the kernels' GPU defaults.

    python3 scripts/apply_sweep.py kernels_sweep.json   # from python -m reference_impl.bench.kernels --sweep
    python3 scripts/apply_sweep.py compute_bench.json   # from python -m reference_impl.bench.compute --sweep

A kernels sweep rewrites the ``GPU_CONFIGS`` table of ``kernels/fused_configs.py``: each swept
kernel's ``best`` config replaces its entry (only candidates whose bytes equal the torch path's can
be ``best``); unswept kernels keep theirs. A compute sweep rewrites ``GPU_DEFAULT_CONFIG`` of
``kernels/sparse_mla_triton.py``, ``kernels/indexer_triton.py`` and (when the sweep ran the Gluon
kernel) ``kernels/sparse_mla_gluon.py`` with the configs
:func:`~reference_impl.bench.compute_sweep.pick_attention` / ``pick_indexer`` / ``pick_gluon`` choose
(the fastest that passed its reference check; the current default stays unless beaten by more than 1%).
Prints what changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from reference_impl.bench import compute_sweep
from reference_impl.errors import ConfigError
from reference_impl.kernels import fused_configs, indexer_triton, sparse_mla_gluon, sparse_mla_triton
from reference_impl.tool_args import NUMBER, OBJECT, Field, ToolParser, input_json, refusing, stored_fields

TARGET = Path(fused_configs.__file__)
PROG = "python3 scripts/apply_sweep.py"
# What main reads from a results file: a compute sweep's rows, or each swept kernel's best config and its gain.
COMPUTE_SWEEP = {
    "attention": [OBJECT],
    "indexer": [OBJECT],
    "gluon?": Field("a list or null", lambda v: v is None or isinstance(v, list)),
}
KERNEL_SWEEP = {
    "best": Field("null or an object", lambda v: v is None or isinstance(v, dict)),
    "fraction_of_copy?": NUMBER,
}


def render(configs: dict[str, dict[str, int | bool]]) -> str:
    lines = ["GPU_CONFIGS: dict[str, LaunchConfig] = {"]
    lines += [
        f"    {name!r}: {{{', '.join(f'{k!r}: {v!r}' for k, v in cfg.items())}}},".replace("'", '"')
        for name, cfg in configs.items()
    ]
    return "\n".join(lines + ["}"])


def _set_default(module: object, config: tuple[object, ...]) -> None:
    target = Path(module.__file__)  # type: ignore[attr-defined]
    text = target.read_text()
    line = re.compile(r"^(GPU_DEFAULT_CONFIG: [^=]+= )\(.*\)$", re.M)
    if not line.search(text):
        raise SystemExit(f"no GPU_DEFAULT_CONFIG line found in {target}")
    old = module.GPU_DEFAULT_CONFIG  # type: ignore[attr-defined]
    if tuple(old) != config:
        print(f"{target.name}: {tuple(old)} -> {config}")
    target.write_text(line.sub(lambda m: m.group(1) + repr(config).replace("'", '"'), text, count=1))


def apply_compute_sweep(
    sweep: dict[str, list[dict[str, object]]],
    attention_module: object = sparse_mla_triton,
    indexer_module: object = indexer_triton,
    gluon_module: object = sparse_mla_gluon,
) -> None:
    """The compute benchmark's winners become the attention, indexer and Gluon GPU defaults (the
    modules' source files are rewritten; tests pass stand-ins)."""
    _set_default(
        attention_module, compute_sweep.pick_attention(sweep["attention"], attention_module.GPU_DEFAULT_CONFIG)
    )  # type: ignore[attr-defined]
    _set_default(indexer_module, compute_sweep.pick_indexer(sweep["indexer"], indexer_module.GPU_DEFAULT_CONFIG))  # type: ignore[attr-defined]
    if sweep.get("gluon"):
        _set_default(gluon_module, compute_sweep.pick_gluon(sweep["gluon"], gluon_module.GPU_DEFAULT_CONFIG))  # type: ignore[attr-defined]


def main(path: str) -> None:
    sweep = json.loads(Path(path).read_text())["sweep"]
    if "attention" in sweep:
        apply_compute_sweep(sweep)
        return
    configs = {name: dict(cfg) for name, cfg in fused_configs.GPU_CONFIGS.items()}
    for name, result in sweep.items():
        best = result.get("best")
        if name in configs and best and best != configs[name]:
            print(
                f"{name}: {configs[name]} -> {best} "
                f"({result['default_fraction_of_copy']:.0%} -> {result['fraction_of_copy']:.0%} of copy)"
            )
            configs[name] = {**configs[name], **best}
    text = TARGET.read_text()
    block = re.compile(r"GPU_CONFIGS: dict\[str, LaunchConfig\] = \{\n.*?\n\}", re.S)
    if not block.search(text):
        raise SystemExit(f"no GPU_CONFIGS table found in {TARGET}")
    TARGET.write_text(block.sub(lambda _: render(configs), text, count=1))


@refusing
def cli(argv: list[str] | None = None) -> int:
    """The command line: check the results file's sweep (one error line naming the field), then :func:`main`."""
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("results", help="a results JSON written with --sweep (bench.compute or bench.kernels)")
    args = parser.parse_args(argv)
    doc = input_json(args.results, "results")
    where = f"results {args.results!r}"
    stored_fields(doc, {"sweep": OBJECT}, where)
    if "attention" in doc["sweep"]:
        stored_fields(doc, {"sweep": COMPUTE_SWEEP}, where)
    else:
        stored_fields(doc, {"sweep": {name: KERNEL_SWEEP for name in doc["sweep"]}}, where)
    try:
        main(args.results)
    except (KeyError, TypeError) as exc:  # a row without a field the pick reads
        raise ConfigError(f"{where}: a sweep row lacks what it needs ({type(exc).__name__}: {exc})") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
