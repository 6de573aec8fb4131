"""The podman backend on real containers from the base image, plus the service,
labels, `clean` and base-image import."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from documented import documented
from tmax.sandbox import LABEL_KEY, SandboxError, SandboxSpec, make_sandbox

pytestmark = [pytest.mark.podman, pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")]


def _inspect(name: str) -> dict:
    import json

    # The CLI can lose a storage-lock race with the REST service on a loaded machine: retry,
    # but not when podman says the container does not exist (that is the answer).
    for _ in range(5):
        r = subprocess.run(["podman", "container", "inspect", name], capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout)[0]
        if "no such container" in r.stderr:
            return {}
        time.sleep(1)
    return {}


@pytest.fixture(scope="module")
def box(base_image, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    sb = make_sandbox("podman", SandboxSpec(image=base_image, workspace=ws, workspace_target="/work",
                                            cpus=1.5, memory_mb=512, pids_limit=256, env={"FOO": "bar"}))
    sb.start()
    sb.host_ws = ws
    yield sb
    sb.close()


def test_shell_state_in_container(box):
    r = box.run("pwd; echo $FOO; cd /tmp; v=1; f() { echo f$v; }")
    assert r.output == "/work\nbar\n" and r.exit_code == 0
    r = box.run("pwd; f; false")
    assert r.output == "/tmp\nf1\n" and r.exit_code == 1
    assert box.run("cat; echo done").output == "done\n"


def test_timeout_and_recovery_in_container(box):
    t0 = time.monotonic()
    r = box.run("echo before; sleep 60", timeout=1)
    assert r.timed_out and r.exit_code == 124 and "before" in r.output
    assert time.monotonic() - t0 < 5
    assert box.run("echo alive").output == "alive\n"
    # No stray sleep is left running in the container.
    ps = box.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
    assert "sleep 60" not in ps.output


def test_large_output_in_container(box):
    r = box.run("head -c 3750000 /dev/zero | base64 -w 100", timeout=60)
    assert r.exit_code == 0 and r.dropped_chars > 0 and len(r.output) < 1_010_000


def test_workspace_bind_mount(box):
    box.run("echo from-container > /work/w.txt")
    assert (box.host_ws / "w.txt").read_text() == "from-container\n"


def test_network_off_by_default(box):
    r = box.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert r.output.split() == ["lo"]


def test_limits_labels_and_ulimits(box):
    info = _inspect(box.name)
    hc = info["HostConfig"]
    assert (hc["CpuQuota"], hc["CpuPeriod"]) == (150_000, 100_000)
    assert hc["Memory"] == 512 * 1024 * 1024
    assert hc["PidsLimit"] == 256
    labels = info["Config"]["Labels"]
    assert labels[LABEL_KEY] == "1" and labels["io.tmax.pid"] == str(os.getpid())
    assert info["OCIRuntime"] == "runc"
    r = box.run("ulimit -Sn; ulimit -Hn; ulimit -u")
    assert r.output.split() == ["1024", "20000", "4096"]
    # The limits reach the kernel (cgroup v1 or v2 file names).
    quota = box.run("cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cat /sys/fs/cgroup/cpu.max").output
    assert quota.split()[0] == "150000"
    r = box.run("cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max")
    assert r.output.strip() == str(512 * 1024 * 1024)


def _i386_exit_42(path: Path) -> None:
    """A static 32-bit x86 ELF that exits 42 (`int 0x80`), written byte by byte."""
    import struct

    code = bytes([0xB8, 1, 0, 0, 0, 0xBB, 42, 0, 0, 0, 0xCD, 0x80])  # mov eax,1; mov ebx,42; int 0x80
    base, eh, ph = 0x08048000, 52, 32
    header = b"\x7fELF" + bytes([1, 1, 1, 0]) + b"\0" * 8 + struct.pack(
        "<HHIIIIIHHHHHH", 2, 3, 1, base + eh + ph, eh, 0, 0, eh, ph, 1, 0, 0, 0)
    size = eh + ph + len(code)
    path.write_bytes(header + struct.pack("<IIIIIIII", 1, 0, base, base, size, size, 5, 0x1000) + code)
    path.chmod(0o755)


def test_seccomp_is_the_default_profile_for_every_abi_the_kernel_runs(box, tmp_path):
    import json
    import platform

    from tmax.sandbox.podman import DEFAULT_SECCOMP_PROFILE, seccomp_profile

    assert box.run("grep -E '^Seccomp:' /proc/self/status").output.split() == ["Seccomp:", "2"]
    path = seccomp_profile()
    if path is not None:  # the same rules as podman's own profile; only an ABI the kernel lacks is left out
        ours, default = json.loads(Path(path).read_text()), json.loads(DEFAULT_SECCOMP_PROFILE.read_text())
        assert ours["syscalls"] == default["syscalls"] and ours["defaultAction"] == default["defaultAction"]
        x86 = next(a for a in ours["archMap"] if a["architecture"] == "SCMP_ARCH_X86_64")
        assert x86["subArchitectures"] == ["SCMP_ARCH_X86"]
    if platform.machine() != "x86_64":
        return
    _i386_exit_42(tmp_path / "e32")
    if subprocess.run([tmp_path / "e32"]).returncode == 42:  # the host runs 32-bit programs: so does the container
        box.copy_in(tmp_path / "e32", "/opt/e32")
        assert box.run("/opt/e32; echo rc=$?").output.strip() == "rc=42"


def test_a_seccomp_profile_named_in_containers_conf_is_left_to_podman(tmp_path, monkeypatch):
    from tmax.sandbox import podman

    conf = tmp_path / "containers.conf"
    conf.write_text('[containers]\nseccomp_profile = "/etc/my-profile.json"\n')
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    podman._seccomp_profile_text.cache_clear()
    try:
        assert podman.seccomp_profile() is None
        assert "seccomp_profile_path" not in podman.PodmanSandbox().create_kwargs()
    finally:
        monkeypatch.delenv("CONTAINERS_CONF")
        podman._seccomp_profile_text.cache_clear()


def test_exec_streams_env_workdir_timeout(box):
    box.run("export ONLY_SHELL=1")
    r = box.exec(["sh", "-c", "pwd; echo ${ONLY_SHELL:-none} $X; echo oops >&2; exit 4"], workdir="/etc", env={"X": "y"})
    assert (r.output, r.stderr, r.exit_code) == ("/etc\nnone y\n", "oops\n", 4)
    t0 = time.monotonic()
    r = box.exec(["sleep", "30"], timeout=1)
    assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 10


def test_copy_in_and_out(box, tmp_path):
    src = tmp_path / "tree"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.txt").write_text("x-content")
    (src / "top.txt").write_text("top")
    box.copy_in(src, "/opt/deep/tree")
    box.copy_in(src / "top.txt", "/opt/single.txt")
    assert box.run("cat /opt/deep/tree/a/x.txt /opt/single.txt").output == "x-contenttop"
    box.run("mkdir -p /srv/out/sub && echo made > /srv/out/sub/m.txt")
    box.copy_out("/srv/out", tmp_path / "got")
    assert (tmp_path / "got" / "sub" / "m.txt").read_text() == "made\n"
    box.copy_out("/opt/single.txt", tmp_path / "single_back.txt")
    assert (tmp_path / "single_back.txt").read_text() == "top"
    with pytest.raises(SandboxError, match="not found"):
        box.copy_out("/no/such/file", tmp_path / "nothing")


def test_exit_and_killed_shell_restart_in_container(box):
    r = box.run("exit 3")
    assert r.exit_code == 3 and "restarted" in r.note
    pid = box.shell.inner_pid
    assert box.exec(["sh", "-c", f"kill -9 {pid}"]).exit_code == 0
    time.sleep(0.5)
    time.sleep(0.3)
    r = box.run("echo back")
    assert r.output == "back\n" and "restarted" in r.note


def test_network_on_request_and_close_removes(base_image):
    sb = make_sandbox("podman", SandboxSpec(image=base_image, network=True))
    sb.start()
    name = sb.name
    try:
        ifaces = sb.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '").output.split()
        assert "lo" in ifaces and len(ifaces) > 1
    finally:
        sb.close()
    assert _inspect(name) == {}
    sb.close()  # idempotent


def test_close_during_start_leaves_no_container(base_image):
    """A job's Ctrl-C closes sandboxes from another thread, maybe while `start` is still
    creating the container: wherever the close lands, no container is left behind."""
    import threading

    for delay in (0.0, 0.05, 0.15, 0.3, 0.5, 0.8):
        sb = make_sandbox("podman", SandboxSpec(image=base_image))
        starting = threading.Thread(target=lambda: _start_quietly(sb))
        starting.start()
        time.sleep(delay)
        sb.close()
        starting.join(60)
        left = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"name=^{sb.name}$"],
                              capture_output=True, text=True).stdout.split()
        assert left == [], f"closed {delay} s into start: {sb.name} was left"


def _start_quietly(sb) -> None:
    try:
        sb.start()
    except SandboxError:
        pass  # closed before or while starting


def test_missing_image_is_a_clear_error(podman_service):
    sb = make_sandbox("podman", SandboxSpec(image="localhost/tmax-no-such-image:0"))
    with pytest.raises(SandboxError, match="not found"):
        sb.start()


def test_clean_removes_dead_owners_only(base_image):
    from tmax.sandbox.cleanup import clean

    run_label = {"io.tmax.test": secrets.token_hex(6)}
    dead = make_sandbox("podman", SandboxSpec(image=base_image, labels={**run_label, "io.tmax.pid": "999999999"}))
    live = make_sandbox("podman", SandboxSpec(image=base_image, labels=run_label))
    dead.start()
    live.start()
    try:
        rep = clean(labels=run_label)
        assert rep.containers == [dead.name] and not rep.errors
        assert _inspect(dead.name) == {}
        assert _inspect(live.name)["State"]["Running"]
        rep = clean(labels=run_label, all_owners=True)
        assert rep.containers == [live.name]
    finally:
        dead.container = None  # already removed
        dead.close()
        live.close()


def test_service_lifecycle_and_stale_cleanup(tmp_path):
    from tmax.sandbox.podman_service import PodmanService, clean_stale_services, ping

    svc = PodmanService(base_dir=str(tmp_path))
    url = svc.start()
    pid = svc.proc.pid
    assert ping(url)
    # conmon inherits it, and leaves `oom` there when a container process is OOM-killed.
    assert psutil.Process(pid).cwd() == str(svc.dir)
    # Pretend the owner died without cleaning up.
    (svc.dir / "owner.pid").write_text("999999999")
    removed = clean_stale_services(str(tmp_path))
    assert removed == [str(svc.dir)]
    svc.proc.wait(timeout=15)
    assert not ping(url)
    svc.dir = None
    svc.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_import_rootfs_bakes_ca_and_config(podman_service, tmp_path):
    """The import half of build-base, on a tiny rootfs (host bash and its libraries)."""
    from tmax.sandbox.base_image import BASE_LABEL_KEY, import_rootfs, prepare_rootfs

    root = tmp_path / "rootfs"
    bash = Path(shutil.which("bash")).resolve()
    files = [bash]
    for line in subprocess.run(["ldd", str(bash)], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        files += [Path(p) for p in parts if p.startswith("/")]
    for f in files:
        dst = root / f.relative_to("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    (root / "bin").mkdir(exist_ok=True)
    if not (root / "bin" / "bash").exists():
        os.symlink(str(bash), root / "bin" / "bash")
    (root / "root").mkdir()
    prepare_rootfs(root)
    tag = f"localhost/tmax-test-import:{secrets.token_hex(4)}"
    try:
        import_rootfs(root, tag)
        r = subprocess.run(["podman", "run", "--rm", "--network", "none", tag, "bash", "-c",
                            'pwd; echo "$PATH"; echo "$SSL_CERT_FILE"; read -r l < /etc/ssl/certs/ca-certificates.crt; echo "$l"'],
                           capture_output=True, text=True, timeout=60)
        out = r.stdout.splitlines()
        assert r.returncode == 0, r.stderr
        assert out[0] == "/root"
        assert "/usr/bin" in out[1]
        assert out[2] == "/etc/ssl/certs/ca-certificates.crt"
        assert out[3] == Path("/etc/ssl/certs/ca-certificates.crt").read_text().splitlines()[0]
        lbl = subprocess.run(["podman", "image", "inspect", tag, "--format", "{{json .Labels}}"],
                             capture_output=True, text=True).stdout
        assert BASE_LABEL_KEY in lbl
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)


def test_pool_of_containers(base_image):
    from tmax.sandbox.pool import SpecPool

    with SpecPool("podman", SandboxSpec(image=base_image), size=2) as pool:
        a = pool.acquire()
        b = pool.acquire()
        assert a.name != b.name
        with pytest.raises(SandboxError, match="no free sandbox"):
            pool.acquire(timeout=0.5)
        name = a.name
        pool.release(a)
        assert _inspect(name) == {}
        pool.release(b)


def test_interrupt_reaches_container(box):
    # Ctrl-C through `podman exec -it` reaches the foreground job inside.
    import threading

    threading.Timer(0.5, box.interrupt).start()
    r = box.run("sleep 30; echo not-reached", timeout=15)
    assert r.exit_code == 130 and not r.timed_out and "not-reached" not in r.output


def test_cli_build_base_cached_and_clean_dry_run(base_image):
    from typer.testing import CliRunner

    from tmax.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["sandbox", "build-base", "--tag", base_image])
    assert r.exit_code == 0, r.output
    assert base_image in r.output
    r = runner.invoke(app, documented("tmax sandbox clean --dry-run")[1:])
    assert r.exit_code == 0, r.output
    assert "would remove" in r.output and "containers" in r.output


def test_service_dies_with_killed_owner(tmp_path):
    """A tmax process killed by SIGKILL (no exit handlers) leaves no service running."""
    import sys

    code = ("import os, tempfile, time; tempfile.tempdir = os.environ['T'];"
            "from tmax.sandbox import podman_service as ps; ps.service_url();"
            "print(ps._service.proc.pid, flush=True); time.sleep(300)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "T": str(tmp_path)})
    try:
        pid = int(p.stdout.readline())
        os.kill(pid, 0)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if p.poll() is None:
            p.kill()


def test_exec_outlasts_the_client_http_timeout(base_image, monkeypatch):
    # Verifiers and oracle scripts run for minutes: a one-off exec must not be cut by the
    # HTTP timeout of the client that manages the container.
    from tmax.sandbox import podman_service

    real = podman_service.client
    monkeypatch.setattr(podman_service, "client", lambda runtime="runc", timeout=2: real(runtime, timeout=timeout))
    sb = make_sandbox("podman", SandboxSpec(image=base_image))
    sb.start()
    try:
        r = sb.exec(["sh", "-c", "sleep 4; echo done"], timeout=30)
        assert r.exit_code == 0 and "done" in r.output, r
    finally:
        sb.close()


def test_force_interrupt_kills_the_command_group_in_container(box):
    import threading

    threading.Timer(1.0, box.interrupt, kwargs={"force": True}).start()
    t0 = time.monotonic()
    r = box.run("export KEEP=1; bash -c \"trap '' INT; sleep 100 | cat\"; echo after=$?", timeout=60)
    assert time.monotonic() - t0 < 10 and r.output.endswith("after=137\n")
    assert box.run("echo KEEP=$KEEP").output == "KEEP=1\n"  # the shell itself survived
