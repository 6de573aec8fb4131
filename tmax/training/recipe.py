"""The nano recipe's stages: build, task environments, SFT, held-out eval.

`training.entry` runs them in order (`tmax learn`: build -> SFT -> RL; `tmax learn nano`:
build -> SFT -> eval -> RL -> eval). Everything runs through the real components: the tiny
model and tasks are built here, SFT demonstrations are teacher episodes played through the
harness, RL is the Ray training loop with a vLLM engine, and both held-out evaluations are
`tmax bench` jobs (`tasks.job.Job`, the `tmax` agent, trials in host or podman sandboxes)
against that vLLM server, once with the SFT checkpoint loaded and once with the final RL
checkpoint loaded. There is no special evaluation path.

Layout of a recipe directory:

    base/        the nano model as built (tokenizer + random weights)
    tasks/       train/ and heldout/ Harbor task dirs
    sft/         SFT checkpoint (HF) + sft.json (written last: SFT is done), demos.jsonl
    rl/          the RL run (metrics.jsonl, rollouts.jsonl, checkpoints/, reward_curve.png)
    eval/        bench job dirs: sft/, rl/
    recipe.json  pass rates, stage timings

A later run in the same directory trusts what it finds (it skips building base/ and
tasks/, and SFT when sft/sft.json exists), so each is written whole or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from pydantic import BaseModel, computed_field

from tmax.common.files import write_dir_atomic, write_text_atomic
from tmax.common.records import SFT_RECORD, LearnRunDir, RunSummary, SftRecord, read_record
from tmax.common.proctree import TreeCpu
from tmax.training.agentic import HeldoutAgentic, heldout_agentic
from tmax.training.config import LearnConfig

if TYPE_CHECKING:
    from tmax.training.cluster.actors import EngineGroup
    from tmax.training.learner.sft import SFTResult
    from tmax.training.rollout import PreparedTasks

Log = Callable[[str], None]
T = TypeVar("T")


class CopyStage(BaseModel):
    """What copy pre-training did (`learner.copy_warmup`): its steps, final loss, the loss on
    the repeated words of fresh sequences after it (near 0: the model copies), seconds."""

    checkpoint: str
    steps: int
    final_loss: float | None
    repeat_nll: float
    seconds: float


class SftStage(BaseModel):
    """What SFT did; a run that found `sft/sft.json` reads it back (`skipped`), and a recipe
    without the SFT stage has only the starting checkpoint."""

    checkpoint: str
    demos: int = 0
    demos_solved: int | None = None  # not kept in sft.json: unknown when skipped
    tokens: int | None = None
    steps: int = 0
    final_loss: float | None = None  # mean of the last tenth of the step losses
    demo_s: float = 0.0
    train_s: float = 0.0
    skipped: bool = False
    copy_pretraining: CopyStage | None = None  # the copy pre-training SFT started from (`sft.copy_steps`)

    @classmethod
    def trained(cls, res: SFTResult, demos_solved: int | None = None, demo_s: float = 0.0,
                copy: CopyStage | None = None) -> SftStage:
        return cls(checkpoint=res.checkpoint, demos=res.demos, demos_solved=demos_solved, tokens=res.tokens,
                   steps=res.steps, final_loss=res.final_loss, demo_s=demo_s, train_s=res.seconds,
                   copy_pretraining=copy)


class HeldoutEval(BaseModel):
    """One held-out `tmax bench` job, scored by `Trial.score()` (infra errors count as
    trials, never as passes)."""

    pass_rate: float
    passed: int
    trials: int
    infra_errors: int
    seconds: float
    job_dir: str
    # Turns per trial and per solved one, where format errors and failed commands fall, the
    # pass rate by the number of commands a task needs (`training.agentic`).
    agentic: HeldoutAgentic | None = None


class RlStage(BaseModel):
    steps: int
    checkpoint: str | None
    summary: RunSummary
    curve: str | None


class RecipeResult(BaseModel):
    """`recipe.json`: each stage that ran, its held-out pass rates and stage seconds."""

    seed: int
    sft: SftStage
    sft_eval: HeldoutEval | None = None
    rl: RlStage | None = None
    rl_eval: HeldoutEval | None = None
    times: dict[str, float] = {}  # stage ("sft_s", ...) -> wall seconds
    # stage -> CPU seconds of this process and every process it started (Ray, vLLM, the
    # sandboxes): above the wall time when both cores worked, and less moved by other load.
    # A Ray cluster another process started (joined through RAY_ADDRESS) is not among them.
    cpu_times: dict[str, float] = {}

    @computed_field
    @property
    def sft_pass_rate(self) -> float | None:
        return self.sft_eval.pass_rate if self.sft_eval else None

    @computed_field
    @property
    def rl_pass_rate(self) -> float | None:
        return self.rl_eval.pass_rate if self.rl_eval else None

    @computed_field
    @property
    def gain_points(self) -> float | None:
        """Held-out pass rate after RL minus after SFT, in points."""
        if self.sft_eval is None or self.rl_eval is None:
            return None
        return round(100 * (self.rl_eval.pass_rate - self.sft_eval.pass_rate), 1)

    @computed_field
    @property
    def minutes_total(self) -> float | None:
        return round(self.times["total_s"] / 60, 2) if "total_s" in self.times else None


class StageClock:
    """Wall and CPU seconds (`common.proctree.TreeCpu`) of each stage of a recipe, under the
    keys of `RecipeResult.times` and `RecipeResult.cpu_times`. A context manager: its CPU
    sampling thread ends with the block."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._tree = TreeCpu()
        self._start = (time.monotonic(), self._tree.read())

    def __enter__(self) -> "StageClock":
        return self

    def __exit__(self, *exc: object) -> None:
        self._tree.close()

    @contextmanager
    def stage(self, key: str) -> Iterator[None]:
        """Times the block as stage `key` ("sft_s"), also when it raises."""
        wall, cpu = time.monotonic(), self._tree.read()
        try:
            yield
        finally:
            self.wall[key] = time.monotonic() - wall
            self.cpu[key] = self._tree.read() - cpu

    def finish(self, result: RecipeResult) -> None:
        """The stages' times and the total (`total_s`) into `result`, rounded to 0.1 s."""
        self.wall["total_s"] = time.monotonic() - self._start[0]
        self.cpu["total_s"] = self._tree.read() - self._start[1]
        result.times = {k: round(v, 1) for k, v in self.wall.items()}
        result.cpu_times = {k: round(v, 1) for k, v in self.cpu.items()}


