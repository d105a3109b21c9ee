"""Summarize one ``scripts/test.sh`` run from the logs it keeps, as the JSON the README's GPU-tier row cites.

``test.sh`` writes every job's pytest output under ``DSACP_TEST_LOG_DIR`` (``gpu-tier.log``,
``cpu-tier.log``, ``notebooks.log``) and calls this at the end; on a CUDA machine it writes
``summary.json`` there. To refresh the committed figure, run the test command on the GPU box with
``DSACP_TEST_LOG_DIR=$OUT/logs`` and copy ``$OUT/logs/summary.json`` to ``docs/results/test_run_h200.json``.

    python3 scripts/summarize_test_run.py LOG_DIR --seconds 416 --out LOG_DIR/summary.json
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from reference_impl.errors import ConfigError
from reference_impl.tool_args import ToolParser, float_arg, input_folder, output_file, refusing

_OUTCOMES = ("passed", "failed", "skipped", "deselected", "error", "errors", "xfailed", "xpassed")
_OUTCOME = "|".join(_OUTCOMES)
_FINAL_LINE = re.compile(rf"^=*\s*(\d+ (?:{_OUTCOME}).*) in ([\d.]+)s", re.MULTILINE)


def pytest_outcome(log: str) -> dict[str, float]:
    """Counts and seconds of the first pytest run that ``log`` ends (``{"passed": 69, ..., "seconds": 293.17}``).

    Raises ``LookupError`` when the log holds no pytest summary line (the job died before it ended)."""
    m = _FINAL_LINE.search(log)
    if m is None:
        raise LookupError("no pytest summary line in the log: the job did not finish")
    counts: dict[str, float] = {k: int(n) for n, k in re.findall(rf"(\d+) ({_OUTCOME})\b", m.group(1))}
    counts.setdefault("failed", 0)
    counts["seconds"] = float(m.group(2))
    return counts


def summarize(log_dir: Path, seconds: float, environment: dict[str, str]) -> dict:
    """What each job of one test run reported, from its log in ``log_dir``; jobs without a log are left out."""
    jobs = {}
    for job in ("gpu-tier", "cpu-tier", "notebooks"):
        path = log_dir / f"{job}.log"
        if path.exists():
            jobs[job.replace("-", "_")] = pytest_outcome(path.read_text(errors="replace"))
    return {"command": "bash scripts/test.sh", "seconds": seconds, **environment, **jobs}


def environment() -> dict[str, str]:
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__}


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser("python3 scripts/summarize_test_run.py", __doc__.splitlines()[0])
    parser.add_argument("log_dir", help="the folder of the jobs' logs")
    parser.add_argument("--seconds", type=float_arg(), required=True, help="the whole command's wall time")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    log_dir, out = input_folder(args.log_dir, "log_dir"), output_file(args.out)
    try:
        summary = summarize(log_dir, args.seconds, environment())
    except LookupError as exc:  # a job's log without pytest's final line
        raise ConfigError(f"log_dir {args.log_dir!r}: {exc}") from None
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
