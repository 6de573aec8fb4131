"""Shared fixtures: a podman service for the session and the base image."""

from __future__ import annotations

import os
import shutil

import pytest

BASE_IMAGE = os.environ.get("TMAX_TEST_IMAGE", "localhost/tmax-base:bookworm")

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
