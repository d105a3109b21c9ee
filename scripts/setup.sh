#!/usr/bin/env bash
# Install the package and everything the tests and docs need (idempotent; fast when already there).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -r requirements-dev.txt
python3 -m pip install -q --disable-pip-version-check --no-deps -e .
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
