"""What IndexShare buys under CP, as the capacity planner predicts it: GLM-5 against GLM-5.2.

The two presets have the same attention layer; GLM-5.2 runs the indexer on 21 of its 78 layers
(``reference_impl.index_share``). For each, the planner (``reference_impl.planner``, rates measured
on an H200 from ``docs/results/``) predicts at C = 8 and 128K / 1M tokens: KV and indexer K at rest
per rank, the longest request that fits, all-gather #1 per layer, and the slowest rank's layer time
with its terms. Nothing runs on a device: every figure is arithmetic on the byte layouts and the
measured rates.

    python3 scripts/index_share_plan.py        # writes docs/results/index_share_plan.json
    python3 scripts/index_share_plan.py --out /tmp/plan.json

``docs/concepts/index-share.md`` renders its figures from the JSON (``scripts/render_docs.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reference_impl.planner import PlannerConfig, load_rates, plan_capacity  # noqa: E402
from reference_impl.planner.model import allgather1_bytes, zigzag_blocks  # noqa: E402
from reference_impl.tool_args import ToolParser, output_file, refusing  # noqa: E402

PROG = "python3 scripts/index_share_plan.py"

PRESETS = ("glm-5", "glm-5.2")
CONTEXTS = (131072, 1048576)
CP_SIZE = 8
LEVELS = (0, 2, 8)  # the baseline, KV sharded at rest, everything
COMMAND = "python3 scripts/index_share_plan.py"


def preset_plan(preset: str) -> dict[str, Any]:
    """The planner's inputs and the levels of :data:`LEVELS` for one preset, plus all-gather #1 bytes per layer kind."""
    plan = plan_capacity(PlannerConfig(preset=preset, cp_size=CP_SIZE, contexts=CONTEXTS), load_rates(None))
    cfg = PlannerConfig(preset=preset).model
    allgather = {}
    for ctx in CONTEXTS:
        blocks = zigzag_blocks(ctx, CP_SIZE, 64, page_aligned=True)
        t_pad = max(blocks[r] + blocks[len(blocks) - 1 - r] for r in range(CP_SIZE))
        full, shared = (allgather1_bytes(cfg, CP_SIZE, t_pad, indexer) for indexer in (True, False))
        n_full, n = cfg.index_share.n_full, cfg.n_layers
        allgather[str(ctx)] = {
            "full_layer": full,
            "shared_layer": shared,
            "all_layers": n_full * full + (n - n_full) * shared,
        }
    return {
        "inputs": plan["inputs"],
        "rates": plan["rates"],
        "levels": [level for level in plan["levels"] if level["level"] in LEVELS],
        "allgather1_bytes_per_rank": allgather,
    }


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file to write (default: docs/results/index_share_plan.json)")
    args = parser.parse_args(argv)
    out = output_file(args.out or str(ROOT / "docs" / "results" / "index_share_plan.json"))
    doc = {
        "command": COMMAND,
        "what": "capacity-planner predictions (no device run): GLM-5 vs GLM-5.2 (IndexShare), C = 8, fp8 KV, page 64",
        "cp_size": CP_SIZE,
        "contexts": list(CONTEXTS),
        "presets": {preset: preset_plan(preset) for preset in PRESETS},
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
