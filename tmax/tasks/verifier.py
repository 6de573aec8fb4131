"""Run a task's verifier in its sandbox and read the reward.

Harbor's protocol: after the agent stops, `tests/` is copied to `/tests`, `/logs/verifier`
exists, and `bash /tests/test.sh` runs as the image's USER (root), or as `[verifier] user`,
in the image WORKDIR; the reward is the
number in `/logs/verifier/reward.txt` (or `reward.json`).

Offline, TB2's test.sh cannot bootstrap uv (installer and CPython come from GitHub), so
the script runs as a rewritten copy: the uv install lines go, and `uvx -w PIN ... pytest
ARGS` becomes a venv with the same pins from PyPI running the same pytest. Every other
line (apt installs of test tools, fixture copies, the reward write) is kept.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shlex
import shutil
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from tmax.sandbox.base import IMAGE_USER, CommandResult, Sandbox, SandboxError
from tmax.tasks.task_format import Task

VENV = "/opt/tmax-verifier"
SCRIPT_PATH = "/tmp/tmax-test.sh"
# test.sh exits with this when the verifier's own dependencies could not be installed:
# that is a verifier error, not a reward of 0.
SETUP_FAILED_RC = 97

# uv/uvx options that take a value and do not matter once we run from a venv.
_UVX_VALUE_OPTS = {"-p", "--python", "--index", "--index-url", "--extra-index-url", "--index-strategy",
                   "--from", "--default-index", "-i"}
_UVX_PIN_OPTS = {"-w", "--with"}


class VerifierKind(StrEnum):
    """How a verifier run ended. Bench (`tasks.trial`) and learn (`training.rollout`) map
    the kind to their own outcomes; the message is only for people."""

    OK = "ok"  # a reward was read
    TIMEOUT = "verifier_timeout"  # test.sh ran past its timeout (the agent may have left it hanging)
    NO_REWARD = "no_reward"  # test.sh ended without writing reward.txt / reward.json
    EMPTY_REWARD = "empty_reward"  # reward.txt exists but is empty
    PARSE_ERROR = "parse_error"  # the reward file holds no usable number
    SETUP_FAILED = "setup_failed"  # the verifier's own dependencies could not be installed
    INFRA = "infra"  # the sandbox failed while the verifier was being staged or run


@dataclass
class VerifierOutcome:
    reward: float | None
    kind: VerifierKind
    error: str | None = None
    exit_code: int | None = None
    duration_s: float = 0.0


class RewardRead(NamedTuple):
    """What the reward files said: the reward clamped to [0, 1], or why there is none."""

    reward: float | None
    kind: VerifierKind
    error: str | None = None


def _logical_lines(text: str) -> list[str]:
    """Join backslash-continued lines so a multi-line uvx command is one unit."""
    out, buf = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\") and not line.lstrip().startswith("#"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    if buf:
        out.append(buf)
    return out


def _venv_block(pins: list[str], command: list[str], needs_headers: bool) -> list[str]:
    lines = [
        "# tmax offline rewrite: uv's installer and managed Python come from GitHub;",
        "# run the same pytest with the same pins from a venv instead.",
        '{ command -v python3 >/dev/null && python3 -c "import ensurepip" 2>/dev/null; } || '
        "{ apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv; }",
    ]
    if needs_headers:
        lines.append("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-dev gcc")
    lines.append(f"python3 -m venv {VENV} && export PATH={VENV}/bin:$PATH || "
                 f"{{ echo 'tmax: could not create the verifier venv' >&2; exit {SETUP_FAILED_RC}; }}")
    if pins:
        lines.append(f"pip install -q {' '.join(shlex.quote(p) for p in pins)} || "
                     f"{{ echo 'tmax: verifier dependencies failed to install' >&2; exit {SETUP_FAILED_RC}; }}")
    lines.append(" ".join(shlex.quote(c) for c in command))
    return lines


def _rewrite_uvx(tokens: list[str], needs_headers: bool) -> list[str] | None:
    pins, i = [], 1
    while i < len(tokens):
        t = tokens[i]
        if t in _UVX_PIN_OPTS and i + 1 < len(tokens):
            pins.append(tokens[i + 1])
            i += 2
        elif any(t.startswith(o + "=") for o in _UVX_PIN_OPTS):
            pins.append(t.split("=", 1)[1])
            i += 1
        elif t in _UVX_VALUE_OPTS:
            i += 2
        elif t.startswith("-"):
            i += 1
        else:
            break
    if i >= len(tokens):
        return None
    tool, args = tokens[i], tokens[i + 1:]
    # `uvx pytest` installs the tool itself; keep its pin if one was given with -w.
    if not any(re.split(r"[=<>!~\[ ]", p, maxsplit=1)[0].lower() == tool.lower() for p in pins):
        pins.insert(0, tool)
    return _venv_block(pins, [tool, *args], needs_headers)


def rewrite_test_sh(text: str, needs_headers: bool = False) -> tuple[str, bool]:
    """Return (script, changed). Scripts that do not use uv come back unchanged."""
    out: list[str] = []
    changed = False
    for line in _logical_lines(text):
        s = line.strip()
        if "astral.sh/uv" in s and ("curl" in s or "wget" in s):
            out.append("# tmax offline rewrite: dropped the uv installer download")
            changed = True
            continue
        if re.fullmatch(r"(source|\.)\s+(\$HOME|~|\$\{HOME\})/\.local/bin/env", s):
            out.append("# tmax offline rewrite: dropped " + s)
            changed = True
            continue
        if s.startswith("uvx ") or s.startswith("uv tool run "):
            try:
                tokens = shlex.split(s)
            except ValueError:
                out.append(line)
                continue
            if tokens[:3] == ["uv", "tool", "run"]:
                tokens = ["uvx", *tokens[3:]]
            block = _rewrite_uvx(tokens, needs_headers)
            if block is not None:
                indent = line[: len(line) - len(line.lstrip())]
                out.extend(indent + b for b in block)
                changed = True
                continue
        out.append(line)
    return "\n".join(out) + "\n", changed


def verifier_script(task: Task) -> str:
    text = (task.tests_dir / "test.sh").read_text(encoding="utf-8", errors="replace")
    script, _ = rewrite_test_sh(text, needs_headers=(task.tests_dir / "setup.py").is_file())
    return script


def parse_reward(text: str | None, json_text: str | None) -> RewardRead:
    """The reward from reward.txt (preferred) or reward.json, clamped to [0, 1]."""
    if text is not None and text.strip():
        try:
            value = float(text.strip().split()[0])
        except ValueError:
            return RewardRead(None, VerifierKind.PARSE_ERROR, f"reward.txt is not a number: {text.strip()[:80]!r}")
        if math.isnan(value):
            return RewardRead(None, VerifierKind.PARSE_ERROR, "reward.txt is NaN")
        return RewardRead(min(1.0, max(0.0, value)), VerifierKind.OK)
    if json_text is not None and json_text.strip():
        return _parse_reward_json(json_text)
    if text is not None:
        return RewardRead(None, VerifierKind.EMPTY_REWARD, "reward.txt is empty")
    return RewardRead(None, VerifierKind.NO_REWARD, "no /logs/verifier/reward.txt or reward.json was written")


def _parse_reward_json(json_text: str) -> RewardRead:
    try:
        data = json.loads(json_text)
    except json.JSONDecodeError as e:
        return RewardRead(None, VerifierKind.PARSE_ERROR, f"reward.json is not JSON: {e}")
    value: float | None = None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        value = float(data)
    elif isinstance(data, dict):
        nums = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if nums:
            value = float(nums["reward"] if "reward" in nums else next(iter(nums.values())))
    if value is None:
        return RewardRead(None, VerifierKind.PARSE_ERROR, "reward.json has no numeric reward")
    if math.isnan(value):
        return RewardRead(None, VerifierKind.PARSE_ERROR, "reward.json reward is NaN")
    return RewardRead(min(1.0, max(0.0, value)), VerifierKind.OK)


GRACE_S = 30.0  # past the in-container timeout, before the exec itself is given up


# Tests up to this size (tar bytes) travel inside the verifier's exec, base64 in its bash
# program: a container sandbox's archive copy costs one more API call (about 0.14 s of CPU
# with podman, benchmarks/podman_episode_profile.py). One argument may hold 128 KiB.
INLINE_TESTS_MAX_BYTES = 48 * 1024


def _tar_of(stage: Path) -> bytes:
    """An uncompressed tar of the stage directory's entries (tests/, the rewritten test.sh)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in sorted(stage.iterdir()):
            tar.add(str(entry), arcname=entry.name)
    return buf.getvalue()


