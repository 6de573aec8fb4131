"""The one way into training: every `tmax learn` command, the recipe benchmark and the
tests call these functions with a resolved `LearnConfig` (`training.config.resolve`).

    learn(cfg, out)          `tmax learn [--nodes N] [--from-runs DIR]`: DPPO RL; with the nano
                             build flags the recipe's build and SFT first (what is missing)
    sft(cfg, out)            `tmax learn sft`: build, then the SFT warm start only
    sft_from_runs(...)       `tmax learn sft --from-runs DIR`
    recipe(cfg, out)         `tmax learn nano`, benchmarks/nano_recipe.py: build -> SFT ->
                             held-out eval -> RL -> held-out eval
    dry_run(cfg, out)        `tmax learn --nodes N --dry-run`: the plan, the run's whole
                             config and an sbatch script that runs it
    merge(ckpt, out)         `tmax learn merge`: a LoRA checkpoint into full HF weights

Ray is started (or joined) in one place, `training.cluster.run_cluster.ray_session`, per the
config's `[cluster]` section; a run with `cluster.nodes` gets its placement groups there.
Bad input (a config, a placement or a `--from-runs` directory that cannot work) raises
`ConfigError` before any work starts. `dry_run` imports neither torch nor Ray (a light
install plans a cluster job); the others first check that the train extra is installed
(`MissingExtra` otherwise) and only then import the loop and the recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tmax.common.errors import ConfigError
from tmax.common.extras import require_extra
from tmax.common.files import write_text_atomic
from tmax.common.records import LearnRunDir, write_record
from tmax.training.cluster.placement import PlanError, PlacementPlan, plan_for
from tmax.training.cluster.run_cluster import own_run_processes, ray_session
from tmax.training.config import LearnConfig, dump_toml
from tmax.training.report import LearnProgress, StepLines

if TYPE_CHECKING:
    from tmax.training.generator import Generator
    from tmax.training.trainer import RunResult
    from tmax.training.recipe import RecipeResult, SftStage
    from tmax.training.rollout import PreparedTasks
    from tmax.training.runs_data import RatedStream

Log = Callable[[str], None]
SBATCH_NAME = "tmax-learn.sbatch"
JOB_CONFIG_NAME = "learn.toml"


def placement_plan(cfg: LearnConfig) -> PlacementPlan | None:
    """The run's placement plan (None on one machine); a plan no cluster can hold is a `ConfigError`."""
    try:
        return plan_for(cfg)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def learn(cfg: LearnConfig, out: Path, *, resume: bool = False, progress: LearnProgress | None = None,
          from_runs: Path | None = None,
          runs_per_step: int = 1, on_step: Callable[[int, dict[str, float]], None] | None = None,
          log: Log = print) -> RunResult:
    """DPPO from `model.path` on `tasks.train` into `out`; with the nano build flags, from
    the recipe's SFT checkpoint (built first where missing) into `out/rl`. The cluster is
    joined, and checked against the plan, before any of that work."""
    require_extra("train")
    from tmax.training.learner.checkpoint import refuse_fresh_run_over
    from tmax.training.trainer import train

    out = Path(out)
    refuse_fresh_run_over(_rl_dir(cfg, out), resume)  # before Ray starts, once
    plan = placement_plan(cfg)
    rated = _rated_stream(from_runs, runs_per_step, plan) if from_runs is not None else None
    nano = cfg.model.build_nano or cfg.tasks.generate_nano
    if not nano and not (cfg.model.path and cfg.tasks.train):
        raise ConfigError("the config needs model.path and tasks.train (or the nano build flags)")
    if nano and cfg.tasks.format != "harbor":
        raise ConfigError(f"the nano build makes Harbor tasks: tasks.format = {cfg.tasks.format!r} needs model.path "
                          "and tasks.train, without the nano build flags")
    left = own_run_processes(out)
    if left:
        log(f"ended {len(left)} processes a killed earlier driver of {out} left running")
    text = _text_prompts(cfg)  # bad input before Ray starts
    with ray_session(cfg, plan, log) as placement:
        start, rl_dir, generator = (cfg.model.path, out, text) if text is not None else _rl_inputs(cfg, out, log)
        res = train(cfg, start, generator, rl_dir, resume=resume, progress=progress, placement=placement,
                    on_step=on_step, rated=rated)
    if (rl_dir / "placement.json").is_file():
        log(f"actors placed: {(rl_dir / 'placement.json').read_text()}")
    return res


def _text_prompts(cfg: LearnConfig) -> Generator | None:
    """With `tasks.format = "text"`, the generator of the prompts in `tasks.train` (read now)."""
    from tmax.training.text_generator import TextGenerator

    return TextGenerator.load(cfg) if cfg.tasks.format == "text" else None


