"""Shared fixtures: a podman service for the session, the base image, and one Ray cluster
for the session's in-process training runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

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
    from tmax.sandbox import podman_service as ps

    url = ps.service_url()
    yield url
    ps.stop_service()


@pytest.fixture(scope="session")
def base_image(podman_service) -> str:
    """The base image tag, built (debootstrap, a few minutes) if it is missing."""
    from tmax.sandbox.base_image import build_base, image_exists

    if not image_exists(BASE_IMAGE):
        build_base(BASE_IMAGE)
    return BASE_IMAGE


@pytest.fixture
def open_box(request, tmp_path):
    """`open_box(kind)`: a started sandbox of that kind (`local`, the default, works in
    tmp_path), closed after the test."""
    from tmax.sandbox import SandboxSpec, make_sandbox

    boxes = []

    def make(kind: str = "local"):
        if kind == "local":
            spec = SandboxSpec(workdir=str(tmp_path), env={"TMPDIR": str(tmp_path)})
        elif kind == "bwrap":
            spec = SandboxSpec()
        else:
            spec = SandboxSpec(image=request.getfixturevalue("base_image"))
        box = make_sandbox(kind, spec)
        boxes.append(box)
        box.start()
        return box

    yield make
    for box in boxes:
        box.close()


# Processes a test module may start and must stop: a vLLM server (and its engine core) or a
# Ray cluster. One left running eats this small machine's cores and slows every later test,
# so it is reported (the module leaked it) and stopped before the next module starts.
# Only this session's: every process it starts inherits this marker (another run of the
# suite on the same machine is left alone).
_HEAVY = ("vllm_cpu_main.py", "vllm.entrypoints", "VLLM::EngineCore", "raylet", "gcs_server")
_SESSION = os.environ.setdefault("TMAX_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")


# The processes of the session's shared Ray cluster (`ray_head`): meant to outlive a module.
_SHARED: set[int] = set()


def pytest_configure(config):
    """Under pytest-xdist each worker is its own session: its own marker, so one worker's
    leftover check never stops the servers a test on the other worker is using."""
    global _SESSION
    if hasattr(config, "workerinput"):
        _SESSION = os.environ["TMAX_TEST_SESSION"] = f"{os.getpid()}-{time.time_ns()}"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, modules with a `slow` test first (kept whole, in their order):
    xdist hands out a module at a time, and the long ones started last would leave one
    worker running them alone at the end. A single process keeps the files' order."""
    if not getattr(config.option, "numprocesses", None):
        return
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)


def _heavy_processes() -> dict[int, str]:
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        text = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if not any(k in text for k in _HEAVY) or "pytest" in text or p.info["pid"] in _SHARED:
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


class _RayHead:
    """A Ray head started with `ray start --head --block` in its own process group, ended
    with everything it started; started again when it died."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.proc, self.address = log_dir, None, ""

    def alive(self) -> bool:
        import psutil

        return self.proc is not None and self.proc.poll() is None and all(psutil.pid_exists(p) for p in _SHARED)

    def start(self) -> str:
        import psutil

        from tmax.common.proctree import parent_death_hook
        from tmax.common.waiting import wait_until
        from tmax.training.cluster.launch import ray_bin, ray_env
        from tmax.training.net import free_port, node_ip

        self.stop()
        ip, port = node_ip(), free_port()
        log = self.log_dir / f"ray-start-{port}.log"
        # 8 logical CPUs: room for the actors of any one run (the presets ask for 4). Free
        # ports, not Ray's fixed defaults, which a head that `tmax learn` starts (Slurm) uses.
        argv = [ray_bin(), "start", "--head", "--block", f"--port={port}", f"--node-ip-address={ip}", "--num-cpus=8",
                f"--ray-client-server-port={free_port()}", "--include-dashboard=false", "--disable-usage-stats",
                f"--object-store-memory={1024 ** 3}"]
        with log.open("wb") as out:
            # Ended with pytest, too, when pytest is killed (`--block` stops what it started).
            proc = self.proc = subprocess.Popen(argv, env=ray_env(), stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=parent_death_hook())

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            return "Ray runtime started" in log.read_text(errors="replace")

        if not wait_until(started, 180.0, 0.5):
            self.stop()
            raise RuntimeError(f"ray start --head did not start within 180 s:\n{log.read_text()[-3000:]}")
        # Its raylet and GCS: what `alive` checks and the leftover check leaves alone.
        for child in psutil.Process(proc.pid).children(recursive=True):
            if child.name() in ("raylet", "gcs_server"):
                _SHARED.add(child.pid)
        self.address = f"{ip}:{port}"
        return self.address

    def stop(self) -> None:
        from tmax.common.proctree import end_process_tree

        if self.proc is not None:
            # Nothing needs the cluster's state once it stops (the session's end or a restart),
            # and its GCS and autoscaler monitor can sit on SIGTERM for longer than a 20 s grace
            # (the suite's last teardown took 22 s): what still runs after 5 s is killed.
            end_process_tree(self.proc.pid, grace_s=5.0)
            self.proc = None
        _SHARED.clear()


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One Ray cluster for the whole session, started on first use (a start costs ~10 s
    here, and each in-process run would otherwise start and stop its own). Runs join it
    through `RAY_ADDRESS` (`shared_ray`), the way `tmax learn` joins a running cluster, and
    leave it running when they end; the actors of a run die with its connection (Ray ends
    a job's actors when its driver disconnects)."""
    pytest.importorskip("ray")
    head = _RayHead(tmp_path_factory.mktemp("ray-head"))
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture
def shared_ray(ray_head, monkeypatch):
    """`RAY_ADDRESS` set to the session's cluster for this test: a run started in this
    process joins it (`training.cluster.launch`, mode "address") and disconnects at its end."""
    address = ray_head.address if ray_head.alive() else ray_head.start()
    monkeypatch.setenv("RAY_ADDRESS", address)
    yield address
    import ray

    if ray.is_initialized():  # a test that failed before its run disconnected
        ray.shutdown()