def _inline_unpack(archive: bytes, stage: str, tag: str) -> str:
    """Bash that unpacks `archive` (embedded as base64) into `stage`, or prints the
    no-unpack marker and stops where the image lacks tar or base64."""
    q = shlex.quote
    return "\n".join([
        "if ! command -v tar >/dev/null || ! command -v base64 >/dev/null; then",
        f"  echo \"__TMAX_{tag}_no_unpack__\"; exit 0",
        "fi",
        f"mkdir -p {q(stage)} && printf %s {base64.b64encode(archive).decode()} | base64 -d | tar -xf - -C {q(stage)} || "
        f"{{ echo \"__TMAX_{tag}_prep__ could not unpack the tests into {stage}\"; rm -rf {q(stage)}; exit 0; }}",
        "",
    ])


def _verifier_command(stage: str, script_path: str, rewritten: bool, timeout: float, tag: str,
                      user: str | None = None) -> str:
    """One bash program: move the staged tests/ to /tests (and the rewritten script to
    SCRIPT_PATH), run test.sh under `timeout`, then print its exit status and the reward
    files between markers, so one exec does what took one per step. With `user` (`[verifier]
    user`), the image's USER prepares and test.sh runs as that user (util-linux `runuser`),
    owning /tests and /logs/verifier."""
    q = shlex.quote
    moves = f"mv {q(stage)}/tests /tests"
    if rewritten:
        moves += f" && mv {q(stage)}/test.sh {SCRIPT_PATH}"
    run_as = ""
    if user:
        moves += f" && chown -R {q(user)} /tests /logs/verifier" + (f" {SCRIPT_PATH}" if rewritten else "")
        run_as = f"runuser -u \"$(id -nu {q(user)})\" -- "
    return "\n".join([
        f"if ! err=$({{ rm -rf /tests && mkdir -p /logs/verifier && {moves}; }} 2>&1); then",
        f"  echo \"__TMAX_{tag}_prep__ $err\"; rm -rf {q(stage)}; exit 0",
        "fi",
        f"rm -rf {q(stage)}",
        f"timeout --kill-after=10 {int(math.ceil(timeout))} {run_as}bash {script_path}"
        " > /logs/verifier/test-stdout.txt 2>&1",
        f"echo \"__TMAX_{tag}_rc__ $?\"",
        "for f in reward.txt reward.json; do",
        f"  [ -f /logs/verifier/$f ] && {{ echo \"__TMAX_{tag}_file__ $f\"; cat /logs/verifier/$f; echo; }}",
        "done",
        f"echo \"__TMAX_{tag}_end__\"",
    ])


