"""The in-container verifier: one exec per run (the tests inside it, or one archive copy
before it when large), the reward read from the exec's own output. The program's output format (pure) and the real thing in a podman
container (fixtures next to test.sh, reward.json, no reward, a timeout, a /tests the
agent left behind)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tmax.tasks.verifier import _parse_verifier_output

DATA = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"


def test_output_parsing():
    out = ("__TMAX_t1_rc__ 0\n__TMAX_t1_file__ reward.txt\n1\n\n"
           "__TMAX_t1_file__ reward.json\n{\"reward\": 0.5}\n__TMAX_t1_end__\n")
    assert _parse_verifier_output(out, "t1") == (None, 0, {"reward.txt": "1\n", "reward.json": '{"reward": 0.5}'})
    assert _parse_verifier_output("__TMAX_t1_rc__ 3\n__TMAX_t1_end__\n", "t1") == (None, 3, {})
    assert _parse_verifier_output("__TMAX_t1_rc__ 0\n__TMAX_t1_file__ reward.txt\n\n__TMAX_t1_end__\n",
                                  "t1") == (None, 0, {"reward.txt": ""})
    # Another run's markers (or none at all) are not this run's report.
    assert _parse_verifier_output("__TMAX_t2_rc__ 0\n", "t1") == (None, None, {})
    assert _parse_verifier_output("__TMAX_t1_prep__ mv: cannot move\n", "t1")[0] == "mv: cannot move"


def _task(tmp_path: Path, name: str, test_sh: str, timeout: float = 60):
    from tmax.tasks.task_format import Task

    d = tmp_path / name
    shutil.copytree(DATA, d)
    (d / "tests" / "test.sh").write_text(test_sh)
    (d / "tests" / "fixture.txt").write_text("from the fixture\n")
    toml = (d / "task.toml").read_text().replace("timeout_sec = 120.0\n\n[agent]",
                                                 f"timeout_sec = {timeout}\n\n[agent]")
    (d / "task.toml").write_text(toml)
    return Task.load(d)


@pytest.fixture(scope="module")
def container(base_image):
    from tmax.sandbox.base import SandboxSpec
    from tmax.sandbox.podman import PodmanSandbox

    sb = PodmanSandbox(SandboxSpec(image=base_image, workdir="/tmp"))
    sb.start()
    yield sb
    sb.close()


@pytest.mark.podman
def test_reward_fixtures_and_a_stale_tests_dir(container, tmp_path):
    from tmax.tasks.verifier import run_verifier

    container.exec(["bash", "-c", "mkdir -p /tests && echo planted > /tests/planted.txt"])
    task = _task(tmp_path, "json", '#!/bin/bash\nhere=$(dirname "${BASH_SOURCE[0]}")\n'
                 'ls /tests\ncat "$here/fixture.txt"; pwd\necho \'{"reward": 0.25}\' > /logs/verifier/reward.json\n')
    res = run_verifier(container, task, "/tmp", tmp_path / "out-json")
    assert (res.kind, res.reward, res.exit_code) == ("ok", 0.25, 0)
    log = (tmp_path / "out-json" / "test-stdout.txt").read_text()
    assert "from the fixture" in log and "planted" not in log and "/tmp" in log
    assert (tmp_path / "out-json" / "reward.json").exists()


@pytest.mark.podman
def test_no_reward_and_timeout(container, tmp_path):
    from tmax.tasks.verifier import run_verifier

    none = run_verifier(container, _task(tmp_path, "none", "#!/bin/bash\nrm -f /logs/verifier/*\nexit 3\n"),
                        "/tmp", tmp_path / "out-none")
    assert none.kind == "no_reward" and none.exit_code == 3 and "was written" in none.error
    slow = run_verifier(container, _task(tmp_path, "slow", "#!/bin/bash\nsleep 60\n", timeout=2),
                        "/tmp", tmp_path / "out-slow")
    assert slow.kind == "verifier_timeout" and slow.reward is None and slow.duration_s < 30


@pytest.mark.podman
def test_reward_without_a_log_copy(container, tmp_path):
    """A learn rollout that records nothing passes no out_dir: the reward still comes from
    the exec's own output, and nothing is copied out."""
    from tmax.tasks.verifier import run_verifier

    task = _task(tmp_path, "nolog", "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    res = run_verifier(container, task, "/tmp", None)
    assert (res.kind, res.reward) == ("ok", 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nolog"]


def _copies(sandbox) -> list[str]:
    """Where the sandbox's archive copies went during the test (a spy on the real copy_in)."""
    seen: list[str] = []
    real = sandbox.copy_in

    def spy(src, dst):
        seen.append(dst)
        return real(src, dst)

    sandbox.copy_in = spy
    return seen


@pytest.mark.podman
def test_small_tests_travel_in_the_exec_large_ones_by_copy(container, tmp_path):
    """Tests under the inline limit go in with the verifier's one exec (no archive copy);
    a larger stage is copied in first. Both arrive byte for byte."""
    import hashlib
    import os

    from tmax.tasks.verifier import INLINE_TESTS_MAX_BYTES, run_verifier

    check = ('#!/bin/bash\ncd "$(dirname "${BASH_SOURCE[0]}")"\n'
             'sha256sum -c sums.txt > /dev/null && echo 1 > /logs/verifier/reward.txt\n')
    copies = _copies(container)
    try:
        for name, size in (("small", 1000), ("large", INLINE_TESTS_MAX_BYTES + 1)):
            task = _task(tmp_path, name, check)
            blob = task.tests_dir / "blob.bin"
            blob.write_bytes(os.urandom(size))
            (task.tests_dir / "sums.txt").write_text(f"{hashlib.sha256(blob.read_bytes()).hexdigest()}  blob.bin\n")
            res = run_verifier(container, task, "/tmp", None)
            assert (res.kind, res.reward) == ("ok", 1.0), res
            assert len(copies) == (0 if name == "small" else 1)
    finally:
        del container.copy_in


@pytest.mark.podman
def test_an_image_without_tar_gets_its_tests_by_copy(base_image, tmp_path):
    from tmax.sandbox.base import SandboxSpec
    from tmax.sandbox.podman import PodmanSandbox
    from tmax.tasks.verifier import run_verifier

    sb = PodmanSandbox(SandboxSpec(image=base_image, workdir="/tmp", shell=False))
    sb.start()
    try:
        assert sb.exec(["bash", "-c", "rm -f $(command -v tar) && ! command -v tar"]).exit_code == 0
        copies = _copies(sb)
        task = _task(tmp_path, "notar", "#!/bin/bash\ncat /tests/fixture.txt && echo 1 > /logs/verifier/reward.txt\n")
        res = run_verifier(sb, task, "/tmp", tmp_path / "out")
        assert (res.kind, res.reward) == ("ok", 1.0) and len(copies) == 1
        assert "from the fixture" in (tmp_path / "out" / "test-stdout.txt").read_text()
    finally:
        sb.close()


def _host_verify(tmp_path: Path, task, out_dir: Path | None):
    """run_host_verifier on a local sandbox working in tmp_path/work."""
    from tmax.sandbox.base import SandboxSpec
    from tmax.sandbox.local import LocalSandbox
    from tmax.tasks.verifier import run_host_verifier

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    sb = LocalSandbox(SandboxSpec(workdir=str(work)))
    sb.start()
    try:
        return run_host_verifier(sb, task, str(work), out_dir)
    finally:
        sb.close()


def test_host_reward_without_a_log_copy(tmp_path):
    task = _task(tmp_path, "hostnolog", '#!/bin/bash\necho 1 > "$TMAX_LOGS_DIR/verifier/reward.txt"\n')
    res = _host_verify(tmp_path, task, None)
    assert (res.kind, res.reward) == ("ok", 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostnolog", "work"]


def _host_run(tmp_path: Path, task, out_dir: Path | None):
    """(result, whether the trial's directory is left), the directory named by the
    test.sh itself (other runs use /tmp meanwhile)."""
    res = _host_verify(tmp_path, task, out_dir)
    tests_dir = Path((tmp_path / "work" / "where").read_text().strip())
    return res, tests_dir.parent.exists()


def test_host_verifier_in_one_exec_scores_times_out_and_cleans_up(tmp_path):
    """The host verifier's one program: the reward, no reward, a timeout (test.sh killed,
    its directory removed), and the logs copied out before the directory goes."""
    where = 'echo "$TMAX_TESTS_DIR" > "$TMAX_WORKDIR/where"\n'
    ok = _task(tmp_path, "hostok", f'#!/bin/bash\n{where}echo pass\necho 0.5 > "$TMAX_LOGS_DIR/verifier/reward.txt"\n')
    res, left = _host_run(tmp_path, ok, None)
    assert (res.kind, res.reward, left) == ("ok", 0.5, False)

    none = _task(tmp_path, "hostnone", f"#!/bin/bash\n{where}exit 3\n")
    res, left = _host_run(tmp_path, none, None)
    assert (res.kind, res.reward, res.exit_code, left) == ("no_reward", None, 3, False)
    assert "test.sh exit 3" in res.error and "$TMAX_LOGS_DIR/verifier" in res.error

    slow = _task(tmp_path, "hostslow", f"#!/bin/bash\n{where}sleep 30\n", timeout=1)
    res, left = _host_run(tmp_path, slow, None)
    assert (res.kind, res.reward, left) == ("verifier_timeout", None, False)
    assert res.duration_s < 15

    logs = tmp_path / "logs"
    res, left = _host_run(tmp_path, ok, logs)
    assert (res.kind, res.reward, left) == ("ok", 0.5, False)
    assert (logs / "reward.txt").read_text().strip() == "0.5"
    assert (logs / "test-stdout.txt").read_text().strip() == "pass"
