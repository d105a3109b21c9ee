#!/usr/bin/env bash
# Every test: unit and multi-process (pytest), the walkthrough notebooks under nbval, the
# phases/ <-> notebooks/ pairing, and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1  # Triton kernels run under the interpreter on CPU
python3 -m pytest -q tests
python3 -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider notebooks
python3 -m mkdocs build --strict -q -d "$(mktemp -d)/site"
echo "all tests passed"
