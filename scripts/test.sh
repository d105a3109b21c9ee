#!/usr/bin/env bash
# Every test: unit and multi-process (pytest), the walkthrough notebooks under nbval, the
# phases/ <-> notebooks/ pairing, and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1  # Triton kernels run under the interpreter on CPU
python3 -m pytest -q tests
python3 -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider notebooks
# --strict aborts on most warnings but not on unresolved cross-references (mkdocs-autorefs), so
# any WARNING line fails the build here too.
docs_log="$(mktemp)"
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict -d "$(mktemp -d)/site" > "$docs_log" 2>&1 || { cat "$docs_log"; exit 1; }
if grep "WARNING" "$docs_log"; then echo "mkdocs printed warnings: fix them" >&2; exit 1; fi
echo "all tests passed"
