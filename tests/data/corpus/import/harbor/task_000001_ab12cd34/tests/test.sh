#!/bin/bash
mkdir -p /logs/verifier
cd /tests
pytest -v test_final_state.py | tee /logs/verifier/test-stdout.txt
if [ ${PIPESTATUS[0]} -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit 0