def _rl_inputs(cfg: LearnConfig, out: Path, log: Log) -> tuple[str, Path, Generator]:
    """(start model, RL run dir, the Harbor tasks' generator): the nano recipe's build and SFT
    checkpoint under `out` (made where missing), else the config's model and tasks. Every
    train task's environment (image) is ready before the first step; the held-out set is the
    recipe's (`tmax learn nano`), not RL's."""
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.recipe import build_stage, prepare_recipe_tasks, sft_stage

    rl_dir = _rl_dir(cfg, out)
    if cfg.model.build_nano or cfg.tasks.generate_nano:
        model_dir, train_dir, _ = build_stage(cfg, out, cfg.algo.seed, log)
        prepared = prepare_recipe_tasks(cfg, train_dir, "", out, log)
        start = sft_stage(cfg, model_dir, prepared, out, log).checkpoint
    else:
        start, prepared = cfg.model.path, prepare_recipe_tasks(cfg, cfg.tasks.train, "", out, log)
    return start, rl_dir, HarborGenerator(cfg, prepared, rl_dir)


def _rl_dir(cfg: LearnConfig, out: Path) -> Path:
    """Where the RL run's records go: `out/rl` beside the nano build's stages, else `out`."""
    return out / "rl" if cfg.model.build_nano or cfg.tasks.generate_nano else out


def _rated_stream(from_runs: Path, per_step: int, plan: PlacementPlan | None) -> RatedStream:
    """The rated `tmax run` sessions to add to each RL step (checked before anything starts)."""
    from tmax.training.runs_data import RatedStream, RunsDataError, load_runs

    if plan is not None:
        raise ConfigError("--from-runs runs on one node; drop --nodes (cluster.nodes)")
    try:
        return RatedStream(load_runs(from_runs), per_step=per_step)
    except (RunsDataError, ValueError) as e:
        raise ConfigError(str(e)) from None


def sft(cfg: LearnConfig, out: Path, log: Log = print) -> SftStage:
    """Build what is missing, then the SFT warm start on the train tasks (into `out/sft`)."""
    require_extra("train")
    from tmax.training.recipe import build_stage, prepare_recipe_tasks, sft_stage

    out = Path(out)
    model_dir, train_dir, _ = build_stage(cfg, out, cfg.algo.seed, log)
    prepared = prepare_recipe_tasks(cfg, train_dir, "", out, log)
    return sft_stage(cfg, model_dir, prepared, out, log)


def sft_from_runs(cfg: LearnConfig, runs_dir: Path, out: Path, log: Log = print) -> SftStage:
    """SFT on the accepted `tmax run --tokens` sessions under `runs_dir` (into `out/sft-runs`),
    starting from model.path, else from the model the sessions were sampled from."""
    require_extra("train")
    from tmax.training.learner.sft import train_sft
    from tmax.training.recipe import SftStage
    from tmax.training.runs_data import RunsDataError, accepted, load_runs, model_dir_of

    try:
        runs = load_runs(runs_dir)
        demos = accepted(runs)
        if not demos:
            raise RunsDataError(f"none of the {len(runs)} sessions under {runs_dir} is accepted "
                                "(rated /good or a passing --verify)")
        start = cfg.model.path or model_dir_of(runs)
    except (RunsDataError, ValueError) as e:
        raise ConfigError(str(e)) from None

    def step_log(step: int, total: int, loss: float) -> None:
        if step % 20 == 0 or step == total:
            log(f"SFT step {step}/{total}: loss {loss:.3f}")

    return SftStage.trained(train_sft(start, demos, cfg, out / "sft-runs", log=step_log))


def recipe(cfg: LearnConfig, out: Path, *, progress: LearnProgress | None = None, log: Log = print,
           stages: tuple[str, ...] = ("sft", "rl", "eval")) -> RecipeResult:
    """The whole nano recipe into `out` (`recipe.json`). `stages` can drop "eval" (RL only)
    or "rl" (SFT + eval). One machine: the held-out evals share the RL run's engine."""
    require_extra("train")
    from tmax.training.recipe import RecipeResult, SftStage, StageClock, build_stage, prepare_recipe_tasks, sft_stage

    if cfg.cluster.nodes is not None:
        raise ConfigError("the recipe runs on one machine (its evals share the RL engine); drop --nodes (cluster.nodes)")
    out = Path(out)
    progress = progress if progress is not None else StepLines(log)
    _refuse_earlier_recipe(out)
    out.mkdir(parents=True, exist_ok=True)
    with StageClock() as clock:
        with clock.stage("build_s"):
            model_dir, train_dir, held_dir = build_stage(cfg, out, cfg.algo.seed, log)
        with clock.stage("environments_s"):
            prepared = prepare_recipe_tasks(cfg, train_dir, held_dir, out, log)
        with clock.stage("sft_s"):
            sft_res = sft_stage(cfg, model_dir, prepared, out, log) if "sft" in stages else SftStage(checkpoint=model_dir)
        result = RecipeResult(seed=cfg.algo.seed, sft=sft_res)
        with ray_session(cfg, None, log):
            _evaluated_rl(cfg, out, sft_res.checkpoint, held_dir, prepared, stages, progress, log,
                          result, clock)
        clock.finish(result)
    write_record(LearnRunDir(out).recipe, result)
    return result