def _parse_verifier_output(out: str, tag: str) -> tuple[str | None, int | None, dict[str, str]]:
    """(preparation error, test.sh exit status, reward file -> text) from the program's stdout."""
    prep = re.search(rf"^__TMAX_{tag}_prep__ (.*)", out, re.M | re.S)
    if prep:
        return prep.group(1).strip() or "unknown error", None, {}
    rc = re.search(rf"^__TMAX_{tag}_rc__ (\d+)$", out, re.M)
    files: dict[str, str] = {}
    parts = re.split(rf"^__TMAX_{tag}_(?:file__ (\S+)|end__)$\n?", out, flags=re.M)
    # parts: [before, name1, text1, name2, text2, None, after]
    for name, text in zip(parts[1::2], parts[2::2]):
        if name:
            files[name] = text[:-1] if text.endswith("\n") else text
    return None, int(rc.group(1)) if rc else None, files


def run_verifier(sandbox: Sandbox, task: Task, workdir: str, out_dir: Path | None,
                 timeout: float | None = None) -> VerifierOutcome:
    """One exec unpacks tests/ (and the rewritten test.sh; carried in the exec itself when
    small, else copied in as one archive first), moves them to /tests, runs the script and
    prints the reward; /logs/verifier is copied out to `out_dir`
    for people (None: nobody reads it, so it stays in the sandbox).
    SandboxError propagates: the caller labels it an infrastructure error."""
    timeout = timeout or task.config.verifier.timeout_sec
    tag = uuid.uuid4().hex[:12]
    stage = f"/tmp/.tmax-verifier-{tag}"
    script_text = verifier_script(task)
    # Only a rewritten script runs from elsewhere: an unchanged test.sh must run from
    # /tests, since scripts may find their fixtures next to themselves (BASH_SOURCE).
    rewritten = script_text != (task.tests_dir / "test.sh").read_text(encoding="utf-8", errors="replace")
    script_path = SCRIPT_PATH if rewritten else "/tests/test.sh"
    program = _verifier_command(stage, script_path, rewritten, timeout, tag, task.config.verifier.user)

    def run(unpack: str) -> CommandResult:
        return sandbox.exec(["bash", "-c", unpack + program], timeout=timeout + GRACE_S, workdir=workdir,
                            env=dict(task.config.verifier.env) or None, user=IMAGE_USER)

    with tempfile.TemporaryDirectory(prefix="tmax-verifier-") as tmp:
        shutil.copytree(task.tests_dir, Path(tmp) / "tests", symlinks=True)
        if rewritten:
            (Path(tmp) / "test.sh").write_text(script_text)
        archive = _tar_of(Path(tmp))
        inline = len(archive) <= INLINE_TESTS_MAX_BYTES and not sandbox.copy_is_cheap
        res = run(_inline_unpack(archive, stage, tag)) if inline else None
        if res is None or f"__TMAX_{tag}_no_unpack__" in res.output:
            # Too big for one argument, no tar / base64 in the image, or a sandbox whose copy
            # costs less than unpacking inside: the stage goes in through the sandbox's copy,
            # then the same program runs.
            sandbox.copy_in(Path(tmp), stage)
            res = run("")
    prep_error, rc, files = _parse_verifier_output(res.output, tag)
    if prep_error is not None:
        raise SandboxError(f"could not prepare /tests and /logs/verifier: {prep_error}")
    _keep_logs(sandbox, "/logs/verifier", out_dir)
    if res.timed_out or rc in (124, 137):
        return _timed_out(timeout, 124 if rc is None else rc, res.duration_s)
    if rc is None:
        raise SandboxError(f"the verifier did not report (exec exit {res.exit_code}): {res.stderr.strip()[-500:]}")
    return _scored(rc, parse_reward(files.get("reward.txt"), files.get("reward.json")), res.duration_s)


