"""What runs in the sandbox before the verifier: a harness against a model endpoint
(`tmax`, `mini-swe`, `terminus-2`: `agents.harnesses`), `oracle` (the task's reference
solution) and `nop` (nothing: the floor)."""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tmax.agents.harnesses import HARNESSES, check_harness
from tmax.agents.settings import AgentSettings
from tmax.sandbox.base import Sandbox, SandboxError
from tmax.tasks.longexec import run_long
from tmax.tasks.model import Task
from tmax.tasks.offline import RewriteConfig, copy_patched

AGENTS = (*HARNESSES, "oracle", "nop")
ABANDON_GRACE_S = 60.0


@dataclass
class AgentRun:
    timed_out: bool = False
    error: str | None = None  # an agent-side failure that is not infrastructure (model error...)
    n_input_tokens: int = 0
    n_output_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)


class TrialAgent(Protocol):
    name: str
    version: str
    uses_shell: bool  # whether it types into the sandbox's persistent shell (else exec/copy only)

    def run(self, sandbox: Sandbox, task: Task, workdir: str, agent_dir: Path, timeout: float,
            cancel: threading.Event) -> AgentRun: ...


class NopAgent:
    name = "nop"
    version = "1"
    uses_shell = False

    def run(self, sandbox, task, workdir, agent_dir, timeout, cancel) -> AgentRun:
        return AgentRun()


class OracleAgent:
    """Copies `solution/` (with the offline patches) to /solution and runs solve.sh."""

    name = "oracle"
    version = "1"
    uses_shell = False

    def __init__(self, rewrite: RewriteConfig):
        self.rewrite = rewrite

    def run(self, sandbox, task, workdir, agent_dir, timeout, cancel) -> AgentRun:
        if not task.has_solution:
            return AgentRun(error=f"{task.name} has no solution/solve.sh")
        if sandbox.kind != "podman":
            return self._run_on_host(sandbox, task, workdir, agent_dir, timeout)
        with tempfile.TemporaryDirectory(prefix="tmax-oracle-") as tmp:
            sol = Path(tmp) / "solution"
            notes = copy_patched(task, "solution", sol, self.rewrite)
            sandbox.copy_in(sol, "/solution")
        # One exec starts solve.sh, waits for it and brings back the end of its log.
        res = run_long(sandbox, "bash /solution/solve.sh", timeout, workdir=workdir, log_path="/tmp/tmax-oracle.txt",
                       tail_bytes=2_000_000)
        agent_dir.mkdir(parents=True, exist_ok=True)
        (agent_dir / "oracle.txt").write_text("".join(f"# tmax: {n}\n" for n in notes) + res.output,
                                              errors="replace")
        timed_out = res.timed_out
        return AgentRun(timed_out=timed_out,
                        metadata={"exit_code": res.exit_code, "duration_s": round(res.duration_s, 3)})

    def _run_on_host(self, sandbox, task, workdir, agent_dir, timeout) -> AgentRun:
        """Host sandboxes share no private /solution: the solution goes to a fresh
        directory under the sandbox's /tmp and solve.sh runs there as one process."""
        sol = f"/tmp/tmax-solution-{uuid.uuid4().hex[:12]}"
        try:
            with tempfile.TemporaryDirectory(prefix="tmax-oracle-") as tmp:
                notes = copy_patched(task, "solution", Path(tmp) / "solution", self.rewrite)
                sandbox.copy_in(Path(tmp) / "solution", sol)
            res = sandbox.exec(["bash", "-c", f"bash {sol}/solve.sh 2>&1"], timeout=timeout, workdir=workdir)
        finally:
            try:
                sandbox.exec(["rm", "-rf", sol], timeout=60)
            except SandboxError:
                pass
        agent_dir.mkdir(parents=True, exist_ok=True)
        (agent_dir / "oracle.txt").write_text("".join(f"# tmax: {n}\n" for n in notes) + res.output[-2_000_000:],
                                              errors="replace")
        return AgentRun(timed_out=res.timed_out,
                        metadata={"exit_code": res.exit_code, "duration_s": round(res.duration_s, 3)})


