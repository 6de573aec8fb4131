"""`tmax data generate`: the four-stage synthesis pipeline, gated and resumable.

The corpus is planned first (`axes.stratified_plan`): N slots whose strata (domain x
skill type) and other axes follow largest-remainder quotas, each slot's remaining draws from
its own seeded RNG (reproducible, independent of concurrency). Per slot: template -> initial-state test -> final-state
test -> environment + reference solution through an OpenAI-compatible endpoint. The
packaged task runs through the validation gates (`tasks.corpus.validate`); a failed gate
is fed back to the stage that owns it (build / initial / oracle -> the environment
stage, nop -> the final-test stage) for at most `max_retries` more rounds. Kept tasks
land in `<out>/<name>/`. A rejected task goes to `<out>/_rejected/<name>/` with
`rejection.json` (the gate, its reason, every round; a task that never parsed keeps only
that) and its slot is re-drawn from the same stratum (`axes.redraw`), at most
`max_redraws` times, so the kept corpus keeps the plan's balance.

State lives in `<out>/.generate/<name>.json`, rewritten after every stage, so a rerun
skips finished tasks and resumes unfinished ones where they stopped. Each slot is one job of
`tasks.job_runner` (local threads, or Ray nodes that see the corpus directory);
`<out>/.generate/slots/` holds the finished slots.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, Field

from tmax.common.records import (GateRound, GeneratedEnvironment, GenerationIdentity,
                                 GenerationStatus, Rejection, read_record, write_record)
from tmax.tasks.corpus import stage_prompts as prompts
from tmax.tasks.corpus.axes import CORPUS_KINDS, TaskAxes, load_axes, redraw, stratified_plan
from tmax.tasks.corpus.generate_config import GenerateConfig
from tmax.tasks.corpus.package import TaskParts, replace_dir, write_task
from tmax.tasks.job_runner import Backend, Finished, JobItem, JobRunner, ResultFiles
from tmax.tasks.corpus.validate import GateReport, validate_task
from tmax.tasks.offline import default_config

STATE_DIR = ".generate"
REJECTED_DIR = "_rejected"
RETRY_STAGE = {"load": "environment", "build": "environment", "initial": "environment",
               "oracle": "environment", "nop": "final"}


class GenerateError(RuntimeError):
    pass


class TaskState(BaseModel):
    name: str
    index: int  # the slot of the plan
    attempt: int = 0  # > 0: a re-draw after a rejected task
    axes: TaskAxes
    status: GenerationStatus = GenerationStatus.PENDING
    task: str | None = None
    truth: str | None = None
    initial_test: str | None = None
    final_test: str | None = None
    environment: GeneratedEnvironment | None = None
    feedback: dict[str, str] = Field(default_factory=dict)  # stage -> feedback for its next call
    rounds: list[GateRound] = Field(default_factory=list)
    calls: int = 0
    failed_gate: str | None = None
    pending_why: str | None = None  # why a pending task stopped (endpoint or infrastructure error)


@lru_cache(maxsize=4)
def _plan(n: int, seed: int, corpus_kind: str, axes_file: str | None) -> list[TaskAxes]:
    """The corpus plan, once per process (every slot job of a corpus needs the same one)."""
    return stratified_plan(n, seed, corpus_kind, load_axes(axes_file))


def task_name(seed: int, index: int, attempt: int = 0) -> str:
    key = f"{seed}:{index}" + (f":{attempt}" if attempt else "")
    return f"task_{index:06d}_{hashlib.sha256(key.encode()).hexdigest()[:8]}"


class Generator:
    def __init__(self, config: GenerateConfig, api_key: str | None = None):
        if config.corpus_kind not in CORPUS_KINDS:
            raise GenerateError(f"unknown corpus kind {config.corpus_kind!r}: {', '.join(CORPUS_KINDS)}")
        from openai import OpenAI

        self.config = config
        self.axes = load_axes(config.axes_file)
        self.plan = _plan(config.n, config.seed, config.corpus_kind, config.axes_file)
        self.out = Path(config.out).expanduser().resolve()
        self.state_dir = self.out / STATE_DIR
        self.api_key = api_key
        self.client = OpenAI(base_url=config.base_url, api_key=api_key or "dummy", max_retries=2)
        self.rewrite = default_config()

    # --- state ----------------------------------------------------------------------------
    def _check_identity(self) -> None:
        path = self.state_dir / "config.json"
        want = self.config.identity(self.axes)
        if path.is_file():
            have = read_record(path, GenerationIdentity).identity
            if have != want:
                raise GenerateError(f"{self.out} was generated with {have.model_dump()}, not {want.model_dump()}: "
                                    "use another --out (a resumed corpus keeps its seed, corpus kind and axes)")
        write_record(path, GenerationIdentity(identity=want, config=self.config.model_dump()))

    def load(self, index: int, attempt: int = 0) -> TaskState:
        name = task_name(self.config.seed, index, attempt)
        path = self.state_dir / f"{name}.json"
        if path.is_file():
            return TaskState.model_validate_json(path.read_text())
        axes = redraw(self.plan[index], self.config.seed, index, attempt, self.axes)
        return TaskState(name=name, index=index, attempt=attempt, axes=axes)

    def save(self, st: TaskState) -> None:
        write_record(self.state_dir / f"{st.name}.json", st)

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
        last = ""
        for _ in range(self.config.max_retries + 1):
            text = self._chat(st, stage, build(feedback))
            try:
                return parse(text)
            except prompts.ParseError as e:
                last = str(e)
                feedback = prompts.feedback_text("parse", last)
        raise prompts.ParseError(f"stage {stage}: no parseable answer after {self.config.max_retries + 1} tries "
                                 f"(the last: {last})")

    def _stages(self, st: TaskState) -> None:
        if st.task is None:
            st.task, st.truth = self._ask(st, "template", lambda fb: prompts.template_messages(st.axes, fb, self.axes),
                                          prompts.parse_template)
            self.save(st)
        if st.initial_test is None:
            st.initial_test = self._ask(st, "initial", lambda fb: prompts.initial_test_messages(st.task, st.truth),
                                        prompts.parse_python)
            self.save(st)
        if st.final_test is None:
            st.final_test = self._ask(st, "final", lambda fb: prompts.final_test_messages(
                st.task, st.truth, st.initial_test, fb, st.axes.verifier_kind), prompts.parse_python)
            self.save(st)
        if st.environment is None:
            dockerfile, files, solve = self._ask(st, "environment", lambda fb: prompts.environment_messages(
                st.axes.domain, st.task, st.truth, st.initial_test, st.final_test, fb), prompts.parse_environment)
            st.environment = GeneratedEnvironment(dockerfile=dockerfile, files=files, solve=solve)
            self.save(st)

    def _parts(self, st: TaskState) -> TaskParts:
        env = st.environment or GeneratedEnvironment()
        return TaskParts(name=st.name, axes=st.axes, instruction=st.task or "", truth=st.truth or "",
                         initial_test=st.initial_test, final_test=st.final_test or "",
                         dockerfile=env.dockerfile, env_files=env.files, solution=env.solve)

    def _gate_round(self, st: TaskState) -> GateReport:
        staged = self.state_dir / "staging" / st.name
        try:
            write_task(self._parts(st), staged)
        except ValueError as e:  # a file path outside the build context
            return GateReport(task=st.name, verdict="rejected", failed=["load"], reasons={"load": str(e)},
                              gates={"load": "failed"})
        return validate_task(staged, self.state_dir / "gates" / st.name, self.config.environment, self.rewrite)

    def _finish(self, st: TaskState, status: GenerationStatus) -> None:
        staged = self.state_dir / "staging" / st.name
        dest = self.out / st.name if status == "kept" else self.out / REJECTED_DIR / st.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if staged.exists():
            replace_dir(staged, dest)
        if status == "rejected":  # every reject keeps its reason, a parse failure included
            dest.mkdir(exist_ok=True)
            last = st.rounds[-1] if st.rounds else GateRound()
            write_record(dest / "rejection.json", Rejection(
                task=st.name, slot=st.index, attempt=st.attempt, failed_gate=st.failed_gate,
                reason=last.reasons.get(st.failed_gate or "", ""), rounds=st.rounds, axes=st.axes.metadata()))
        st.status = status
        self.save(st)

    def run_one(self, index: int, attempt: int = 0) -> TaskState:
        """Generate one task to its end; an endpoint failure leaves it pending (a rerun resumes)."""
        from openai import OpenAIError

        st = self.load(index, attempt)
        try:
            return self._run_one(st)
        except OpenAIError as e:
            st.status = GenerationStatus.PENDING
            st.pending_why = f"endpoint error: {type(e).__name__}: {e}"
            self.save(st)
            return st

    def run_slot(self, index: int) -> list[TaskState]:
        """A slot's tasks: the first, then a re-draw from its stratum after each rejection."""
        out = []
        for attempt in range(self.config.max_redraws + 1):
            st = self.run_one(index, attempt)
            out.append(st)
            if st.status != "rejected":
                break
        return out

    def _run_one(self, st: TaskState) -> TaskState:
        if st.status in ("kept", "rejected"):
            return st
        while True:
            try:
                self._stages(st)
            except prompts.ParseError as e:
                st.failed_gate = "parse"
                st.rounds.append(GateRound(failed=["parse"], reasons={"parse": str(e)}))
                self._finish(st, GenerationStatus.REJECTED)
                return st
            report = self._gate_round(st)
            if report.infra_errors:  # not the task's failure: stop, a rerun resumes here
                st.pending_why = f"infrastructure error in gates {', '.join(report.infra_errors)}"
                self.save(st)
                return st
            st.rounds.append(GateRound(failed=report.failed, reasons=report.reasons))
            if report.verdict == "ok":
                st.failed_gate = None
                self._finish(st, GenerationStatus.KEPT)
                return st
            gate = report.failed[0]
            if len(st.rounds) > self.config.max_retries:
                st.failed_gate = gate
                self._finish(st, GenerationStatus.REJECTED)
                return st
            stage = RETRY_STAGE[gate]
            st.feedback[stage] = prompts.feedback_text(gate, report.reasons.get(gate, ""))
            if stage == "final":
                st.final_test = None  # the environment and solution stay
            else:
                st.environment = None
            self.save(st)

    def run(self, backend: Backend | None = None,
            on_slot: Callable[[list[TaskState], bool], None] | None = None) -> list[TaskState]:
        """Every slot as a job item (local threads unless a backend is given). A slot
        whose tasks all finished before is read back, not run; `on_slot(states, resumed)`."""
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_identity()
        spec = self.config.model_dump_json()
        items = [JobItem(f"slot_{i:06d}", generate_slot, (spec, self.api_key, i),
                         json.dumps(self.config.identity(self.axes).model_dump())) for i in range(self.config.n)]

        def finished(f: Finished) -> None:
            if on_slot:
                on_slot([TaskState.model_validate(x) for x in f.result["states"]], f.resumed)

        store = ResultFiles(self.state_dir / "slots", done=lambda r: all(x["status"] != "pending" for x in r["states"]))
        results = JobRunner(store, backend, slots=self.config.n_concurrent).run(items, on_finished=finished)
        states = [TaskState.model_validate(x) for r in results.values() for x in r["states"]]
        return sorted(states, key=lambda s: (s.index, s.attempt))


def generate_slot(spec: str, api_key: str | None, index: int) -> dict:
    """One slot as a job item, on any node: its tasks' states (the task directories and
    per-task state files are written under the corpus as it goes)."""
    gen = Generator(GenerateConfig.model_validate_json(spec), api_key=api_key)
    return {"states": [st.model_dump() for st in gen.run_slot(index)]}
