"""Where Harbor's own Python lives for tests: `.venv-harbor`, built by scripts/setup.sh when
a Python >= 3.12 exists (Harbor needs it; tmax's venv may be older)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARBOR_PYTHON = REPO / ".venv-harbor" / "bin" / "python"


def harbor_check(*job_dirs: Path) -> dict:
    """Load the job directories with Harbor's models (tests/harbor_check.py); skip without Harbor."""
    if not HARBOR_PYTHON.exists():
        pytest.skip("no .venv-harbor: scripts/setup.sh builds it only where a Python >= 3.12 exists")
    proc = subprocess.run([str(HARBOR_PYTHON), str(REPO / "tests" / "harbor_check.py"), *map(str, job_dirs)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 1):
        raise AssertionError(f"harbor_check crashed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)