class TmaxAgent:
    """A harness (`agents.loop.Agent` + `ChatPolicy` + `agents.harnesses`) against an
    OpenAI-compatible endpoint. The agent timeout is enforced from outside: at the deadline
    the running command is interrupted and the loop is stopped at its next step."""

    version = "0.1.0"
    uses_shell = True

    def __init__(self, model: str, base_url: str, api_key: str | None = None, settings: AgentSettings | None = None,
                 harness: str = "tmax"):
        self.model, self.base_url, self.api_key = model, base_url, api_key or "dummy"
        self.settings = settings or AgentSettings()
        self.name = check_harness(harness, "agent")
        self._client: Any = None  # one OpenAI client for every trial (`_shared_client`)
        self._client_lock = threading.Lock()

    def _shared_client(self) -> Any:
        from tmax.agents.chat_policy import openai_client

        with self._client_lock:
            if self._client is None:
                self._client = openai_client(self.base_url, self.api_key)
            return self._client

    def _agent(self, sandbox, workdir: str, agent_dir: Path, hooks, timeout: float):
        """The loop for this harness with the job's agent settings, recording into agent_dir."""
        from tmax.agents.chat_policy import ChatPolicy
        from tmax.agents.harnesses import make_harness
        from tmax.agents.loop import Agent
        from tmax.agents.records import Recorder

        # What budget hints show, if on: the agent timeout unless a time budget was set.
        config = self.settings.model_copy(update={"time_budget_s": self.settings.time_budget_s or timeout})
        policy = ChatPolicy(model=self.model, client=self._shared_client(), temperature=config.temperature,
                            top_p=config.top_p, max_tokens=config.max_tokens)
        agent_dir.mkdir(parents=True, exist_ok=True)
        return Agent(policy, sandbox, config=config, recorder=Recorder(agent_dir), hooks=hooks,
                     harness=make_harness(self.name, workdir))

    def run(self, sandbox, task, workdir, agent_dir, timeout, cancel) -> AgentRun:
        from tmax.agents.atif import write_atif
        from tmax.agents.loop import AgentHooks

        stop = threading.Event()

        class _Stop(Exception):
            pass

        class Hooks(AgentHooks):
            def on_step_start(self, step: int) -> None:
                if stop.is_set() or cancel.is_set():
                    raise _Stop()

            def on_model_turn(self, step, turn, command) -> None:
                if stop.is_set() or cancel.is_set():
                    raise _Stop()

        def fire() -> None:
            stop.set()
            try:
                harness.interrupt(sandbox)
            except Exception:
                pass

        agent = self._agent(sandbox, workdir, agent_dir, Hooks(), timeout)
        harness = agent.harness
        done = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + timeout
            while not done.wait(0.5):
                if cancel.is_set() or time.monotonic() >= deadline:
                    fire()
                    return

        threading.Thread(target=watch, daemon=True, name="tmax-agent-deadline").start()
        out = AgentRun()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["result"] = agent.run(task.instruction)
            except BaseException as e:  # handed back to the trial thread
                box["error"] = e

        # A model call cannot be interrupted from outside; if one hangs past the deadline
        # (plus a grace period) the run is abandoned and the verifier goes ahead.
        worker = threading.Thread(target=work, daemon=True, name="tmax-agent")
        worker.start()
        worker.join(timeout + ABANDON_GRACE_S)
        done.set()
        if not worker.is_alive():
            harness.close()
        if worker.is_alive():
            stop.set()
            out.metadata = {"status": "abandoned"}
        elif isinstance(box.get("error"), _Stop):
            out.metadata = {"status": "stopped"}
        elif "error" in box:
            err = box["error"]
            if isinstance(err, SandboxError):
                raise err
            raise SandboxError(f"the agent loop failed: {err!r}") from err
        else:
            result = box["result"]
            out.metadata = {"status": result.status, "steps": result.steps, "error": result.error}
            if result.status == "sandbox_error" and not stop.is_set() and not cancel.is_set():
                raise SandboxError(result.error or "the sandbox failed during the agent run")
            if result.status == "model_error" and not stop.is_set():
                out.error = f"model error: {result.error}"
        # The trajectory also in ATIF, for Harbor's tools and the leaderboard.
        write_atif(agent_dir, agent_name=self.name, agent_version=self.version, model_name=self.model,
                   session_id=agent_dir.parent.name, tools=harness.tools)
        out.n_input_tokens = agent.usage.prompt_tokens
        out.n_output_tokens = agent.usage.completion_tokens
        out.timed_out = stop.is_set() and not cancel.is_set()
        return out


def make_agent(name: str, rewrite: RewriteConfig, model: str | None = None, base_url: str | None = None,
               api_key: str | None = None, settings: AgentSettings | None = None) -> TrialAgent:
    if name == "nop":
        return NopAgent()
    if name == "oracle":
        return OracleAgent(rewrite)
    if name in HARNESSES:
        if not model or not base_url:
            raise ValueError(f"the {name} agent needs a model (-m) and an endpoint (--base-url)")
        return TmaxAgent(model, base_url, api_key, settings, harness=name)
    raise ValueError(f"unknown agent {name!r}: choose one of {', '.join(AGENTS)}")