def _built(dest: Path, make: Callable[[Path], T]) -> T:
    """`make` a directory beside `dest`, then rename it to `dest` (replacing a partial one):
    a later run never trusts half a model or half a task set."""
    return write_dir_atomic(dest, make)


def build_stage(cfg: LearnConfig, out: Path, seed: int, log: Log) -> tuple[str, str, str]:
    """The nano model and the task splits (skipped when already built)."""
    from tmax.training.nano.model import build_nano_model
    from tmax.training.nano.tasks import write_splits

    model_dir = Path(cfg.model.path) if cfg.model.path else out / "base"
    if not (model_dir / "config.json").is_file():
        if not cfg.model.build_nano:
            raise FileNotFoundError(f"no model at {model_dir} and model.build_nano is off")
        info = _built(model_dir, lambda d: build_nano_model(d, seed=seed, family=cfg.tasks.family))
        log(f"built nano model: {info['params']:,} params, vocab {info['vocab_size']}")
    tasks = out / "tasks"
    train_dir = Path(cfg.tasks.train) if cfg.tasks.train else tasks / "train"
    held_dir = Path(cfg.tasks.heldout) if cfg.tasks.heldout else tasks / "heldout"
    if not train_dir.is_dir() or not held_dir.is_dir():
        if not cfg.tasks.generate_nano:
            raise FileNotFoundError(f"no tasks at {train_dir} / {held_dir} and tasks.generate_nano is off")
        _built(tasks, lambda d: write_splits(d, cfg.tasks.n_train, cfg.tasks.n_heldout, seed=seed,
                                             family=cfg.tasks.family, **cfg.tasks.generator))
        log(f"wrote {cfg.tasks.n_train} train and {cfg.tasks.n_heldout} held-out tasks to {tasks}")
    return str(model_dir), str(train_dir), str(held_dir)


