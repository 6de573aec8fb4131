#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
setup_started=$SECONDS
bash scripts/setup.sh
echo "== setup took $((SECONDS - setup_started)) s; the suite follows (its own time is on pytest's last line)"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
set +e
# Two pytest-xdist workers, a test module at a time each (its module fixtures, a vLLM server
# say, start once): many tests wait on process starts, containers and servers more than
# they compute, so two share this machine's cores well.
"${TMAX_VENV:-.venv}/bin/python" -m pytest -ra --durations=40 -n "${TMAX_TEST_WORKERS:-2}" --dist loadscope "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a broken suite, not a pass.
exit $rc
