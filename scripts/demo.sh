#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: the nano recipe on CPU
# (build a tiny model and tasks, SFT warm start, DPPO RL, held-out evaluation before and after).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Into runs/nano (the preset's run.out_dir) the first time; `tmax learn nano` refuses a
# directory an earlier run used, so a later demo goes to a new one beside it.
out=runs/nano
if [ -e "$out" ]; then out="runs/nano-$(date -u +%Y%m%d-%H%M%S)"; fi
echo "== the nano recipe into $out"
exec "${TMAX_VENV:-.venv}/bin/tmax" learn --out "$out" nano "$@"
