"""The typed Harbor records (`tmax.tasks.harbor`) and the one scoring rule.

Job directories Harbor 0.26 wrote (tests/data/harbor-job/h, and harbor-job-timeout/t with
agent timeouts the verifier then scored) and one tmax writes on the local sandbox load and
write back unchanged; Harbor's own models validate what tmax writes; a trial whose agent
timed out scores its verifier's reward, as Harbor and the paper count it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harbor_env import harbor_check

from tmax.common.files import read_json, write_json_atomic
from tmax.tasks.harbor import (CANCELLED, INFRA_ERROR, JobConfig, JobResult, Record, TmaxTrial, TrialConfig,
                                TrialResult, TrialScore, outcome_of)
from tmax.tasks.compare import summarize_job
from tmax.tasks.job_dirs import load_job_results, trajectory_steps
from tmax.tasks.scoring import TrialRow, score

DATA = Path(__file__).parents[1] / "data"
HARBOR_JOB = DATA / "harbor-job" / "h"
TIMEOUT_JOB = DATA / "harbor-job-timeout" / "t"
FILES: tuple[tuple[type[Record], str], ...] = (
    (JobConfig, "config.json"), (JobResult, "result.json"), (TrialConfig, "*/config.json"),
    (TrialResult, "*/result.json"))


def round_trip(job_dir: Path, out: Path) -> int:
    """Load every record of a job directory and write it again: nothing lost, nothing added."""
    n = 0
    for model, pattern in FILES:
        for path in sorted(job_dir.glob(pattern)):
            data = json.loads(path.read_text())
            record = model.model_validate(data)
            write_json_atomic(out / path.relative_to(job_dir), record.dump())
            assert read_json(out / path.relative_to(job_dir)) == data, path
            n += 1
    return n


@pytest.mark.parametrize("job_dir, n_trials", [(HARBOR_JOB, 2), (TIMEOUT_JOB, 8)])
def test_jobs_harbor_wrote_load_and_write_back_unchanged(tmp_path, job_dir, n_trials):
    assert round_trip(job_dir, tmp_path) == 2 + 2 * n_trials


def test_a_timed_out_agent_scores_the_verifiers_reward():
    cfg, results = load_job_results(TIMEOUT_JOB)
    assert cfg.agent is not None and cfg.agent.name == "oracle" and len(results) == 8
    verdicts: dict[str, set[tuple[str, float, bool]]] = {}
    for r in results:
        v = r.score()
        verdicts.setdefault(r.task_name, set()).add((v.outcome, v.credit, v.passed))
    assert verdicts == {
        "answer-now": {("pass", 1.0, True)},
        "answer-then-hang": {("agent_timeout", 1.0, True)},  # the verifier passed after the timeout
        "wrong-answer": {("fail", 0.0, False)},
        "hang-without-answer": {("agent_timeout", 0.0, False)},
    }
    sc = score([TrialRow.of(r) for r in results])
    assert (sc.mean_reward, sc.pass_at_k[1], sc.pass_at_k[2]) == (0.5, 0.5, 0.5)
    assert sc.outcomes == {"pass": 2, "agent_timeout": 4, "fail": 2} and sc.n_infra_errors == 0
    job = summarize_job(TIMEOUT_JOB)
    assert (job.pass_at_1, job.agent, job.n_infra_errors) == (0.5, "oracle", 0)
    # Harbor's own figures in the job's result.json say the same.
    stats = JobResult.model_validate_json((TIMEOUT_JOB / "result.json").read_text()).stats
    assert stats.evals["oracle__ds"].metrics == [{"mean": 0.5}] and stats.evals["oracle__ds"].pass_at_k == {"2": 0.5}


@pytest.mark.parametrize("exception, reward, outcome", [
    (None, 1.0, "pass"), (None, 0.0, "fail"), (None, None, "fail"),
    ("AgentTimeoutError", 1.0, "agent_timeout"), ("AgentTimeoutError", None, "agent_timeout"),
    ("VerifierTimeoutError", None, "verifier_error"), ("RewardFileNotFoundError", None, "verifier_error"),
    ("NonZeroAgentExitCodeError", None, "fail"), ("ContextWindowExceededError", 1.0, "pass"),
    ("DaytonaError", None, "infra_error"), ("SandboxError", None, "infra_error"),
    ("CancelledError", None, "cancelled"),
])
def test_outcome_labels(exception, reward, outcome):
    assert outcome_of(exception, reward) == outcome


def test_the_rule_ignores_the_label_for_the_reward():
    """Labels describe; the reward decides: a tmax label never changes what a trial scored."""
    assert TrialScore("agent_timeout", 1.0).passed and TrialScore("agent_timeout", 1.0).credit == 1.0
    assert not TrialScore("fail", None).passed and TrialScore("fail", None).credit == 0.0
    assert TrialScore(INFRA_ERROR, None).infra and TrialScore(CANCELLED, None).infra
    assert not TrialScore("verifier_error", None).infra
    r = TrialResult(task_name="t", trial_name="t__1", verifier_result={"rewards": {"reward": 1}},
                    exception_info={"exception_type": "AgentTimeoutError"}, tmax=TmaxTrial(outcome="agent_timeout"))
    assert r.score() == TrialScore("agent_timeout", 1.0) and r.score().passed
    # A verifier that names its one reward otherwise still gives it.
    assert TrialResult(task_name="t", trial_name="t__2", verifier_result={"rewards": {"score": 0.0}}).reward == 0.0


def test_unknown_fields_survive_a_rewrite():
    data = {"task_name": "t", "trial_name": "t__1", "new_top": [1, 2],
            "config": {"task": {"path": "/x"}, "agent": {"name": "a", "new_agent_field": {"k": 1}}},
            "verifier_result": {"rewards": {"reward": 0.0}}, "tmax": {"outcome": "fail", "later": True}}
    r = TrialResult.model_validate(data)
    r.tmax.category = "games"
    out = r.dump()
    assert out["new_top"] == [1, 2] and out["config"]["agent"]["new_agent_field"] == {"k": 1}
    assert out["tmax"] == {"outcome": "fail", "later": True, "category": "games"}
    assert TrialResult.parse({"trial_name": "no task"}) is None and TrialResult.parse(None) is None


def test_steps_from_atif_and_from_chat_messages(tmp_path):
    atif = {"steps": [{"source": "user"}, {"source": "agent"}, {"source": "agent"}]}
    chat = [{"role": "system"}, {"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}, {"role": "assistant"}]
    for name, doc, steps in (("atif.json", atif, 2), ("chat.json", chat, 3), ("wrapped.json", {"messages": chat}, 3)):
        (tmp_path / name).write_text(json.dumps(doc))
        assert trajectory_steps(tmp_path / name) == steps
    assert trajectory_steps(tmp_path / "missing.json") is None


@pytest.fixture(scope="module")
def tmax_job(tmp_path_factory) -> Path:
    """A job tmax ran itself: the oracle on two generated tasks, on the local sandbox."""
    from tmax.tasks.job import Job, JobSpec as TmaxJobConfig
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("records")
    write_splits(root / "tasks", 0, 2, seed=5)
    job = Job(TmaxJobConfig(job_name="oracle", jobs_dir=str(root / "jobs"), dataset=str(root / "tasks" / "heldout"),
                            agent="oracle", environment="local"))
    result = job.run()
    assert result.tmax_score is not None and result.tmax_score["mean_reward"] == 1.0
    return job.dir


def test_a_tmax_job_round_trips_and_harbor_validates_it(tmax_job, tmp_path):
    from tmax.tasks.job import Job

    assert round_trip(tmax_job, tmp_path / "copy") == 2 + 2 * 2
    cfg, results = load_job_results(tmax_job)
    assert cfg.tmax_job is not None and cfg.tmax_identity and cfg.agent is not None and cfg.agent.name == "oracle"
    assert [r.score().outcome for r in results] == ["pass", "pass"] and all(r.tmax.environment == "local" for r in results)
    stats = JobResult.model_validate_json((tmax_job / "result.json").read_text()).stats
    assert stats.n_completed_trials == 2 and list(stats.evals.values())[0].n_trials == 2
    todo, done = Job.open(tmax_job).pending()  # resume reads the same records: nothing to rerun
    assert (todo, done) == ([], 2)
    loaded = harbor_check(tmax_job)
    assert loaded["failures"] == []
    assert (loaded["jobs"], loaded["job_configs"], loaded["trials"], loaded["trial_configs"]) == (1, 1, 2, 2)


def test_report_and_compare_agree_when_a_trial_is_an_infrastructure_error(tmax_job, tmp_path):
    """One trial of the oracle job turned into an environment failure (no reward): the
    report's pass@1 and compare's are the same number, the failure left out of both."""
    import shutil

    from tmax.common.files import write_json_atomic
    from tmax.tasks.harbor import ExceptionInfo
    from tmax.tasks.compare import summarize_job
    from tmax.tasks.scoring import TrialRow, score

    job = tmp_path / "job"
    shutil.copytree(tmax_job, job)
    _, results = load_job_results(job)
    broken = results[0].model_copy(update={"verifier_result": None, "exception_info": ExceptionInfo(
        exception_type="ImageBuildError", exception_message="the image did not build")})
    broken.tmax.outcome, broken.tmax.reward = INFRA_ERROR, None
    write_json_atomic(job / broken.trial_name / "result.json", broken.dump())
    _, results = load_job_results(job)
    report = score([TrialRow.of(r) for r in results])
    compare = summarize_job(job)
    assert report.n_infra_errors == 1 and compare.n_infra_errors == 1
    assert report.mean_reward == 0.5  # Harbor's mean: the failure counts 0
    assert report.pass_at_k[1] == compare.pass_at_1 == 1.0