def sft_stage(cfg: LearnConfig, model_dir: str, prepared: PreparedTasks, out: Path, log: Log) -> SftStage:
    """Teacher demonstrations on the train tasks whose environment is ready (`prepared`,
    a `training.rollout.PreparedTasks`), then SFT on them."""
    from transformers import AutoTokenizer

    from tmax.training.demos import collect_demos, select_sft_tasks
    from tmax.training.learner.sft import train_sft

    sft_dir = LearnRunDir(out).sft
    if (sft_dir / SFT_RECORD).is_file():
        log(f"SFT checkpoint exists: {sft_dir}")
        from tmax.training.learner.sft import final_loss

        done = read_record(sft_dir / SFT_RECORD, SftRecord)
        return SftStage(checkpoint=str(sft_dir), demos=done.demos, steps=done.steps, skipped=True,
                        final_loss=final_loss(done.losses))
    copy = copy_stage(cfg, model_dir, out, log)
    model_dir = copy.checkpoint if copy else model_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    chosen = select_sft_tasks(prepared.runnable, cfg.sft.task_fraction, cfg.algo.seed)
    t0 = time.monotonic()
    demos = collect_demos(chosen, tok, cfg, images=prepared.images)
    t_demo = time.monotonic() - t0
    solved = sum(1 for r in demos if r.reward >= 1.0)
    who = "oracle" if cfg.sft.teacher_accuracy >= 1.0 else f"teacher (accuracy {cfg.sft.teacher_accuracy:g})"
    log(f"{len(demos)} {who} demonstrations through the harness in {t_demo:.1f}s, {solved} of them solve their task")
    t1 = time.monotonic()

    def step_log(step: int, total: int, loss: float) -> None:
        if step % 20 == 0 or step == total:
            log(f"SFT step {step}/{total}: loss {loss:.3f} ({time.monotonic() - t1:.0f}s)")

    # The nano model built here (no model.path) has random weights: its warm start trains every
    # weight, as pretraining would have; an adapter, with [lora] on, trains from its checkpoint on.
    adapter = bool(cfg.model.path)
    if cfg.lora.enabled and not adapter:
        log("SFT warm start of the freshly built nano model: every weight (LoRA trains from its checkpoint on)")
    res = train_sft(model_dir, demos, cfg, sft_dir, log=step_log, lora=adapter)  # replaces sft_dir whole
    write_text_atomic(sft_dir / "demos.jsonl", "".join(r.to_json() + "\n" for r in demos))
    log(f"SFT: {res.steps} steps, final loss {res.final_loss:.3f}, {res.seconds:.1f}s")
    return SftStage.trained(res, demos_solved=solved, demo_s=t_demo, copy=copy)


def copy_stage(cfg: LearnConfig, model_dir: str, out: Path, log: Log) -> CopyStage | None:
    """Copy pre-training of the freshly built nano model into `out/copy` (`sft.copy_steps`;
    none for a given model.path, which was pretrained)."""
    if not cfg.sft.copy_steps or cfg.model.path:
        return None
    from tmax.training.learner.copy_warmup import train_copy
    from tmax.training.nano.tasks import value_pool

    t0 = time.monotonic()

    def step_log(step: int, total: int, loss: float) -> None:
        if step % 100 == 0 or step == total:
            log(f"copy pre-training step {step}/{total}: loss {loss:.3f} ({time.monotonic() - t0:.0f}s)")

    res = _built(out / "copy", lambda d: train_copy(model_dir, value_pool("train", cfg.tasks.family), cfg, d,
                                                     log=step_log))
    log(f"copy pre-training: {res.steps} steps, loss on the repeated values {res.repeat_nll:.3f}, {res.seconds:.1f}s")
    return CopyStage(checkpoint=str(out / "copy"), steps=res.steps, final_loss=res.final_loss,
                     repeat_nll=res.repeat_nll, seconds=res.seconds)