def _timed_out(timeout: float, rc: int | None, duration_s: float) -> VerifierOutcome:
    return VerifierOutcome(None, VerifierKind.TIMEOUT, f"verifier exceeded timeout_sec={timeout:.0f}s", rc, duration_s)


def _scored(rc: int | None, read: RewardRead, duration_s: float, logs: str = "/logs/verifier") -> VerifierOutcome:
    """test.sh ended on its own with exit status `rc`: its reward, or why there is none."""
    if rc == SETUP_FAILED_RC:
        return VerifierOutcome(None, VerifierKind.SETUP_FAILED, "verifier setup failed (see verifier/test-stdout.txt)",
                              rc, duration_s)
    if read.reward is None:
        why = (read.error or "").replace("/logs/verifier", logs)
        return VerifierOutcome(None, read.kind, f"{why} (test.sh exit {rc})", rc, duration_s)
    return VerifierOutcome(read.reward, VerifierKind.OK, None, rc, duration_s)


def _host_verifier_command(tests: str, logs: str, timeout: float, tag: str, clean: str | None) -> str:
    """One bash program for a host sandbox: create the logs dir, run test.sh under
    `timeout`, print its exit status and the reward files between the same markers as
    `_verifier_command`, and remove `clean` (the trial's directory) unless None."""
    q = shlex.quote
    return "\n".join([
        f"if ! err=$(mkdir -p {q(logs)}/verifier 2>&1); then echo \"__TMAX_{tag}_prep__ $err\"; exit 0; fi",
        f"timeout --kill-after=10 {int(math.ceil(timeout))} bash {q(tests)}/test.sh"
        f" > {q(logs)}/verifier/test-stdout.txt 2>&1",
        f"echo \"__TMAX_{tag}_rc__ $?\"",
        "for f in reward.txt reward.json; do",
        f"  [ -f {q(logs)}/verifier/$f ] && {{ echo \"__TMAX_{tag}_file__ $f\"; cat {q(logs)}/verifier/$f; echo; }}",
        "done",
        f"echo \"__TMAX_{tag}_end__\"",
        *([f"rm -rf {q(clean)}"] if clean else []),
    ])


