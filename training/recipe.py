"""The nano recipe: build -> SFT -> held-out eval -> DPPO RL -> held-out eval.

Everything runs through the real components: the tiny model and tasks are built here,
SFT demonstrations are oracle episodes played through the harness, RL is the Ray
training loop with a vLLM engine, and both held-out evaluations are `tmax bench` jobs
(`tasks.job.Job`, the `tmax` agent, trials in host or podman sandboxes) against that vLLM server, once with
the SFT checkpoint loaded and once with the final RL checkpoint loaded. There is no
special evaluation path.

Layout of a recipe directory:

    base/        the nano model as built (tokenizer + random weights)
    tasks/       train/ and heldout/ Harbor task dirs
    sft/         SFT checkpoint (HF) + sft.json, demos.jsonl
    rl/          the RL run (metrics.jsonl, rollouts.jsonl, checkpoints/, reward_curve.png)
    eval/        bench job dirs: sft/, rl/
    recipe.json  pass rates, stage timings
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from agents.records import write_json_atomic
from training.config import LearnConfig
from training.cluster.actors import start_engines
from training.cluster.launch import init_ray
from training.loop import list_task_dirs, train
from training.report import LearnProgress
from training.weights.learner_side import load_checkpoint

Log = Callable[[str], None]


def build_stage(cfg: LearnConfig, out: Path, seed: int, log: Log) -> tuple[str, str, str]:
    """The nano model and the task splits (skipped when already built)."""
    from training.nano.model import build_nano_model
    from training.nano.tasks import write_splits

    model_dir = Path(cfg.model.path) if cfg.model.path else out / "base"
    if not (model_dir / "config.json").is_file():
        if not cfg.model.build_nano:
            raise FileNotFoundError(f"no model at {model_dir} and model.build_nano is off")
        info = build_nano_model(model_dir, seed=seed)
        log(f"built nano model: {info['params']:,} params, vocab {info['vocab_size']}")
    tasks = out / "tasks"
    train_dir = Path(cfg.tasks.train) if cfg.tasks.train else tasks / "train"
    held_dir = Path(cfg.tasks.heldout) if cfg.tasks.heldout else tasks / "heldout"
    if not train_dir.is_dir() or not held_dir.is_dir():
        if not cfg.tasks.generate_nano:
            raise FileNotFoundError(f"no tasks at {train_dir} / {held_dir} and tasks.generate_nano is off")
        write_splits(tasks, cfg.tasks.n_train, cfg.tasks.n_heldout, seed=seed, **cfg.tasks.generator)
        log(f"wrote {cfg.tasks.n_train} train and {cfg.tasks.n_heldout} held-out tasks to {tasks}")
    return str(model_dir), str(train_dir), str(held_dir)


def sft_stage(cfg: LearnConfig, model_dir: str, prepared: Any, out: Path, log: Log) -> dict:
    """Teacher demonstrations on the train tasks whose environment is ready (`prepared`,
    a `training.rollout.PreparedTasks`), then SFT on them."""
    from transformers import AutoTokenizer

    from training.learner.sft import collect_demos, select_sft_tasks, train_sft

    sft_dir = out / "sft"
    if (sft_dir / "sft.json").is_file():
        log(f"SFT checkpoint exists: {sft_dir}")
        return json.loads((sft_dir / "sft.json").read_text()) | {"checkpoint": str(sft_dir), "skipped": True}
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

    res = train_sft(model_dir, demos, cfg, sft_dir, log=step_log)
    (sft_dir / "demos.jsonl").write_text("".join(r.to_json() + "\n" for r in demos))
    log(f"SFT: {res.steps} steps, final loss {res.final_loss:.3f}, {res.seconds:.1f}s")
    return {"checkpoint": res.checkpoint, "demos": res.demos, "demos_solved": solved, "steps": res.steps, "final_loss": res.final_loss,
            "demo_s": t_demo, "train_s": res.seconds}


def heldout_eval(cfg: LearnConfig, engine: Any, held_dir: str, jobs_dir: Path, name: str, log: Log) -> dict:
    """A `tmax bench` job (the `eval.harness` agent, else the harness trained under; trials
    in `eval.sandbox`) against the server of `engine` (a `training.cluster.actors.EngineGroup`)."""
    from tasks.job import Job, JobConfig
    from training.rollout import agent_settings

    info = engine.info()
    harness = cfg.eval.harness or cfg.rollout.harness_for(0)
    # The training episodes' settings, with the eval section's sampling and step limit.
    kwargs = agent_settings(cfg.rollout) | {"temperature": cfg.eval.temperature, "top_p": 1.0,
                                            "max_steps": cfg.eval.max_steps}
    jc = JobConfig(job_name=name, jobs_dir=str(jobs_dir), dataset=held_dir, agent=harness, model=info["model"],
                   base_url=info["base_url"], agent_kwargs=kwargs, n_attempts=cfg.eval.attempts,
                   n_concurrent=cfg.eval.concurrency, environment=cfg.eval.sandbox)
    t0 = time.monotonic()
    job = Job(jc, api_key="none")
    job.run()
    trials = job.results()
    n = len(trials)
    passed = sum(1 for t in trials if (t.get("tmax", {}).get("reward") or 0.0) >= 1.0)
    infra = sum(1 for t in trials if t.get("tmax", {}).get("outcome") == "infra_error")
    out = {"pass_rate": passed / n if n else 0.0, "passed": passed, "trials": n, "infra_errors": infra,
           "seconds": time.monotonic() - t0, "job_dir": str(job.dir)}
    log(f"held-out eval [{name}, {harness} harness]: {passed}/{n} passed ({out['pass_rate']:.1%}), {infra} infra errors, "
        f"{out['seconds']:.0f}s")
    return out


def prepare_recipe_tasks(cfg: LearnConfig, train_dir: str, held_dir: str, out: Path, log: Log) -> Any:
    """Every train and held-out task's environment, resolved (images built) before SFT and
    RL; returns the train tasks' (`training.rollout.PreparedTasks`). `held_dir` may be
    empty (no held-out set)."""
    from training.rollout import PreparedTasks, env_settings, prepare_tasks

    out.mkdir(parents=True, exist_ok=True)
    held = PreparedTasks({}, {})
    if held_dir:
        held_env = env_settings(cfg.eval.sandbox, cfg.rollout.image_map)
        held = prepare_tasks(held_env, list_task_dirs(held_dir), out / "heldout_tasks.json", log=log)
    train_env = env_settings(cfg.rollout.sandbox, cfg.rollout.image_map)
    train_tasks = prepare_tasks(train_env, list_task_dirs(train_dir), out / "train_tasks.json", log=log)
    log(f"task environments ready: {len(train_tasks.runnable)} train ({cfg.rollout.sandbox}), "
        f"{len(held.runnable)} held-out ({cfg.eval.sandbox}); "
        f"{len(train_tasks.dropped) + len(held.dropped)} dropped")
    return train_tasks


def run_recipe(cfg: LearnConfig, out_dir: str | Path, *, seed: int | None = None, progress: LearnProgress | None = None,
               log: Log = print, stages: tuple[str, ...] = ("sft", "rl", "eval")) -> dict:
    """The whole recipe. `stages` can drop "eval" (RL only) or "rl" (SFT + eval)."""
    import ray

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = cfg.algo.seed if seed is None else seed
    times: dict[str, float] = {}
    t0 = time.monotonic()
    model_dir, train_dir, held_dir = build_stage(cfg, out, seed, log)
    times["build_s"] = time.monotonic() - t0
    t = time.monotonic()
    prepared = prepare_recipe_tasks(cfg, train_dir, held_dir, out, log)
    times["environments_s"] = time.monotonic() - t

    t = time.monotonic()
    sft = sft_stage(cfg, model_dir, prepared, out, log) if "sft" in stages else {"checkpoint": model_dir}
    times["sft_s"] = time.monotonic() - t
    start_dir = sft["checkpoint"]

    result: dict[str, Any] = {"seed": seed, "sft": sft}
    started = init_ray(cfg.run.ray_address, cfg.run.ray_num_cpus)
    engine = None
    try:
        t = time.monotonic()
        engine = start_engines(cfg, start_dir, out / "rl")
        times["engine_start_s"] = time.monotonic() - t
        log(f"vLLM engine up in {times['engine_start_s']:.0f}s")
        if "eval" in stages:
            t = time.monotonic()
            result["sft_eval"] = heldout_eval(cfg, engine, held_dir, out / "eval", f"sft-s{seed}", log)
            times["sft_eval_s"] = time.monotonic() - t
        if "rl" in stages:
            t = time.monotonic()
            run = train(cfg, start_dir, train_dir, out / "rl", progress=progress, engine_handle=engine,
                        keep_engine=True, prepared=prepared)
            times["rl_s"] = time.monotonic() - t
            result["rl"] = {"steps": run.steps, "checkpoint": run.final_checkpoint, "summary": run.summary,
                            "curve": run.curve_png}
            log(f"RL: {run.steps} steps in {times['rl_s']:.0f}s; reward curve {run.curve_png}")
            if "eval" in stages and run.final_checkpoint:
                t = time.monotonic()
                load_checkpoint(engine, run.final_checkpoint, run.steps)
                result["rl_eval"] = heldout_eval(cfg, engine, held_dir, out / "eval", f"rl-s{seed}", log)
                times["rl_eval_s"] = time.monotonic() - t
    finally:
        # Also on failure: the engine actor owns a vLLM server that must not outlive the run.
        if engine is not None:
            engine.close()
            engine.kill()
        if started:
            ray.shutdown()
    times["total_s"] = time.monotonic() - t0
    result["times"] = {k: round(v, 1) for k, v in times.items()}
    if "sft_eval" in result:
        result["sft_pass_rate"] = result["sft_eval"]["pass_rate"]
    if "rl_eval" in result:
        result["rl_pass_rate"] = result["rl_eval"]["pass_rate"]
    result["minutes_total"] = round(times["total_s"] / 60, 2)
    write_json_atomic(out / "recipe.json", result)
    return result
