"""What runs in the sandbox before the verifier: a harness against a model endpoint
(`tmax`, `mini-swe`, `terminus-2`: `agents.harnesses`), `oracle` (the task's reference
solution) and `nop` (nothing: the floor)."""

from __future__ import annotations

import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import openai

from tmax.agents.driver import EpisodeDriver
from tmax.agents.harnesses import HARNESSES, check_harness
from tmax.agents.agent_settings import AgentSettings
from tmax.common.records import AgentMeta
from tmax.sandbox.base import Sandbox, SandboxError
from tmax.tasks.longexec import run_long
from tmax.tasks.task_format import Task
from tmax.tasks.offline import RewriteConfig, copy_patched

AGENTS = (*HARNESSES, "oracle", "nop")


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
        if not sandbox.capabilities.own_root:
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
    """A harness (`agents.harnesses`) driven by `agents.driver.EpisodeDriver` with a
    `ChatPolicy` against an OpenAI-compatible endpoint. At the agent timeout the running
    command is interrupted and the loop stops at its next step; a model call that hangs past
    it (and the driver's grace) is abandoned, and the trial's verifier runs all the same."""

    version = "0.1.0"
    uses_shell = True

    def __init__(self, model: str, base_url: str, api_key: str | None = None, settings: AgentSettings | None = None,
                 harness: str = "tmax"):
        self.model, self.base_url, self.api_key = model, base_url, api_key or "dummy"
        self.settings = settings or AgentSettings()
        self.name = check_harness(harness, "agent")
        self._client: openai.OpenAI | None = None  # one OpenAI client for every trial (`_shared_client`)
        self._client_lock = threading.Lock()

    def _shared_client(self) -> openai.OpenAI:
        from tmax.agents.chat_policy import openai_client

        with self._client_lock:
            if self._client is None:
                self._client = openai_client(self.base_url, self.api_key)
            return self._client

    def _driver(self, sandbox: Sandbox, workdir: str, agent_dir: Path, timeout: float,
                cancel: threading.Event) -> EpisodeDriver:
        """The loop for this harness with the job's agent settings, recording into agent_dir."""
        from tmax.agents.chat_policy import ChatPolicy
        from tmax.agents.harnesses import make_harness
        from tmax.agents.recorder import Recorder

        # What budget hints show, if on: the agent timeout unless a time budget was set.
        config = self.settings.model_copy(update={"time_budget_s": self.settings.time_budget_s or timeout})
        policy = ChatPolicy(model=self.model, client=self._shared_client(), temperature=config.temperature,
                            top_p=config.top_p, max_tokens=config.max_tokens)
        agent_dir.mkdir(parents=True, exist_ok=True)
        return EpisodeDriver(policy, sandbox, make_harness(self.name, workdir), config, recorder=Recorder(agent_dir),
                             timeout=timeout, cancel=cancel)

    def run(self, sandbox, task, workdir, agent_dir, timeout, cancel) -> AgentRun:
        from tmax.agents.atif import write_atif

        with self._driver(sandbox, workdir, agent_dir, timeout, cancel) as driver:
            try:
                result = driver.run(task.instruction)
            except SandboxError:
                raise
            except Exception as e:  # a defect in the loop or the harness: never the agent's failure
                raise SandboxError(f"the agent loop failed: {e!r}") from e
        if result.status == "sandbox_error" and not result.stopped:
            raise SandboxError(result.error or "the sandbox failed during the agent run")
        # The trajectory also in ATIF, for Harbor's tools and the leaderboard.
        write_atif(agent_dir, agent_name=self.name, agent_version=self.version, model_name=self.model,
                   session_id=agent_dir.parent.name, tools=driver.harness.tools)
        error = f"model error: {result.error}" if result.status == "model_error" and not result.stopped else None
        return AgentRun(timed_out=result.timed_out, error=error,
                        n_input_tokens=result.usage.prompt_tokens, n_output_tokens=result.usage.completion_tokens,
                        metadata=AgentMeta(status=result.status, steps=result.steps, error=result.error,
                                           llm_s=result.llm_s, exec_s=result.exec_s,
                                           turn_outcomes=result.turn_outcomes).model_dump(mode="json"))


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
