#!/bin/bash
# Hand-written verifier: reward 1 when count.txt holds the line count of words.txt.
LOGS="${TMAX_LOGS_DIR:-/logs}"
mkdir -p "$LOGS/verifier"
cd "${TMAX_WORKDIR:-/app}"
want=$(wc -l < files/words.txt)
if [ -f count.txt ] && [ "$(tr -d '[:space:]' < count.txt)" = "$want" ]; then
  echo 1 > "$LOGS/verifier/reward.txt"
else
  echo 0 > "$LOGS/verifier/reward.txt"
fi
