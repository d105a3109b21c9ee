"""Write the launch configs a kernel sweep found into ``reference_impl/kernels/fused_configs.py``.

    python3 scripts/apply_sweep.py kernels_sweep.json   # from python -m reference_impl.bench.kernels --sweep

Rewrites the ``GPU_CONFIGS`` table: each swept kernel's ``best`` config replaces its entry (only
candidates whose bytes equal the torch path's can be ``best``); unswept kernels keep theirs.
Prints what changed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from reference_impl.kernels import fused_configs

TARGET = Path(fused_configs.__file__)


def render(configs: dict[str, dict[str, int | bool]]) -> str:
    lines = ["GPU_CONFIGS: dict[str, LaunchConfig] = {"]
    lines += [f"    {name!r}: {{{', '.join(f'{k!r}: {v!r}' for k, v in cfg.items())}}},".replace("'", '"') for name, cfg in configs.items()]
    return "\n".join(lines + ["}"])


def main(path: str) -> None:
    sweep = json.loads(Path(path).read_text())["sweep"]
    configs = {name: dict(cfg) for name, cfg in fused_configs.GPU_CONFIGS.items()}
    for name, result in sweep.items():
        best = result.get("best")
        if name in configs and best and best != configs[name]:
            print(f"{name}: {configs[name]} -> {best} ({result['default_fraction_of_copy']:.0%} -> {result['fraction_of_copy']:.0%} of copy)")
            configs[name] = {**configs[name], **best}
    text = TARGET.read_text()
    block = re.compile(r"GPU_CONFIGS: dict\[str, LaunchConfig\] = \{\n.*?\n\}", re.S)
    if not block.search(text):
        raise SystemExit(f"no GPU_CONFIGS table found in {TARGET}")
    TARGET.write_text(block.sub(lambda _: render(configs), text, count=1))


if __name__ == "__main__":
    main(sys.argv[1])
