"""Shared fixtures: a podman service for the session and the base image."""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings

import pytest

BASE_IMAGE = os.environ.get("TMAX_TEST_IMAGE", "localhost/tmax-base:bookworm")

# Tests press Ctrl-C (SIGINT) on this process and on the commands they start, as a person at
# a terminal would. Started in the background by a script, pytest inherits SIGINT ignored, and
# its children with it: Python's own handler here lets them start with the default again.
# Started by a process that blocks SIGINT (a Ray worker, some job runners), it inherits it
# blocked: a press would stay pending, so the agent loop would never see it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

# Task fixtures carry their own tests (test_initial_state.py, ...): they are data, run by the
# verifiers of the tasks under test, never collected by this suite.
collect_ignore_glob = ["data/*"]


@pytest.fixture(scope="session")
def podman_service():
    """The URL of a podman REST service: the configured one, else one tmax starts
    (the same code path `tmax bench` uses) and stops at the end of the session."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    from sandbox import podman_service as ps

    url = ps.service_url()
    yield url
    ps.stop_service()


@pytest.fixture(scope="session")
def base_image(podman_service) -> str:
    """The base image tag, built (debootstrap, a few minutes) if it is missing."""
    from sandbox.images import build_base, image_exists

    if not image_exists(BASE_IMAGE):
        build_base(BASE_IMAGE)
    return BASE_IMAGE


# Processes a test module may start and must stop: a vLLM server (and its engine core) or a
# Ray cluster. One left running eats this small machine's cores and slows every later test,
# so it is reported (the module leaked it) and stopped before the next module starts.
# Only this session's: every process it starts inherits this marker (another run of the
# suite on the same machine is left alone).
_HEAVY = ("vllm.entrypoints", "VLLM::EngineCore", "raylet", "gcs_server")
_SESSION = os.environ.setdefault("TMAX_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")


def _heavy_processes() -> dict[int, str]:
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        text = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if not any(k in text for k in _HEAVY) or "pytest" in text:
            continue
        try:
            if p.environ().get("TMAX_TEST_SESSION") == _SESSION:
                found[p.info["pid"]] = text[:160]
        except psutil.Error:
            continue
    return found


@pytest.fixture(autouse=True, scope="module")
def _no_leftover_servers(request):
    import psutil

    before = set(_heavy_processes())
    yield
    deadline = time.monotonic() + 20.0  # shutdowns finish asynchronously
    while True:
        left = {pid: cmd for pid, cmd in _heavy_processes().items() if pid not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for pid, cmd in left.items():
        warnings.warn(f"{request.module.__name__} left pid {pid} running; stopped it: {cmd}")
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