def run_host_verifier(sandbox: Sandbox, task: Task, workdir: str, out_dir: Path | None,
                      timeout: float | None = None) -> VerifierOutcome:
    """The verifier on a host sandbox (`bwrap`, `local`), which has no private /tests or
    /logs: test.sh runs from a per-trial copy of `tests/` in a fresh directory under the
    sandbox's /tmp, with TMAX_WORKDIR / TMAX_TESTS_DIR / TMAX_LOGS_DIR saying where
    things are (the generated nano tasks honour them), and the reward is read from that
    trial's own logs dir. The directory is created only now, after the agent stopped.
    One exec runs it all (a process start costs more than a nano task's test); the
    directory goes with it unless the logs are copied out first (`out_dir`)."""
    timeout = timeout or task.config.verifier.timeout_sec
    tag = uuid.uuid4().hex[:12]
    root = f"/tmp/tmax-verifier-{tag}"
    tests, logs = f"{root}/tests", f"{root}/logs"
    cleaned = False
    try:
        sandbox.copy_in(task.tests_dir, tests)
        with tempfile.TemporaryDirectory(prefix="tmax-verifier-") as tmp:
            script = Path(tmp) / "test.sh"
            script.write_text(verifier_script(task))
            sandbox.copy_in(script, f"{tests}/test.sh")  # over the copy: fixtures stay next to it
        env = {**task.config.verifier.env, "TMAX_WORKDIR": workdir, "TMAX_TESTS_DIR": tests, "TMAX_LOGS_DIR": logs}
        program = _host_verifier_command(tests, logs, timeout, tag, None if out_dir else root)
        res = sandbox.exec(["bash", "-c", program], timeout=timeout + GRACE_S, workdir=workdir, env=env)
        prep_error, rc, files = _parse_verifier_output(res.output, tag)
        cleaned = out_dir is None and f"__TMAX_{tag}_end__" in res.output
        if prep_error is not None:
            raise SandboxError(f"could not create the verifier logs dir: {prep_error}")
        _keep_logs(sandbox, f"{logs}/verifier", out_dir)
        if res.timed_out or rc in (124, 137):
            return _timed_out(timeout, 124 if rc is None else rc, res.duration_s)
        if rc is None:
            raise SandboxError(f"the verifier did not report (exec exit {res.exit_code}): {res.stderr.strip()[-500:]}")
        read = parse_reward(files.get("reward.txt"), files.get("reward.json"))
        return _scored(rc, read, res.duration_s, logs="$TMAX_LOGS_DIR/verifier")
    finally:
        if not cleaned:
            try:
                sandbox.exec(["rm", "-rf", root], timeout=60)
            except SandboxError:
                pass


def _keep_logs(sandbox: Sandbox, logs: str, out_dir: Path | None) -> None:
    """Copy the verifier's logs out for people; the reward is read without them, so a
    failed copy loses nothing, and a learn rollout that records nothing skips it."""
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        sandbox.copy_out(logs, out_dir)
    except SandboxError:
        pass
    _flatten(out_dir)


def _flatten(out_dir: Path) -> None:
    """copy_out may land the directory as out_dir/verifier/...; keep files at out_dir/."""
    nested = out_dir / "verifier"
    if nested.is_dir() and not (out_dir / "reward.txt").exists():
        for p in nested.iterdir():
            target = out_dir / p.name
            if not target.exists():
                p.rename(target)
        try:
            nested.rmdir()
        except OSError:
            pass