def _refuse_earlier_recipe(out: Path) -> None:
    """A recipe run into a directory another one used would read that run's held-out trials
    back as its own (a bench job resumes) and append to its RL records: refused up front."""
    from tmax.training.learner.checkpoint import trained_before

    earlier = [str(p.relative_to(out)) for p in (LearnRunDir(out).recipe, *sorted((out / "eval").glob("*/config.json")))
               if p.is_file()]
    if (rl := trained_before(out / "rl")) is not None:
        earlier.append(f"rl: {rl}")
    if earlier:
        raise ConfigError(f"{out} already holds a recipe run ({', '.join(earlier)}): its held-out evals would be "
                          "read back, not run. Pass another --out, or remove it")


def _evaluated_rl(cfg: LearnConfig, out: Path, start: str, held_dir: str, prepared: PreparedTasks,
                  stages: tuple[str, ...], progress: LearnProgress, log: Log, result: RecipeResult,
                  clock: StageClock) -> None:
    """One engine serving `start`: the held-out eval of it, RL on it, the held-out eval of
    RL's final checkpoint loaded into it. Fills `result` and times each stage on `clock`."""
    from tmax.training.cluster.actors import start_engines, warm_worker_processes
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.learner.lora import run_start
    from tmax.training.trainer import train
    from tmax.training.recipe import RlStage, heldout_eval
    from tmax.training.weights.learner_side import load_checkpoint

    with clock.stage("engine_start_s"):
        start = run_start(cfg.lora, start, out / "rl", cfg.algo.seed)  # with LoRA: serve and train an adapter
        warm_worker_processes(2 + cfg.run.rollout_workers)  # for the engine, the learner and the rollout workers
        engine = start_engines(cfg, start, out / "rl")
    try:
        log(f"vLLM engine up in {clock.wall['engine_start_s']:.0f}s")
        if "eval" in stages:
            with clock.stage("sft_eval_s"):
                result.sft_eval = heldout_eval(cfg, engine, held_dir, out / "eval", f"sft-s{cfg.algo.seed}", log)
            progress.heldout("SFT", result.sft_eval.pass_rate)
        if "rl" not in stages:
            return
        with clock.stage("rl_s"):
            run = train(cfg, start, HarborGenerator(cfg, prepared, out / "rl"), out / "rl", progress=progress,
                        engine_handle=engine, keep_engine=True)
        result.rl = RlStage(steps=run.steps, checkpoint=run.final_checkpoint, summary=run.summary,
                            curve=run.curve_png)
        log(f"RL: {run.steps} steps in {clock.wall['rl_s']:.0f}s; reward curve {run.curve_png}")
        if "eval" in stages and run.final_checkpoint:
            with clock.stage("rl_eval_s"):
                load_checkpoint(engine, run.final_checkpoint, run.steps)
                result.rl_eval = heldout_eval(cfg, engine, held_dir, out / "eval", f"rl-s{cfg.algo.seed}", log)
    finally:
        # Also on failure: the engine actor owns a vLLM server that must not outlive the run.
        engine.close()
        engine.kill()


def merge(checkpoint: Path, out: Path) -> tuple[Path, Path]:
    """A LoRA checkpoint merged into its base model's weights in `out`; returns (out, the
    base). A directory that is no adapter, or whose base is not here, is a `ConfigError`
    before anything is loaded."""
    from tmax.training.weights.adapter import adapter_base, is_adapter_dir

    if not is_adapter_dir(checkpoint):
        raise ConfigError(f"merge: {checkpoint} is not a LoRA checkpoint (no adapter_config.json)")
    base = adapter_base(checkpoint)
    require_extra("train")
    from tmax.training.learner.lora import merge as merge_adapter

    return merge_adapter(checkpoint, out), base


def dry_run(cfg: LearnConfig, out: Path) -> str:
    """Write the run's whole config (`out/learn.toml`, its `run.out_dir` = `out`) and an sbatch
    script that runs `tmax learn --config` on it (`out/tmax-learn.sbatch`); returns the plan,
    where both are and the script, for the console."""
    from tmax.training.cluster.slurm import sbatch_script

    out, plan = Path(out), placement_plan(cfg)
    if plan is None:
        raise ConfigError("--dry-run prints a multi-node plan; pass --nodes N (or set cluster.nodes)")
    job_cfg = cfg.model_copy(deep=True)
    job_cfg.run.out_dir = str(out)
    config_path, script_path = out / JOB_CONFIG_NAME, out / SBATCH_NAME
    write_text_atomic(config_path, dump_toml(job_cfg))
    script = sbatch_script(plan, ["--config", str(config_path)])
    write_text_atomic(script_path, script)
    return "\n".join([
        plan.describe(cfg.engine.weight_transport), "",
        "plan (json): " + json.dumps(plan.to_dict(), sort_keys=True), "",
        f"wrote {config_path} (the whole run) and {script_path}; submit with `sbatch {script_path}`",
        f"# ---- {script_path} ----", script])
