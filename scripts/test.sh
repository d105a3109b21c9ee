#!/usr/bin/env bash
# Every test: the strict docs build, the CPU tier (pytest: unit, multi-process, Triton under the
# interpreter, CUDA hidden; the site tests read the build), the walkthrough notebooks under nbval.
# On a machine with a CUDA device, also the GPU tier (pytest --gpu: compiled kernels, DeepSeek-V3.2
# dims), and the notebooks run on the GPU instead of the CPU, beside the GPU tier. DSACP_TEST_LOG_DIR (default: a temp folder) keeps
# every job's log and the docs build's, and on a CUDA machine summary.json (scripts/summarize_test_run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
notebooks=(python3 -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider notebooks)
# The site first: the strict build, then the CPU tier's site tests read the pages it wrote
# (DSACP_SITE_DIR). --strict aborts on most warnings but not on unresolved cross-references
# (mkdocs-autorefs), so any WARNING line fails the build here too.
docs_log="${DSACP_TEST_LOG_DIR:-$(mktemp -d)}/mkdocs.log"
mkdir -p "$(dirname "$docs_log")"
export DSACP_SITE_DIR="$(mktemp -d)/site"
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict -d "$DSACP_SITE_DIR" > "$docs_log" 2>&1 || { cat "$docs_log"; exit 1; }
if grep "WARNING" "$docs_log"; then echo "mkdocs printed warnings: fix them" >&2; exit 1; fi

if [ "$cuda" = 1 ]; then
  # Three jobs side by side, each writing its own log: the CPU tier (it hides CUDA itself), the
  # walkthroughs' GPU sections at small sizes (the committed outputs are full runs:
  # scripts/execute_notebooks.py; one notebook per worker where pytest-xdist is installed), and the
  # GPU tier in front. None of them times anything, so sharing the machine changes no result.
  python3 -c "import xdist" 2>/dev/null && notebooks+=(-n 4 --dist loadfile)
  logs="${DSACP_TEST_LOG_DIR:-$(mktemp -d)}"; mkdir -p "$logs"  # where the side jobs write as they go
  cpu_log="$logs/cpu-tier.log"; notebook_log="$logs/notebooks.log"
  python3 -m pytest -q --durations=8 tests > "$cpu_log" 2>&1 &
  cpu_job=$!
  DSACP_NOTEBOOK_SMOKE=1 "${notebooks[@]}" > "$notebook_log" 2>&1 &
  notebook_job=$!
  gpu_status=0; cpu_status=0; notebook_status=0
  python3 -m pytest -q --gpu tests 2>&1 | tee "$logs/gpu-tier.log" || gpu_status=$?  # the GPU tier
  wait "$cpu_job" || cpu_status=$?
  wait "$notebook_job" || notebook_status=$?
  echo "CPU tier:"; tail -n 25 "$cpu_log"
  echo "notebooks on the GPU:"; tail -n 15 "$notebook_log"
  if [ "$gpu_status" != 0 ] || [ "$cpu_status" != 0 ] || [ "$notebook_status" != 0 ]; then
    echo "GPU tier exit $gpu_status, CPU tier exit $cpu_status, notebooks exit $notebook_status" >&2; exit 1
  fi
  notebooks_on="the GPU"
else
  python3 -m pytest -q tests  # the CPU tier
  TRITON_INTERPRET=1 "${notebooks[@]}"  # notebooks on CPU: Triton kernels under the interpreter
  notebooks_on="the CPU"
fi
if [ "$cuda" = 1 ]; then  # what each job reported, as JSON (the README's GPU-tier row cites one such run)
  python3 scripts/summarize_test_run.py "$logs" --seconds $((SECONDS - start)) --out "$logs/summary.json"
fi
echo "all tests passed in $((SECONDS - start)) s (GPU tier: $([ "$cuda" = 1 ] && echo ran || echo 'skipped, no CUDA device'); notebooks on $notebooks_on)"
