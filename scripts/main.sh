#!/usr/bin/env bash
# The main job: a CP prefill at every phase level on this machine's device, what each level buys
# (memory and per-layer time per rank), checked against the oracle; a table, and demo.json +
# demo.png in a results folder it names at the end. CPU: the tiny preset on 4 gloo ranks. CUDA:
# DeepSeek-V3.2 dims. Extra arguments go to `python -m reference_impl demo` (--out DIR, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m reference_impl demo "$@"
