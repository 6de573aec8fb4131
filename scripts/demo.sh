#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: the nano recipe on CPU
# (build a tiny model and tasks, SFT warm start, DPPO RL, held-out evaluation before and after),
# then the run at a glance (`tmax learn report`). Written to a log (`bash scripts/demo.sh > log
# 2>&1`, as a cluster job's output is), it reads top to bottom: set-up, SFT, engine, evals, a
# line per RL step, the result. What the libraries log goes to files, named where it matters.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
echo "== set-up (scripts/setup.sh; its output in runs/setup.log)"
if ! bash scripts/setup.sh > runs/setup.log 2>&1; then
  echo "set-up failed; the last lines of runs/setup.log:"
  tail -n 30 runs/setup.log
  exit 1
fi
echo "set-up done"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Into runs/nano (the preset's run.out_dir) the first time; `tmax learn nano` refuses a
# directory an earlier run used, so a later demo goes to a new one beside it.
out=runs/nano
if [ -e "$out" ]; then out="runs/nano-$(date -u +%Y%m%d-%H%M%S)"; fi
tmax="${TMAX_VENV:-.venv}/bin/tmax"
echo "== the nano recipe into $out"
"$tmax" learn --out "$out" nano "$@"
echo "== the run at a glance (tmax learn report $out)"
"$tmax" learn report "$out"
