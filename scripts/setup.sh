#!/usr/bin/env bash
# Install what the tests, docs and main job need, keeping what is already installed (idempotent;
# installs nothing on a machine that has it all, e.g. a GPU box with its own CUDA torch). Use a
# virtual environment: on a fresh one this pulls the pinned CPU torch and triton.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 scripts/ensure_deps.py
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
