#!/usr/bin/env bash
# Every test: the strict docs build, the CPU tier (pytest: unit, multi-process, Triton under the
# interpreter, CUDA hidden; the site tests read the build), the walkthrough notebooks under nbval.
# On a machine with a CUDA device, also the GPU tier (pytest --gpu: compiled kernels, DeepSeek-V3.2
# dims), and the notebooks run on the GPU instead of the CPU, beside the GPU tier. Each stage prints
# a heading and its summary line. DSACP_TEST_LOG_DIR (default: a temp folder) keeps every job's log
# and the docs build's, and on a CUDA machine summary.json (scripts/summarize_test_run.py).
# DSACP_TEST_WORKERS overrides the CPU tier's pytest-xdist workers (1: one process). The CPU tier runs
# its tests in a shuffled order (pytest-randomly) from a printed seed, DSACP_TEST_SEED (default fixed,
# so a failure reproduces; any other seed reshuffles), to catch tests that depend on each other's order.
# Every stage runs even when an earlier one fails; the summary names each stage's outcome, then the
# command exits 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
stage() { printf '\n==== %s  [%d s]\n' "$*" "$((SECONDS - start))"; }
summary() { grep -E "^[=]* ?[0-9]+ (passed|failed|error)|(passed|failed|error).* in [0-9.]+s" "$1" 2>/dev/null | tail -n 1 || true; }

stage "setup: installing what is missing (scripts/setup.sh)"
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
cores=$(python3 -c "from reference_impl.machine import cpu_cores; print(cpu_cores())")
xdist=$(python3 -c "import xdist" 2>/dev/null && echo 1 || echo 0)
notebooks=(python3 -m pytest -q --durations=12 --nbval-lax --nbval-current-env -p no:cacheprovider notebooks)
logs="${DSACP_TEST_LOG_DIR:-$(mktemp -d)}"; mkdir -p "$logs"

# The CPU tier's workers (pytest-xdist, one test file per worker, each worker on its share of the
# cores; tests/conftest.py): on a CUDA machine the cores left beside the GPU tier and the notebooks'
# 4 workers, at most 8; on a CPU machine one per core, at most 8. One process where xdist is missing.
# The GPU tier on 2 workers where xdist is installed (DSACP_GPU_TEST_WORKERS overrides): the modules
# that launch CP ranks one after another on one of them, the kernel modules on the other
# (tests/conftest.py groups them; --dist loadgroup). On the 16-core H200 box the command is bound by
# its host cores (the ranks' processes, the notebooks' kernels, the CPU tier): more workers ran slower.
gpu_workers=${DSACP_GPU_TEST_WORKERS:-2}
if [ "$cuda" = 1 ]; then workers=$(( cores - 6 - gpu_workers )); else workers=$cores; fi
workers=${DSACP_TEST_WORKERS:-$(( workers > 8 ? 8 : workers < 1 ? 1 : workers ))}
cpu_tier=(python3 -m pytest -q --durations=10 tests)
seed=${DSACP_TEST_SEED:-20261204}
if python3 -c "import pytest_randomly" 2>/dev/null; then
  cpu_tier+=(-p randomly --randomly-seed "$seed"); order="shuffled, seed $seed (DSACP_TEST_SEED)"
else
  order="file order (pytest-randomly not installed)"
fi
gpu_tier=(python3 -m pytest -q --gpu --durations=25 tests)
if [ "$xdist" = 1 ] && [ "$workers" -gt 1 ]; then cpu_tier+=(-n "$workers" --dist loadfile); else workers=1; fi
if [ "$xdist" = 1 ] && [ "$gpu_workers" -gt 1 ]; then gpu_tier+=(-n "$gpu_workers" --dist loadgroup); else gpu_workers=1; fi
echo "$cores cores, CUDA: $([ "$cuda" = 1 ] && echo "yes, GPU tier: $gpu_workers worker(s)" || echo no), CPU tier: $workers worker(s)$([ "$xdist" = 1 ] || echo ' (pytest-xdist not installed)') in $order, logs: $logs"

# The site: the strict build, then the CPU tier's site tests read the pages it wrote
# (DSACP_SITE_DIR). --strict aborts on most warnings but not on unresolved cross-references
# (mkdocs-autorefs), so any WARNING line fails the build here too.
docs_log="$logs/mkdocs.log"
export DSACP_SITE_DIR="$(mktemp -d)/site"
build_docs() {
  NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict -d "$DSACP_SITE_DIR" > "$docs_log" 2>&1 || { cat "$docs_log"; return 1; }
  if grep "WARNING" "$docs_log"; then echo "mkdocs printed warnings: fix them" >&2; return 1; fi
  echo "docs built clean ($(grep -c . "$docs_log") log lines, no warning)"
}

