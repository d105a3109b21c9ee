#!/usr/bin/env bash
# The main job: a CP prefill across every available phase level on this machine's device, with a
# report table (CPU: the tiny preset, 4 ranks on gloo; CUDA: DeepSeek-V3.2 dims). Extra arguments
# go to `python -m reference_impl demo` (e.g. --json, --cp-size 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m reference_impl demo "$@"
