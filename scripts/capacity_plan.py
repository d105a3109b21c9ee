"""The capacity planner's prediction that the site quotes, as a results JSON.

    python3 scripts/capacity_plan.py            # write docs/results/capacity_deepseek_v32_c8.json
    python3 scripts/capacity_plan.py --check    # exit 1 when the committed file is not what the planner says now

The file is ``python -m reference_impl plan ... --json`` (arithmetic on the KV layouts plus the
planner's rates; nothing runs on a device) with the command that produced it. The test command runs
``--check``, so a change to the planner or its rates shows up as a stale file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reference_impl.figures import same_up_to_rounding  # noqa: E402
from reference_impl.tool_args import ToolParser, output_file, refusing  # noqa: E402

PROG = "python3 scripts/capacity_plan.py"

OUT = ROOT / "docs" / "results" / "capacity_deepseek_v32_c8.json"
#: DeepSeek-V3.2 at C = 8 on an H200 (141 GiB), the planner's default reservation for weights and activations.
ARGS = ("plan", "--preset", "deepseek-v3.2", "--cp-size", "8", "--hbm-gib", "141", "--json")


def planned() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "reference_impl", *ARGS], check=True, capture_output=True, text=True, env=env, cwd=ROOT
    ).stdout
    return {
        "command": "python -m reference_impl " + " ".join(ARGS),
        "what": "capacity planner prediction (KV layout arithmetic and planner rates; nothing measured)",
        "plan": json.loads(out),
    }


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    parser.add_argument("--out", default=None, help=f"the results file (default: {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out is not None else OUT
    shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    if not args.check:
        output_file(str(out))
    doc = planned()
    if args.check:
        try:
            committed = json.loads(out.read_text()) if out.is_file() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            committed = None
        if committed is None or not same_up_to_rounding(committed, doc):
            print(f"{shown} is not what the planner says now: python3 scripts/capacity_plan.py")
            return 1
        return 0
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
