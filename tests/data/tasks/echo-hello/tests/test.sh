#!/bin/bash
# A verifier that needs nothing beyond the base image.
if [ "$(cat /app/hello.txt 2>/dev/null)" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