def heldout_eval(cfg: LearnConfig, engine: EngineGroup, held_dir: str, jobs_dir: Path, name: str, log: Log) -> HeldoutEval:
    """A `tmax bench` job (the `eval.harness` agent, else the harness trained under; trials
    in `eval.sandbox`) against the server of `engine` (a `training.cluster.actors.EngineGroup`)."""
    from tmax.tasks.job import Job, JobSpec

    info = engine.info()
    harness = cfg.eval.harness or cfg.rollout.harness_for(0)
    # The training episodes' agent settings, with the eval section's sampling and step limit.
    kwargs = cfg.rollout.agent_only().model_dump(mode="json", exclude_none=True) | {
        "temperature": cfg.eval.temperature, "top_p": 1.0, "max_steps": cfg.eval.max_steps}
    jc = JobSpec(job_name=name, jobs_dir=str(jobs_dir), dataset=held_dir, agent=harness, model=info["model"],
                   base_url=info["base_url"], agent_kwargs=kwargs, n_attempts=cfg.eval.attempts,
                   n_concurrent=cfg.eval.concurrency, environment=cfg.eval.sandbox, warm_ahead=cfg.eval.warm_ahead,
                   overlay=cfg.eval.overlay)
    t0 = time.monotonic()
    job = Job(jc, api_key="none")
    job.run()
    results = job.results()
    verdicts = [t.score() for t in results]
    n = len(verdicts)
    passed = sum(v.passed for v in verdicts)
    infra = sum(v.infra for v in verdicts)
    agentic = heldout_agentic(results)
    out = HeldoutEval(pass_rate=passed / n if n else 0.0, passed=passed, trials=n, infra_errors=infra,
                      seconds=time.monotonic() - t0, job_dir=str(job.dir), agentic=agentic)
    turns = agentic.turns_solved
    depths = ", ".join(f"{d}: {r.passed}/{r.trials}" for d, r in agentic.by_depth.items())
    log(f"held-out eval [{name}, {harness} harness]: {passed}/{n} passed ({out.pass_rate:.1%}), {infra} infra errors, "
        f"{out.seconds:.0f}s" + (f"; {turns:.1f} turns per solved trial" if turns is not None else "")
        + (f"; passed by commands needed {depths}" if depths else ""))
    return out


def prepare_recipe_tasks(cfg: LearnConfig, train_dir: str, held_dir: str, out: Path, log: Log) -> PreparedTasks:
    """Every train and held-out task's environment, resolved (images built) before SFT and
    RL; returns the train tasks' (`training.rollout.PreparedTasks`). `held_dir` may be
    empty (no held-out set)."""
    from tmax.training.rollout import PreparedTasks, env_settings, list_task_dirs, prepare_tasks

    out.mkdir(parents=True, exist_ok=True)
    held = PreparedTasks({}, {})
    if held_dir:
        held_env = env_settings(cfg.eval.sandbox, cfg.rollout.image_map, overlay=cfg.eval.overlay)
        held = prepare_tasks(held_env, list_task_dirs(held_dir), out / "heldout_tasks.json", log=log)
    train_env = env_settings(cfg.rollout.sandbox, cfg.rollout.image_map, overlay=cfg.rollout.overlay)
    train_tasks = prepare_tasks(train_env, list_task_dirs(train_dir), out / "train_tasks.json", log=log)
    log(f"task environments ready: {len(train_tasks.runnable)} train ({cfg.rollout.sandbox}), "
        f"{len(held.runnable)} held-out ({cfg.eval.sandbox}); "
        f"{len(train_tasks.dropped) + len(held.dropped)} dropped")
    return train_tasks