# Lint: ruff's rules and format, and mypy against its baseline (scripts/mypy_baseline.py). Where the tools
# are not installed (an offline GPU box without their wheels) the stage says so and passes.
lint_status=0
lint() {
  if ! python3 -c "import ruff, mypy" 2>/dev/null; then echo "ruff or mypy not installed: lint skipped"; return 0; fi
  local status=0
  python3 -m ruff check reference_impl tests scripts || status=1
  python3 -m ruff format --check reference_impl tests scripts > /dev/null || { python3 -m ruff format --diff reference_impl tests scripts | head -40; status=1; }
  python3 scripts/mypy_baseline.py || status=1
  [ "$status" = 0 ] && echo "ruff check, ruff format --check and mypy (baseline) clean"
  return $status
}
stage "lint: ruff check, ruff format --check, mypy against mypy-baseline.txt"
lint 2>&1 | tee "$logs/lint.log" || lint_status=$?

if [ "$cuda" = 1 ]; then
  # Three jobs side by side, each writing its own log: the GPU tier in front, from the start; behind
  # it, at a lower CPU priority (nice), the docs build followed by the CPU tier (it hides CUDA
  # itself), and the walkthroughs' GPU sections at small sizes (the committed outputs are full runs:
  # scripts/execute_notebooks.py; one notebook per worker where pytest-xdist is installed). The GPU
  # tier's rank launches are the longest chain and the box's host cores the limit, so the chain gets
  # the cores first. None of the jobs times anything, so sharing the machine changes no result.
  [ "$xdist" = 1 ] && notebooks+=(-n 4 --dist loadfile)
  cpu_log="$logs/cpu-tier.log"; notebook_log="$logs/notebooks.log"
  stage "in the background at nice 10: the docs build then the CPU tier ($workers workers), the notebooks on the GPU: $docs_log, $cpu_log, $notebook_log"
  # The box's cores are all busy for the whole command: OpenMP threads that wait passively
  # (OMP_WAIT_POLICY) instead of spinning, and the notebooks' kernels and ranks on few threads
  # (their GPU sections leave little to the CPU), leave the cores to work.
  ( renice -n 10 -p "$BASHPID" > /dev/null 2>&1 || true
    docs=0; build_docs > "$cpu_log" 2>&1 || docs=$?
    OMP_WAIT_POLICY=PASSIVE "${cpu_tier[@]}" >> "$cpu_log" 2>&1 || exit $?
    exit $docs ) &
  cpu_job=$!
  OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 DSACP_RANK_THREADS=1 DSACP_NOTEBOOK_SMOKE=1 \
    nice -n 10 "${notebooks[@]}" > "$notebook_log" 2>&1 &
  notebook_job=$!
  gpu_status=0; cpu_status=0; notebook_status=0
  stage "GPU tier ($gpu_workers worker(s)): pytest --gpu tests"
  "${gpu_tier[@]}" 2>&1 | tee "$logs/gpu-tier.log" || gpu_status=$?
  stage "waiting for the docs build, the CPU tier and the notebooks"
  wait "$cpu_job" || cpu_status=$?
  wait "$notebook_job" || notebook_status=$?
  stage "docs build and CPU tier: their last lines"; head -n 1 "$cpu_log"; tail -n 25 "$cpu_log"
  stage "notebooks on the GPU: its last lines"; tail -n 15 "$notebook_log"
  docs_status=$cpu_status  # one job: the docs build, then the CPU tier
  notebooks_on="the GPU"
  # What each job reported, as JSON (the README's GPU-tier row cites one such run).
  python3 scripts/summarize_test_run.py "$logs" --seconds $((SECONDS - start)) --out "$logs/summary.json" || true
else
  docs_status=0; cpu_status=0; notebook_status=0; gpu_status=0
  stage "docs: mkdocs build --strict"
  build_docs || docs_status=$?
  stage "CPU tier ($workers worker(s)): pytest tests"
  "${cpu_tier[@]}" 2>&1 | tee "$logs/cpu-tier.log" || cpu_status=$?
  stage "notebooks on the CPU (Triton under the interpreter)"
  TRITON_INTERPRET=1 "${notebooks[@]}" 2>&1 | tee "$logs/notebooks.log" || notebook_status=$?
  notebooks_on="the CPU"
fi
outcome() { [ "$1" = 0 ] && echo "ok" || echo "FAILED (exit $1)"; }
stage "summary"
[ "$cuda" = 1 ] && echo "GPU tier:  $(outcome "$gpu_status"): $(summary "$logs/gpu-tier.log")"
echo "lint:      $(outcome "$lint_status")"
[ "$cuda" = 1 ] || echo "docs:      $(outcome "$docs_status")"
echo "CPU tier:  $(outcome "$cpu_status"): $(summary "$logs/cpu-tier.log")"
echo "notebooks: $(outcome "$notebook_status"): $(summary "$logs/notebooks.log")"
if [ "$lint_status" != 0 ] || [ "$gpu_status" != 0 ] || [ "$docs_status" != 0 ] || [ "$cpu_status" != 0 ] || [ "$notebook_status" != 0 ]; then
  echo "some tests failed in $((SECONDS - start)) s: see the stages above and the logs in $logs" >&2
  exit 1
fi
echo "all tests passed in $((SECONDS - start)) s (GPU tier: $([ "$cuda" = 1 ] && echo ran || echo 'skipped, no CUDA device'); notebooks on $notebooks_on)"
