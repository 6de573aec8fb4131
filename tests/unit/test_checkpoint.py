"""Checkpoints (HF format + trainer state, atomic, resume) and the metrics sink."""

import importlib.util
import json
import random

import pytest
import torch

from tmax.agents.policy import TokenTrace
from tmax.common.records import CHECKPOINT_META, CheckpointExtra
from tmax.training.learner import checkpoint as ckpt
from tmax.training.learner.learner import Learner, LearnerConfig
from tmax.training.learner.packing import TrainSample
from tmax.training.report import MetricsSink, read_metrics, summary

VOCAB = 300
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 model with a real byte-level BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    path = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["echo hello > file.txt", "cat file.txt | wc -l", "ls -la /workspace"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TEMPLATE)
    fast.save_pretrained(str(path))
    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=VOCAB, intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=512,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for adv in (1.0, -1.0, 0.5):
        ids = torch.randint(0, VOCAB, (10,), generator=g).tolist()
        lps = (-torch.rand(10, generator=g) * 6).tolist()
        mask = [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
        out.append(TrainSample(TokenTrace(torch.randint(0, VOCAB, (4,), generator=g).tolist(), ids, lps, mask), adv))
    return out


def test_round_trip_is_servable_hf_and_resumes_exactly(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = LearnerConfig(lr=1e-3)
    learner = Learner(model_dir, cfg)
    learner.train_step(batch(0))
    learner.train_step(batch(1))
    path = learner.save(ckpt.checkpoint_path(tmp_path / "run", learner.step), extra=CheckpointExtra(prompt_position=48, rated_position=3))
    # RNG state is saved: after loading, the next draws match the ones right after saving.
    expect_torch, expect_py = torch.rand(3), random.random()
    assert path.name == "step_2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", ckpt.STATE_PT, CHECKPOINT_META):
        assert (path / name).is_file(), name
    assert json.loads((path / CHECKPOINT_META).read_text())["extra"]["prompt_position"] == 48

    # The model directory alone is a plain HF checkpoint with its tokenizer and template.
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, learner.model(input_ids=ids).logits, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template([{"role": "user", "content": "ls"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nls<|im_end|>\n<|im_start|>assistant\n"

    # One more step from the live learner, and one from the resumed copy, must agree.
    learner.train_step(batch(2))
    resumed = Learner.load(path, cfg)
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py
    assert resumed.step == 2 and resumed.extra == CheckpointExtra(prompt_position=48, rated_position=3)
    resumed.train_step(batch(2))
    for (k, a), b in zip(learner.named_weights().items(), resumed.named_weights().values()):
        assert torch.allclose(a, b, atol=1e-7), k
    # Without the optimizer state (a fresh learner from the same weights) it would differ.
    fresh = Learner(path, cfg)
    fresh.train_step(batch(2))
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(learner.named_weights().values(), fresh.named_weights().values()))


def test_atomic_overwrite_failure_and_listing(model_dir, tmp_path):
    learner = Learner(model_dir, LearnerConfig(lr=1e-3))
    run = tmp_path / "run"
    for step in (1, 2, 10):
        learner.save(ckpt.checkpoint_path(run, step), step=step, extra=CheckpointExtra(prompt_position=step))
    # Overwriting a checkpoint replaces it whole and leaves no temp / old directories.
    learner.save(ckpt.checkpoint_path(run, 10), step=10, extra=CheckpointExtra(prompt_position=99))
    assert ckpt.checkpoint_meta(ckpt.checkpoint_path(run, 10)).extra.prompt_position == 99
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_10", "step_2"]
    assert ckpt.latest_checkpoint(run).name == "step_10"  # numeric, not lexical, order

    # A failing save leaves nothing behind under the final name.
    with pytest.raises(ValueError, match="serialize"):  # an extra that cannot be written
        learner.save(ckpt.checkpoint_path(run, 11), step=11, extra=CheckpointExtra.model_construct(config=object()))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_10", "step_2"]

    assert [p.name for p in ckpt.prune_checkpoints(run, keep=2)] == ["step_1"]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_2", "step_10"]
    assert ckpt.latest_checkpoint(tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        ckpt.load_trainer_state(model_dir)


# ------------------------------------------------------------------ metrics sink


def test_metrics_jsonl_every_step_and_console_summary(tmp_path):
    with MetricsSink(tmp_path / "run") as sink:
        sink.log(1, {"loss/policy_avg": -0.25, "debug/dppo_mask_frac_kept": 1.0, "val/ratio": torch.tensor(1.5)})
        sink.log(2, {"loss/policy_avg": float("nan"), "val/avg_group_performance_post_filter": 0.375})
    path = tmp_path / "run" / "metrics.jsonl"
    # A crash mid-write leaves a truncated last line: readers skip it.
    with path.open("a") as f:
        f.write('{"step": 3, "loss')
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["val/ratio"] == 1.5 and records[1]["loss/policy_avg"] == "nan"
    s = summary({"val/avg_group_performance_post_filter": 0.375, "loss/policy_avg": -0.25, "unrelated": 1.0})
    assert s == {"reward": "0.375", "loss": "-0.25"}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_asking_for_wandb_without_it_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="wandb is not installed"):
        MetricsSink(tmp_path, wandb=True)


# ------------------------------------------------------------------ a full disk, a killed run


@pytest.fixture
def small_fs(tmp_path):
    """A 32 MiB tmpfs: a filesystem that fills (needs root and mount)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(path, leave: int) -> None:
    import shutil

    with open(path, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(path.parent).free - leave))


def test_full_disk_stops_the_save_naming_path_and_space_and_keeps_the_last_checkpoint(model_dir, small_fs,
                                                                                       monkeypatch):
    import pickle

    learner = Learner(model_dir, LearnerConfig(lr=1e-3))
    learner.train_step(batch(0))
    run = small_fs / "run"
    learner.save(ckpt.checkpoint_path(run, 1), step=1)
    _fill(small_fs / "ballast", leave=64 * 1024)
    learner.train_step(batch(1))
    with pytest.raises(ckpt.DiskFullError) as e:
        learner.save(ckpt.checkpoint_path(run, 2), step=2)
    assert str(run / "checkpoints") in str(e.value) and "needs about" in str(e.value) and "MiB are free" in str(e.value)
    assert e.value.needed > e.value.free and ckpt.is_disk_full(e.value)
    assert pickle.loads(pickle.dumps(e.value)).needed == e.value.needed  # crosses Ray whole
    # Nothing half-written; the last complete checkpoint still loads.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    assert Learner.load(ckpt.latest_checkpoint(run), LearnerConfig(lr=1e-3)).step == 1
    # A write that outruns the estimate (the disk filled meanwhile) reports the same way.
    with monkeypatch.context() as m:
        m.setattr(ckpt, "require_space", lambda path, needed: None)
        with pytest.raises(ckpt.DiskFullError):
            learner.save(ckpt.checkpoint_path(run, 2), step=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    # Space freed: the save goes through.
    (small_fs / "ballast").unlink()
    learner.save(ckpt.checkpoint_path(run, 2), step=2)
    assert ckpt.load_trainer_state(ckpt.latest_checkpoint(run))["step"] == 2


def test_a_killed_saves_temp_directories_are_never_loaded_and_are_removed(model_dir, tmp_path):
    learner = Learner(model_dir, LearnerConfig(lr=1e-3))
    run = tmp_path / "run"
    learner.save(ckpt.checkpoint_path(run, 1), step=1)
    # What a SIGKILL mid-save leaves: a temp dir with the weights but no trainer state yet,
    # and the old copy of a checkpoint being replaced.
    half = run / "checkpoints" / ".step_2.tmp-deadbeef"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    (run / "checkpoints" / ".step_1.old-cafef00d").mkdir()
    (run / "checkpoints" / "step_3").mkdir()  # a directory without trainer state is no checkpoint
    assert ckpt.latest_checkpoint(run).name == "step_1"
    assert sorted(p.name for p in ckpt.remove_partial(run)) == [".step_1.old-cafef00d", ".step_2.tmp-deadbeef"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_3"]


def test_resume_drops_a_killed_runs_cut_lines_and_steps_past_its_checkpoint(tmp_path):
    from tmax.training.learner.checkpoint import resume_point

    run = tmp_path / "run"
    path = ckpt.checkpoint_path(run, 2)
    path.mkdir(parents=True)
    torch.save({"format": 1, "step": 2, "optimizer": {}}, path / ckpt.STATE_PT)
    (path / CHECKPOINT_META).write_text(json.dumps({"step": 2, "extra": {"prompt_position": 5}}))
    # Killed during step 3's record, after step 3 was logged but before its checkpoint.
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3))
                                       + '{"step": 4, "lo')
    (run / "rollouts.jsonl").write_text('{"group_id": 1}\n{"group_id": 2, "ids": [1, 2')
    assert resume_point(run) == (2, CheckpointExtra(prompt_position=5), str(path))
    with MetricsSink(run) as sink:  # the resumed run appends step 3 again
        sink.log(3, {"loss": 0.2})
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == [(1, 0.1), (2, 0.1), (3, 0.2)]
    assert (run / "rollouts.jsonl").read_text() == '{"group_id": 1}\n'


def test_a_fresh_run_is_refused_where_a_run_trained_and_keeps_what_is_there(tmp_path):
    from tmax.common.errors import ConfigError

    run = tmp_path / "run"
    ckpt.refuse_fresh_run_over(run, resume=False)  # nothing there yet
    (run / "train_tasks.json").parent.mkdir()
    (run / "train_tasks.json").write_text("{}")  # a run that ended before its first step
    (run / "metrics.jsonl").write_text("")
    ckpt.refuse_fresh_run_over(run, resume=False)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl, no checkpoint; nothing to resume"):
        ckpt.refuse_fresh_run_over(run, resume=False)
    path = ckpt.checkpoint_path(run, 3)
    path.mkdir(parents=True)
    (path / CHECKPOINT_META).write_text(json.dumps({"step": 3, "extra": {}}))
    with pytest.raises(ConfigError, match=r"checkpoints up to step_3; continue it with --resume\): pass another --out"):
        ckpt.refuse_fresh_run_over(run, resume=False)
    ckpt.refuse_fresh_run_over(run, resume=True)
    assert (run / "metrics.jsonl").read_text() == json.dumps({"step": 1, "loss": 0.1}) + "\n"


def test_a_recipe_into_a_used_directory_is_refused_before_any_work(tmp_path):
    """Its held-out eval jobs would resume: the earlier run's trials read back as this run's."""
    from tmax.common.errors import ConfigError
    from tmax.training.config import preset
    from tmax.training.entry import recipe

    out = tmp_path / "nano"
    (out / "eval" / "sft-s0").mkdir(parents=True)
    (out / "eval" / "sft-s0" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"already holds a recipe run \(eval/sft-s0/config.json\): its held-out"):
        recipe(preset("nano"), out)
    assert sorted(p.name for p in out.iterdir()) == ["eval"]  # nothing built, nothing removed
