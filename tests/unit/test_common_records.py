"""tmax's own records read back typed, including the files an earlier tmax wrote."""

import json

import pytest

from tmax.common.records import (AgentMeta, AgentStatus, CheckpointMeta, EpisodeOutcome, GenerationIdentity,
                                 LearnRunDir, Rating, RecordError, RunRecord, RunSummary, SessionDir, WorkerReply, read_record,
                                 write_record)


def test_the_outcome_is_outcome_json_and_an_older_sessions_result_json_still_reads(tmp_path):
    files = SessionDir(tmp_path)
    assert files.read_outcome() is None
    # A session directory from before the rename: the agent's outcome under result.json.
    (tmp_path / "result.json").write_text(json.dumps({"status": "max_steps", "steps": 7, "error": None}))
    assert files.read_outcome() == EpisodeOutcome(status=AgentStatus.MAX_STEPS, steps=7)
    # A trial directory's result.json is Harbor's trial result, never taken for an outcome.
    (tmp_path / "result.json").write_text(json.dumps({"task_name": "t", "trial_name": "t__1", "verifier_result": None}))
    assert files.read_outcome() is None
    files.outcome.write_text('{"status": "submitted", "steps": 2')  # cut short
    with pytest.raises(RecordError, match="outcome.json is not a EpisodeOutcome record"):
        files.read_outcome()


def test_an_unknown_status_is_refused_and_statuses_compare_as_text(tmp_path):
    path = tmp_path / "outcome.json"
    path.write_text(json.dumps({"status": "finished", "steps": 1}))
    with pytest.raises(RecordError, match="status"):
        read_record(path, EpisodeOutcome)
    assert AgentStatus.SUBMITTED == "submitted" and json.dumps(AgentStatus.SUBMITTED) == '"submitted"'


def test_an_older_run_json_and_reward_json_read(tmp_path):
    # run.json as tmax run wrote it before the records were typed (instructions as dicts).
    (tmp_path / "run.json").write_text(json.dumps({
        "task": "t", "model": "m", "harness": "tmax", "base_url": "http://x/v1", "sandbox": "local", "mode": "yolo",
        "workdir": "/w", "resumed_from": None, "started_at": "2026-01-01T00:00:00+0000", "status": "submitted",
        "instructions": [{"path": "/w/AGENTS.md", "chars": 10, "kept": 10}], "error": None, "steps": 3,
        "finished_at": "2026-01-01T00:01:00+0000", "a_key_from_a_newer_tmax": 1}))
    run = SessionDir(tmp_path).read_run()
    assert run is not None and run.status == AgentStatus.SUBMITTED and run.instructions[0].kept == 10
    assert RunRecord().status == AgentStatus.RUNNING
    (tmp_path / "reward.json").write_text(json.dumps({"reward": 1, "source": "verify", "at": "x", "command": "true",
                                                      "exit_code": 0, "output": ""}))
    assert read_record(tmp_path / "reward.json", Rating).reward == 1.0
    (tmp_path / "reward.json").write_text(json.dumps({"reward": "1"}))
    with pytest.raises(RecordError, match="reward"):  # text is not a number, even when it reads as one
        read_record(tmp_path / "reward.json", Rating)


def test_an_older_checkpoints_metadata_reads_with_its_guard_state(tmp_path):
    path = LearnRunDir(tmp_path).checkpoint(4)
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 4, "time": 1.0, "extra": {
        "prompt_position": 12, "config": "nano", "guard": {"rollbacks": 1, "lr_scale": 0.5, "group_size": 8}}}))
    meta = read_record(path / "trainer_state.json", CheckpointMeta)
    assert (meta.step, meta.extra.prompt_position, meta.extra.rated_position) == (4, 12, None)
    assert (meta.extra.guard.rollbacks, meta.extra.guard.lr_scale, meta.extra.guard.group_size) == (1, 0.5, 8)
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "extra": {}}))  # no guard, no positions
    assert read_record(path / "trainer_state.json", CheckpointMeta).extra.prompt_position == 0


def test_a_run_summary_keeps_its_keys_and_an_older_one_reads(tmp_path):
    """summary.json as written (the infrastructure errors under their metric name), as an
    older tmax wrote it (before the turns and the task counts), and inside recipe.json."""
    from tmax.training.recipe import RlStage

    files = LearnRunDir(tmp_path)
    write_record(files.summary, RunSummary(steps=4, infra_errors=2, infra_errors_by_kind={"sandbox": 2}))
    written = json.loads(files.summary.read_text())
    assert (written["env/infra_errors"], written["steps"], written["guard"]["rollbacks"]) == (2, 4, 0)
    assert read_record(files.summary, RunSummary).infra_errors_by_kind == {"sandbox": 2}
    old = {"steps": 8, "updates": 8, "setup_s": 30.2, "run_s": 95.0, "reward_first_quarter": 0.25,
           "reward_last_quarter": 0.75, "episodes": 128, "guard": {"rollbacks": 1, "steps_lost": 2, "stopped": False,
                                                                   "stop_reason": None, "events": []}}
    files.summary.write_text(json.dumps(old))
    summ = read_record(files.summary, RunSummary)
    assert (summ.steps, summ.reward_last_quarter, summ.turns_last_quarter, summ.guard.rollbacks) == (8, 0.75, None, 1)
    assert (summ.tasks_runnable, summ.infra_errors) == (0, 0)
    stage = RlStage.model_validate({"steps": 8, "checkpoint": None, "summary": old, "curve": None})
    assert stage.summary.run_s == 95.0
    files.summary.write_text(json.dumps({"steps": "many"}))
    with pytest.raises(RecordError, match="summary.json is not a RunSummary record"):
        read_record(files.summary, RunSummary)


def test_foreign_dicts_are_not_taken_for_our_records():
    assert AgentMeta.of({"exit_code": 0, "duration_s": 1.5}) is None  # the oracle agent's metadata
    assert AgentMeta.of(None) is None
    meta = AgentMeta.of({"status": "submitted", "steps": 3, "error": None, "turn_outcomes": ["ok"]})
    assert meta is not None and meta.steps == 3
    assert WorkerReply.of("Traceback ...") is None
    assert WorkerReply.of({"n_tensors": 5, "total_s": 0.1}) == WorkerReply(n_tensors=5)


def test_a_generated_corpus_identity_compares_field_by_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"identity": {"seed": 0, "n": 4, "corpus_kind": "nano", "axes": "ab12"},
                                "config": {"n": 4}}))
    have = read_record(path, GenerationIdentity).identity
    assert have == have.model_copy() and have != have.model_copy(update={"seed": 1})
