"""Install what the project needs, keeping what the machine already has.

Reads ``requirements-dev.txt``. A requirement already satisfied by an installed distribution is
kept; only the missing or unsatisfying ones go to one ``pip install``, so a machine that has
everything (a GPU box with its own CUDA torch, offline) installs nothing. torch and triton are
special: an installed build within the project's range (``pyproject.toml``: ``torch>=2.4,<2.15``,
``triton>=3.1``) is kept, whatever the pin, so a CUDA build is never replaced by the pinned CPU
wheel; the pin applies only where they are missing. So is an installed ``transformers`` 5.x (an
offline GPU box cannot fetch the pin; the cross-check tests skip a model its version lacks). Then
the package itself, in editable mode, unless it is installed already.

Then the Mooncake Transfer Engine (``pd --transport mooncake``), kept apart from the requirements
because a machine may hold any of its builds and the CPU one needs two Debian libraries: when
``mooncake.engine`` does not import, pip installs :data:`MOONCAKE_PACKAGE` (unless some build of it
is installed) and, when the import then misses the RDMA libraries and this runs as root with
apt-get, apt-get installs :data:`DEBIAN_LIBS` (``apt-get update`` only if the install needs it).
What cannot be done is one line on stderr and :data:`MOONCAKE_MARKER` holds the reason, which the
Mooncake tests skip with; ``DSACP_REQUIRE_MOONCAKE=1`` (CI) makes it an error instead.

    python3 scripts/ensure_deps.py [--dry-run]
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
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
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"  # CPU build; GPU boxes bring a CUDA one
MOONCAKE_BUILDS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
DEBIAN_LIBS = ("libibverbs1", "librdmacm1")  # the engine links libibverbs even without an RDMA device
MOONCAKE_MARKER = ROOT / ".mooncake-unavailable"  # why setup could not install it (git-ignored)
REQUIRE_MOONCAKE = "DSACP_REQUIRE_MOONCAKE"


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


def _required() -> bool:
    value = os.environ.get(REQUIRE_MOONCAKE, "0").strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise SystemExit(f"{REQUIRE_MOONCAKE}={value!r}: use 1/0, true/false, yes/no or on/off")
    return value in ("1", "true", "yes", "on")


def mooncake_import_error() -> str | None:
    """The last line of what ``import mooncake.engine`` raises in a fresh interpreter, or ``None``."""
    probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]


def _missing_debian_libs() -> list[str]:
    if shutil.which("dpkg-query") is None:
        return list(DEBIAN_LIBS)
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Status}\n", *DEBIAN_LIBS], capture_output=True, text=True
    ).stdout
    installed = {line.split()[0] for line in status.splitlines() if line.endswith("install ok installed")}
    return [lib for lib in DEBIAN_LIBS if lib not in installed]


def _apt_install(libs: list[str]) -> str | None:
    """Install ``libs`` with apt-get (root only); ``None`` on success, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"needs the Debian packages {' '.join(libs)} (apt-get as root; this is not root or has no apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *libs]
    if subprocess.run(install, env=env, capture_output=True).returncode == 0:
        return None
    # A fresh image has no package lists: fetch them, only now that an install needs them.
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    return None if done.returncode == 0 else f"apt-get install {' '.join(libs)} failed: {done.stderr.strip()[-200:]}"


def _install_mooncake(pip: list[str]) -> str | None:
    """pip (unless some build is installed), then the Debian libraries if the import misses them;
    ``None`` when ``mooncake.engine`` imports afterwards, else why not."""
    if not any(installed_version(name) is not None for name in MOONCAKE_BUILDS):
        print("installing:", MOONCAKE_PACKAGE, flush=True)
        # Optional unless required: one retry, so that a machine without an index (a GPU box) gives up
        # in about a second instead of pip's five backed-off retries.
        retries = [] if _required() else ["--retries", "1"]
        done = subprocess.run(pip + retries + [MOONCAKE_PACKAGE], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
            said = next((line for line in lines if line.lower().startswith("error")), lines[-1])
            return f"pip could not install {MOONCAKE_PACKAGE}: {said.strip()}"
    error = mooncake_import_error()
    missing = _missing_debian_libs() if error is not None else []
    if missing:
        print("installing:", " ".join(missing), "(apt-get)", flush=True)
        error = _apt_install(missing) or mooncake_import_error()
    return error


def ensure_mooncake(pip: list[str], dry_run: bool) -> int:
    """Make ``mooncake.engine`` import (see the module docstring); 0, or 1 when it is required
    (``DSACP_REQUIRE_MOONCAKE``) and cannot be installed."""
    required = _required()
    error = mooncake_import_error()
    if error is not None and dry_run:
        print(f"would install {MOONCAKE_PACKAGE} (and {' '.join(DEBIAN_LIBS)} if missing): {error}")
        return 0
    if error is not None:
        error = _install_mooncake(pip)
    if error is None:
        MOONCAKE_MARKER.unlink(missing_ok=True)
        return 0
    try:
        MOONCAKE_MARKER.write_text(error + "\n")
    except OSError as exc:  # a read-only checkout: the tests then fail instead of skipping, saying so
        error += f" (and the reason could not be recorded in {MOONCAKE_MARKER}: {exc.strerror})"
    print(
        f"Mooncake Transfer Engine not installed ({error}): the mooncake transport's tests skip with this reason"
        + ("" if required else f"; {REQUIRE_MOONCAKE}=1 makes it an error"),
        file=sys.stderr,
    )
    return 1 if required else 0


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
    return ensure_mooncake(pip, dry_run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
