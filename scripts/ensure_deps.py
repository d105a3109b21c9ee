"""Install what the project needs, keeping what the machine already has.

Reads ``requirements-dev.txt``. A requirement already satisfied by an installed distribution is
kept; only the missing or unsatisfying ones go to one ``pip install``, so a machine that has
everything (a GPU box with its own CUDA torch, offline) installs nothing. torch and triton are
special: an installed build within the project's range (``pyproject.toml``: ``torch>=2.4,<2.15``,
``triton>=3.1``) is kept, whatever the pin, so a CUDA build is never replaced by the pinned CPU
wheel; the pin applies only where they are missing. So is an installed ``transformers`` 5.x (an
offline GPU box cannot fetch the pin; the cross-check tests skip a model its version lacks). Then the package itself, in editable mode,
unless it is installed already.

    python3 scripts/ensure_deps.py [--dry-run]
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # a fresh environment: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
KEEP_IF_IN_RANGE = {
    "torch": Requirement("torch>=2.4,<2.15"),
    "triton": Requirement("triton>=3.1"),
    "transformers": Requirement("transformers>=5,<6"),
}


def installed_version(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def satisfied(requirement: Requirement) -> bool:
    version = installed_version(requirement.name)
    if version is None:
        return False
    wanted = KEEP_IF_IN_RANGE.get(requirement.name.lower(), requirement)
    return wanted.specifier.contains(version, prereleases=True)


def missing_requirements(path: Path) -> list[str]:
    wanted = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not satisfied(Requirement(line)):
            wanted.append(line)
    return wanted


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    missing = missing_requirements(ROOT / "requirements-dev.txt")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if missing:
        print("installing:", " ".join(missing), flush=True)
        if not dry_run:
            subprocess.run(pip + missing, check=True)
    if installed_version("dsa-cp-reference") is None:
        print("installing the package in editable mode", flush=True)
        # With setuptools at hand, build without fetching it (offline machines have no index).
        isolation = ["--no-build-isolation"] if installed_version("setuptools") is not None else []
        if not dry_run and subprocess.run(pip + ["--no-deps", *isolation, "-e", str(ROOT)]).returncode != 0:
            # Offline machines cannot fetch the build backend: the scripts run the package from
            # the checkout (PYTHONPATH) instead.
            print("could not install the package; the scripts run it from the checkout", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
