"""mypy on ``reference_impl`` against a committed baseline that may only shrink.

The package is not yet clean under mypy; ``mypy-baseline.txt`` lists the errors it had when the
check was adopted, one per line as ``path: error: message  [code]`` (no line numbers, so moving code
does not disturb it). The check fails on any error the baseline does not hold (a new one), and says
how many baseline entries are gone; ``--update`` rewrites the baseline from the current errors, and
refuses when that would add an entry.

    python3 scripts/mypy_baseline.py            # exit 1 naming each new error
    python3 scripts/mypy_baseline.py --update   # shrink the baseline to what is left
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "mypy-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: (?P<message>.*)$")


def current_errors() -> Counter[str]:
    """mypy's errors on the package (its settings: ``[tool.mypy]`` in pyproject.toml), line numbers dropped."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        raise SystemExit(f"error: mypy did not run: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    found = [m for line in proc.stdout.splitlines() if (m := _ERROR.match(line))]
    return Counter(f"{m['path']}: error: {m['message'].strip()}" for m in found)


def read_baseline() -> Counter[str]:
    if not BASELINE.exists():
        return Counter()
    return Counter(line for line in BASELINE.read_text().splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 scripts/mypy_baseline.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--update", action="store_true", help="rewrite the baseline from the current errors (default: check)"
    )
    args = parser.parse_args(argv)
    now, baseline = current_errors(), read_baseline()
    new, gone = now - baseline, baseline - now
    if args.update:
        if new and BASELINE.exists():
            print(f"error: the baseline may only shrink; {sum(new.values())} error(s) are not in it:", file=sys.stderr)
            print("\n".join(sorted(new.elements())), file=sys.stderr)
            return 1
        BASELINE.write_text("".join(f"{line}\n" for line in sorted(now.elements())))
        print(f"mypy baseline: {sum(now.values())} error(s) written to {BASELINE.name}")
        return 0
    if new:
        print(f"mypy: {sum(new.values())} error(s) not in {BASELINE.name} (fix them; the baseline may only shrink):")
        print("\n".join(sorted(new.elements())))
        return 1
    note = f"; {sum(gone.values())} baseline entr(ies) fixed: shrink it with --update" if gone else ""
    print(f"mypy: {sum(now.values())} error(s), all in the baseline of {sum(baseline.values())}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
