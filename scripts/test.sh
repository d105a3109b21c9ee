#!/usr/bin/env bash
# Every test: the CPU tier (pytest: unit, multi-process, Triton under the interpreter, CUDA hidden),
# the walkthrough notebooks under nbval, and the strict docs build. On a machine with a CUDA device,
# also the GPU tier (pytest --gpu: compiled kernels, DeepSeek-V3.2 dims), and the notebooks run on
# the GPU instead of the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")

python3 -m pytest -q tests  # the CPU tier
notebook_args=()
if [ "$cuda" = 1 ]; then
  python3 -m pytest -q --gpu tests  # the GPU tier
  # The walkthroughs' GPU sections at small sizes (the committed outputs are full runs:
  # scripts/execute_notebooks.py), one notebook per worker where pytest-xdist is installed.
  export DSACP_NOTEBOOK_SMOKE=1
  python3 -c "import xdist" 2>/dev/null && notebook_args=(-n 4 --dist loadfile)
  notebooks_on="the GPU"
else
  export TRITON_INTERPRET=1  # notebooks on CPU: Triton kernels under the interpreter
  notebooks_on="the CPU"
fi
python3 -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider "${notebook_args[@]}" notebooks
unset TRITON_INTERPRET DSACP_NOTEBOOK_SMOKE
# --strict aborts on most warnings but not on unresolved cross-references (mkdocs-autorefs), so
# any WARNING line fails the build here too.
docs_log="$(mktemp)"
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict -d "$(mktemp -d)/site" > "$docs_log" 2>&1 || { cat "$docs_log"; exit 1; }
if grep "WARNING" "$docs_log"; then echo "mkdocs printed warnings: fix them" >&2; exit 1; fi
echo "all tests passed in $((SECONDS - start)) s (GPU tier: $([ "$cuda" = 1 ] && echo ran || echo 'skipped, no CUDA device'); notebooks on $notebooks_on)"
