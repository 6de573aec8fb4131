#!/bin/bash
# Broken verifier: only checks that the input exists, so the untouched state passes.
LOGS="${TMAX_LOGS_DIR:-/logs}"
mkdir -p "$LOGS/verifier"
cd "${TMAX_WORKDIR:-/app}"
if [ -f files/words.txt ]; then echo 1 > "$LOGS/verifier/reward.txt"; else echo 0 > "$LOGS/verifier/reward.txt"; fi
