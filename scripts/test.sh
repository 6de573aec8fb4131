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
# With no arguments the suite runs in two phases. First the tests that start no Ray cluster and
# no vLLM server (the unit tests, and integration tests that wait on podman, shells, image
# builds and package downloads more than on the CPU), in TMAX_TEST_WORKERS pytest-xdist
# workers (default 2), a test module at a time each (its module fixtures start once). Then the
# Ray and vLLM runs (markers `ray`, `vllm`), each CPU-bound, in one process: on 2 cores two of
# those at once only slowed each other (38 min against 43 for the whole suite in 2 workers)
# and made timing-sensitive runs fail. Arguments (test paths, -k, -m ...) run as given, in one
# process unless TMAX_TEST_WORKERS says more. --unit: only tests/unit (a minute or two).
pytest=("${TMAX_VENV:-.venv}/bin/python" -m pytest -ra --durations=40)
workers=${TMAX_TEST_WORKERS:-2}
xdist=()
if [ "$workers" -gt 1 ]; then xdist=(-n "$workers" --dist loadscope); fi
# A short base for the tests' temporary directories: xdist's own (under pytest-of-$USER)
# makes the paths some tests show on an 80-column screen longer than they fit.
basetemp=$(mktemp -d "${TMPDIR:-/tmp}/tmax-t.XXXX")
if [ "${1:-}" = "--unit" ]; then
  shift
  "${pytest[@]}" "${xdist[@]}" --basetemp "$basetemp" tests/unit "$@"
  rc=$?
elif [ $# -gt 0 ]; then
  if [ "${TMAX_TEST_WORKERS:-1}" -gt 1 ]; then "${pytest[@]}" "${xdist[@]}" "$@"; else "${pytest[@]}" "$@"; fi
  rc=$?
else
  phase_started=$SECONDS
  echo "== tests without Ray or vLLM, ${workers} worker(s)"
  "${pytest[@]}" "${xdist[@]}" --basetemp "$basetemp" -m "not ray and not vllm" tests/unit tests/integration
  light_rc=$?
  echo "== they took $((SECONDS - phase_started)) s; the Ray and vLLM runs follow, in one process"
  phase_started=$SECONDS
  "${pytest[@]}" -m "ray or vllm" tests/integration
  rc=$?
  echo "== the Ray and vLLM runs took $((SECONDS - phase_started)) s"
  if [ "$light_rc" -ne 0 ]; then rc=$light_rc; fi
fi
set -e
[ "$rc" -ne 0 ] || rm -rf "$basetemp"
# pytest exits 5 when nothing was collected: that is a broken suite, not a pass.
exit $rc
