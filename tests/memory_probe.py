"""Measure each process's peak resident memory during one run, beside the footprint estimate.

``python tests/memory_probe.py '{"requests": "0+256", "cp_size": 2}'`` runs the RunConfig (CPU,
forked ranks) and prints one JSON line: each rank's and the launching process's growth of peak
resident memory (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus the resident
memory at the start) and :func:`reference_impl.footprint.estimate`'s figures for the same processes.
Linux only (``tests/test_footprint.py`` runs it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["DSACP_RANK_THREADS"] = "1"  # forked ranks: they inherit the patch below
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference_impl import runner  # noqa: E402
from reference_impl.config import PhaseSet, RunConfig, parse_requests  # noqa: E402
from reference_impl.footprint import estimate  # noqa: E402


def reset_peak() -> int:
    """Reset this process's peak resident memory to its current one; return the current one."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS:")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


_run_each = runner._run_each


def _measured_run_each(group, runs):  # type: ignore[no-untyped-def]
    start = reset_peak()
    out = _run_each(group, runs)
    out[0].stats["probe_peak_growth"] = _status("VmHWM:") - start
    return out


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    spec["requests"] = tuple(parse_requests(spec["requests"]))
    spec["phases"] = PhaseSet.parse(str(spec.get("phases", "0")))
    run = RunConfig(device="cpu", **spec)
    runner._run_each = _measured_run_each
    start = reset_peak()
    result = runner.run_prefill(run, tensors=True)
    parent = _status("VmHWM:") - start
    foot = estimate(run, "cpu")
    print(
        json.dumps(
            {
                "matches_oracle": result.report["matches_oracle"],
                "measured": {"ranks": [r.stats["probe_peak_growth"] for r in result.ranks], "parent": parent},
                "estimate": {
                    "ranks": list(foot.ranks),
                    "parent": max(foot.parent_during, foot.parent_after),
                    "per_device": foot.per_device,
                },
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
