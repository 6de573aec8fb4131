#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
setup_started=$SECONDS
bash scripts/setup.sh
echo "== setup took $((SECONDS - setup_started)) s; the suite follows (its own time is on pytest's last line)"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The import layering (pyproject.toml [tool.importlinter]) first: a broken contract fails the
# run before any test starts.
echo "== lint-imports"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${TMAX_VENV:-.venv}/bin/lint-imports" --no-logo
set +e
# TMAX_TEST_WORKERS=N runs N pytest-xdist workers, a test module at a time each (its module
# fixtures, a vLLM server say, start once), for machines with cores to spare. On 2 cores the
# suite is CPU-bound: 2 workers took 38 min against 43 serially, and the contention made
# timing-sensitive tests fail, so the default is one process.
# --unit: only tests/unit (no podman, vLLM or Ray; about 2 minutes); default: both suites.
suites=()
if [ "${1:-}" = "--unit" ]; then shift; suites=(tests/unit); fi
workers=()
if [ "${TMAX_TEST_WORKERS:-1}" -gt 1 ]; then workers=(-n "$TMAX_TEST_WORKERS" --dist loadscope); fi
"${TMAX_VENV:-.venv}/bin/python" -m pytest -ra --durations=40 "${workers[@]}" "${suites[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a broken suite, not a pass.
exit $rc
