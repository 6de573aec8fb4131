"""`tmax data generate`: the four-stage synthesis pipeline, gated and resumable.

Per task: sample the axes (a seeded RNG per task index, so a corpus is reproducible
and independent of concurrency), then template -> initial-state test -> final-state
test -> environment + reference solution through an OpenAI-compatible endpoint. The
packaged task runs through the validation gates (`tasks.corpus.validate`); a failed gate
is fed back to the stage that owns it (build / initial / oracle -> the environment
stage, nop -> the final-test stage) for at most `max_retries` more rounds. Kept tasks
land in `<out>/<name>/`, rejected ones in `<out>/_rejected/<name>/`.

State lives in `<out>/.generate/<name>.json`, rewritten after every stage, so a rerun
skips finished tasks and resumes unfinished ones where they stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, Field

from agents.records import write_json_atomic
from sandbox.base import KINDS
from tasks.corpus import prompts
from tasks.corpus.axes import CORPUS_KINDS, AxesConfig, TaskAxes, load_axes, sample_axes
from tasks.corpus.package import TaskParts, write_task
from tasks.corpus.validate import GateReport, validate_task
from tasks.offline import default_config

STATE_DIR = ".generate"
REJECTED_DIR = "_rejected"
RETRY_STAGE = {"load": "environment", "build": "environment", "initial": "environment",
               "oracle": "environment", "nop": "final"}


class GenerateError(RuntimeError):
    pass


class GenerateConfig(BaseModel):
    out: str
    n: int = Field(ge=1)
    seed: int = 0
    corpus_kind: str = "legacy"
    model: str
    base_url: str
    n_concurrent: int = Field(4, ge=1)
    max_retries: int = Field(3, ge=0)
    environment: str = "podman"
    max_tokens: int = Field(32768, ge=1)
    axes_file: str | None = None  # None: the bundled tasks/data/axes.toml

    def identity(self, axes: AxesConfig) -> dict:
        """What a resumed run must share with the first (the rest may change)."""
        return {"seed": self.seed, "corpus_kind": self.corpus_kind, "axes": axes.fingerprint()}


class TaskState(BaseModel):
    name: str
    index: int
    axes: TaskAxes
    status: str = "pending"  # pending | kept | rejected
    task: str | None = None
    truth: str | None = None
    initial_test: str | None = None
    final_test: str | None = None
    environment: dict | None = None  # dockerfile, files, solve
    feedback: dict[str, str] = Field(default_factory=dict)  # stage -> feedback for its next call
    rounds: list[dict] = Field(default_factory=list)  # per gate round: failed gates and reasons
    calls: int = 0
    failed_gate: str | None = None


def task_name(seed: int, index: int) -> str:
    return f"task_{index:06d}_{hashlib.sha256(f'{seed}:{index}'.encode()).hexdigest()[:8]}"


def initial_state(seed: int, index: int, corpus_kind: str, axes: AxesConfig | None = None) -> TaskState:
    rng = random.Random(f"tmax-data:{seed}:{index}")
    return TaskState(name=task_name(seed, index), index=index, axes=sample_axes(rng, corpus_kind, axes))


class Generator:
    def __init__(self, config: GenerateConfig, api_key: str | None = None,
                 on_event: Callable[[str, str], None] | None = None):
        if config.corpus_kind not in CORPUS_KINDS:
            raise GenerateError(f"unknown corpus kind {config.corpus_kind!r}: {', '.join(CORPUS_KINDS)}")
        if config.environment not in KINDS:
            raise GenerateError(f"unknown environment {config.environment!r}: {', '.join(KINDS)}")
        from openai import OpenAI

        self.config = config
        self.axes = load_axes(config.axes_file)
        self.out = Path(config.out).expanduser().resolve()
        self.state_dir = self.out / STATE_DIR
        self.client = OpenAI(base_url=config.base_url, api_key=api_key or "dummy", max_retries=2)
        self.rewrite = default_config()
        self.emit = on_event or (lambda name, what: None)
        self._lock = threading.Lock()

    # --- state ----------------------------------------------------------------------------
    def _check_identity(self) -> None:
        path = self.state_dir / "config.json"
        want = self.config.identity(self.axes)
        if path.is_file():
            have = json.loads(path.read_text()).get("identity")
            if have != want:
                raise GenerateError(f"{self.out} was generated with {have}, not {want}: use another --out "
                                    "(a resumed corpus keeps its seed, corpus kind and axes)")
        write_json_atomic(path, {"identity": want, "config": self.config.model_dump()})

    def load(self, index: int) -> TaskState:
        fresh = initial_state(self.config.seed, index, self.config.corpus_kind, self.axes)
        path = self.state_dir / f"{fresh.name}.json"
        if path.is_file():
            return TaskState.model_validate_json(path.read_text())
        return fresh

    def save(self, st: TaskState) -> None:
        write_json_atomic(self.state_dir / f"{st.name}.json", st.model_dump())

    # --- the model ------------------------------------------------------------------------
    def _chat(self, st: TaskState, stage: str, messages: list[dict]) -> str:
        r = self.client.chat.completions.create(model=self.config.model, messages=messages,
                                                temperature=prompts.TEMPERATURE[stage],
                                                max_tokens=self.config.max_tokens)
        st.calls += 1
        return r.choices[0].message.content or ""

    def _ask(self, st: TaskState, stage: str, build: Callable[[str | None], list[dict]], parse: Callable):
        """One stage with bounded retries on unparseable answers (the error is fed back)."""
        feedback = st.feedback.get(stage)
        for _ in range(self.config.max_retries + 1):
            text = self._chat(st, stage, build(feedback))
            try:
                return parse(text)
            except prompts.ParseError as e:
                feedback = prompts.feedback_text("parse", str(e))
        raise prompts.ParseError(f"stage {stage}: no parseable answer after {self.config.max_retries + 1} tries")

    def _stages(self, st: TaskState) -> None:
        if st.task is None:
            self.emit(st.name, "template")
            st.task, st.truth = self._ask(st, "template", lambda fb: prompts.template_messages(st.axes, fb, self.axes),
                                          prompts.parse_template)
            self.save(st)
        if st.initial_test is None:
            self.emit(st.name, "initial test")
            st.initial_test = self._ask(st, "initial", lambda fb: prompts.initial_test_messages(st.task, st.truth),
                                        prompts.parse_python)
            self.save(st)
        if st.final_test is None:
            self.emit(st.name, "final test")
            st.final_test = self._ask(st, "final", lambda fb: prompts.final_test_messages(
                st.task, st.truth, st.initial_test, fb, st.axes.verifier_kind), prompts.parse_python)
            self.save(st)
        if st.environment is None:
            self.emit(st.name, "environment")
            dockerfile, files, solve = self._ask(st, "environment", lambda fb: prompts.environment_messages(
                st.axes.domain, st.task, st.truth, st.initial_test, st.final_test, fb), prompts.parse_environment)
            st.environment = {"dockerfile": dockerfile, "files": files, "solve": solve}
            self.save(st)

    def _parts(self, st: TaskState) -> TaskParts:
        env = st.environment or {}
        return TaskParts(name=st.name, axes=st.axes, instruction=st.task or "", truth=st.truth or "",
                         initial_test=st.initial_test, final_test=st.final_test or "",
                         dockerfile=env.get("dockerfile", ""), env_files=env.get("files", {}),
                         solution=env.get("solve"))

    def _gate_round(self, st: TaskState) -> GateReport:
        staged = self.state_dir / "staging" / st.name
        try:
            write_task(self._parts(st), staged)
        except ValueError as e:  # a file path outside the build context
            return GateReport(task=st.name, verdict="rejected", failed=["load"], reasons={"load": str(e)},
                              gates={"load": "failed"})
        self.emit(st.name, "gates")
        return validate_task(staged, self.state_dir / "gates" / st.name, self.config.environment, self.rewrite)

    def _finish(self, st: TaskState, status: str) -> None:
        staged = self.state_dir / "staging" / st.name
        dest = self.out / st.name if status == "kept" else self.out / REJECTED_DIR / st.name
        if dest.exists():
            shutil.rmtree(dest)
        if staged.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(dest)
        st.status = status
        self.save(st)
        self.emit(st.name, f"{status} (gate {st.failed_gate})" if st.failed_gate else status)

    def run_one(self, index: int) -> TaskState:
        """Generate one task to its end; an endpoint failure leaves it pending (a rerun resumes)."""
        from openai import OpenAIError

        st = self.load(index)
        try:
            return self._run_one(st)
        except OpenAIError as e:
            st.status = "pending"
            self.save(st)
            self.emit(st.name, f"endpoint error: {type(e).__name__}: {e}")
            return st

    def _run_one(self, st: TaskState) -> TaskState:
        if st.status in ("kept", "rejected"):
            self.emit(st.name, f"{st.status} (done before)")
            return st
        while True:
            try:
                self._stages(st)
            except prompts.ParseError as e:
                st.failed_gate = "parse"
                st.rounds.append({"failed": ["parse"], "reasons": {"parse": str(e)}})
                self._finish(st, "rejected")
                return st
            report = self._gate_round(st)
            if report.infra_errors:  # not the task's failure: stop, a rerun resumes here
                self.emit(st.name, f"infrastructure error in gates {', '.join(report.infra_errors)}")
                return st
            st.rounds.append({"failed": report.failed, "reasons": report.reasons})
            if report.verdict == "ok":
                st.failed_gate = None
                self._finish(st, "kept")
                return st
            gate = report.failed[0]
            if len(st.rounds) > self.config.max_retries:
                st.failed_gate = gate
                self._finish(st, "rejected")
                return st
            stage = RETRY_STAGE[gate]
            st.feedback[stage] = prompts.feedback_text(gate, report.reasons.get(gate, ""))
            if stage == "final":
                st.final_test = None  # the environment and solution stay
            else:
                st.environment = None
            self.save(st)

    def run(self) -> list[TaskState]:
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_identity()
        results: list[TaskState] = []
        with ThreadPoolExecutor(max_workers=self.config.n_concurrent, thread_name_prefix="tmax-gen") as pool:
            futures = [pool.submit(self.run_one, i) for i in range(self.config.n)]
            for f in as_completed(futures):
                results.append(f.result())
        return sorted(results, key=lambda s: s.index)
