"""LoRA on a real tiny Qwen3 model through PEFT, no server: `[lora]` settings, the learner
(only the adapter trains; DPPO, the fp32 head, the prefix trie and SFT as without it), LoRA
checkpoints (PEFT's adapter format naming the base; resume, rollback, merge), the start
adapter of a run, and the vLLM command line that serves an adapter."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from tiny_learner import make_model_dir, max_diff, rl_groups, sampled_batch, sft_batch  # noqa: E402

from tmax.common.errors import ConfigError  # noqa: E402
from tmax.training.config import LearnConfig, preset  # noqa: E402
from tmax.training.learner.learner import Learner, LearnerConfig  # noqa: E402
from tmax.training.learner.lora import LoraSpec, init_adapter, merge, run_start  # noqa: E402
from tmax.training.learner.sft import sft_loss  # noqa: E402
from tmax.training.inference.serving import vllm_max_rank  # noqa: E402
from tmax.training.weights.adapter import AdapterError, adapter_base, is_adapter_dir  # noqa: E402
from tmax.common.records import CheckpointExtra  # noqa: E402

SPEC = LoraSpec(rank=4)
# Adapter elements of the tiny model (hidden 64, 4 query and 2 KV heads of 32, MLP 128, 2
# layers) at rank 4: in + out of q, o (64, 128), k, v (64, 64), gate, up, down (64, 128).
ADAPTER_NUMEL = 4 * 2 * (2 * 128 + 5 * 192)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def _moved_adapter(learner: Learner, seed: int = 0) -> None:
    """Every adapter weight random (B starts at zero, which would zero A's gradient)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.params:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))


# ---- settings ----------------------------------------------------------------------------


def test_lora_settings_presets_and_the_flag():
    from typer.testing import CliRunner

    from tmax.cli.main import app
    from tmax.training.config import resolve

    assert LearnConfig().lora.rank == 0 and not LearnConfig().lora.enabled
    cfg = preset("nano-lora")
    assert cfg.lora.rank == 8 and cfg.lora.dropout == 0.0 and "down_proj" in cfg.lora.target_modules
    assert cfg.rollout == preset("nano").rollout and cfg.sft == preset("nano").sft
    big = preset("tmax-9b-lora")
    assert big.lora.enabled and big.cluster.nodes is None and big.engine.gpu_memory_utilization < 0.5
    assert big.run.gradient_checkpointing
    shown = CliRunner().invoke(app, ["learn", "nano", "--lora-rank", "16", "--print-config"])
    assert shown.exit_code == 0 and "rank = 16  # --lora-rank" in shown.stdout.split("[lora]")[1]
    with pytest.raises(ConfigError, match="syncs the adapter through the object store"):
        resolve("nano-lora", {"engine": {"weight_transport": "gloo"}})
    with pytest.raises(ConfigError, match="lora.rank"):
        resolve("nano", {"lora": {"rank": -1}})


def test_transport_and_vllm_rank():
    from tmax.training.weights.transports import resolve_transport

    assert resolve_transport("auto", learner_on_cuda=True, adapter=True) == "object_store"
    with pytest.raises(ConfigError, match="a LoRA adapter syncs through the object store"):
        resolve_transport("nccl", learner_on_cuda=True, adapter=True)
    assert [vllm_max_rank(r) for r in (1, 2, 8, 9, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_max_rank(1024)


# ---- the learner -------------------------------------------------------------------------


def test_only_the_adapter_trains_and_holds_optimizer_state(model_dir):
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, lora=SPEC))
    assert learner.packing and learner.peft is not None
    assert sum(p.numel() for p in learner.params) == ADAPTER_NUMEL
    frozen = {k: v.clone() for k, v in learner.model.state_dict().items() if "lora_" not in k}
    samples = sampled_batch(model_dir)
    before = learner.logprobs(samples)
    metrics = learner.train_step(samples)
    assert metrics["debug/dppo_mask_frac_kept"] == 1.0 and metrics["optim/grad_norm"] > 0
    assert max_diff(before, learner.logprobs(samples)) > 1e-3  # the policy moved
    assert len(learner.optimizer.state) == len(learner.params)
    assert all(torch.equal(v, learner.model.state_dict()[k]) for k, v in frozen.items())  # base untouched
    # What the engines get: the adapter's tensors under adapter_model.safetensors' names.
    weights = learner.named_weights()
    assert all(k.startswith("base_model.model.") and (".lora_A." in k or ".lora_B." in k) for k in weights)
    assert learner.sync_nbytes() == sum(v.numel() * v.element_size() for v in weights.values()) == 4 * ADAPTER_NUMEL


@pytest.mark.parametrize("batch", ["rl", "sft"])
def test_prefix_trie_with_an_adapter_equals_one_row_per_sample(model_dir, batch):
    """DPPO on RL groups and cross-entropy on SFT batches: the adapter's gradients of the
    packed trie are those of one forward per sample (fp32, fp32 head)."""
    samples, loss_fn = (rl_groups(), None) if batch == "rl" else (sft_batch(), sft_loss)
    packed, rows = (Learner(model_dir, LearnerConfig(pack_length=4096, lora=SPEC)) for _ in range(2))
    rows.packing = False
    for learner in (packed, rows):
        _moved_adapter(learner)
    a, b = packed.backward(samples, loss_fn), rows.backward(samples, loss_fn)
    assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5)
    for p, q in zip(packed.params, rows.params):
        assert float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)) <= 1e-5


def test_checkpoint_is_a_peft_adapter_that_resumes_rolls_back_and_merges(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    learner = Learner(model_dir, LearnerConfig(lr=1e-2, lora=SPEC))
    samples = sampled_batch(model_dir)
    learner.train_step(samples)
    ckpt = learner.save(tmp_path / "step_1", step=1, extra=CheckpointExtra(prompt_position=3))
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "trainer_state.json"} <= files
    assert "model.safetensors" not in files and is_adapter_dir(ckpt)
    assert adapter_base(ckpt) == model_dir.resolve() and json.loads((ckpt / "adapter_config.json").read_text())["r"] == 4
    want = learner.logprobs(samples)
    resumed = Learner.load(ckpt, LearnerConfig(lr=1e-2, lora=SPEC))
    assert resumed.step == 1 and resumed.extra == CheckpointExtra(prompt_position=3)
    assert max_diff(want, resumed.logprobs(samples)) == 0.0
    resumed.train_step(samples)  # away, then back: the collapse guard's rollback
    assert max_diff(want, resumed.logprobs(samples)) > 1e-4
    resumed.restore(ckpt)
    assert max_diff(want, resumed.logprobs(samples)) == 0.0 and resumed.step == 1
    # An adapter of another rank does not continue this one.
    with pytest.raises(AdapterError, match="rank-4 adapter"):
        Learner(ckpt, LearnerConfig(lora=LoraSpec(rank=8)))
    merged = merge(ckpt, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    s = samples[0].trace
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.ids])).logits[0].float(), -1)
    n = len(s.prompt_ids)
    assert max(abs(lp[n - 1 + i, t].item() - w) for i, (t, w) in enumerate(zip(s.ids, want[0]))) < 1e-5


def test_sft_through_the_learner_trains_and_exports_an_adapter(model_dir, tmp_path):
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, lora=SPEC))
    samples = sft_batch()
    losses = [learner.train_step(samples, loss_fn=sft_loss)["loss/policy_avg"] for _ in range(8)]
    assert losses[-1] < 0.9 * losses[0], losses
    out = learner.export(tmp_path / "sft", extra=CheckpointExtra(sft_steps=8))
    assert is_adapter_dir(out) and "optimizer" not in torch.load(out / "trainer_state.pt", weights_only=True)


def test_a_run_starts_from_a_new_adapter_equal_to_its_base(model_dir, tmp_path):
    cfg = preset("nano-lora")
    assert run_start(preset("nano").lora, str(model_dir), tmp_path, 0) == str(model_dir)  # LoRA off
    start = run_start(cfg.lora, str(model_dir), tmp_path, 0)
    assert is_adapter_dir(start) and json.loads((tmp_path / "adapter-init" / "adapter_config.json").read_text())["r"] == 8
    assert run_start(cfg.lora, start, tmp_path / "again", 0) == start  # an adapter continues as it is
    with pytest.raises(AdapterError, match="rank-8 adapter"):
        run_start(cfg.lora.model_copy(update={"rank": 4}), start, tmp_path, 0)
    samples = sampled_batch(model_dir)
    base = Learner(model_dir, LearnerConfig()).logprobs(samples)
    assert max_diff(base, Learner(start, LearnerConfig()).logprobs(samples)) == 0.0  # B = 0
    again = init_adapter(model_dir, LoraSpec(rank=8), tmp_path / "again", seed=0)
    from safetensors.torch import load_file

    a, b = load_file(f"{start}/adapter_model.safetensors"), load_file(f"{again}/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # seeded
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_A" in k)


# ---- serving an adapter --------------------------------------------------------------------


def test_serve_command_of_an_adapter(model_dir, tmp_path, monkeypatch):
    from tmax.training.inference.serving import ServeSpec, build_command

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ckpt = Learner(model_dir, LearnerConfig(lora=SPEC)).export(tmp_path / "my-adapter")

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    for spec in (ServeSpec(model=str(ckpt)), ServeSpec(model=str(model_dir), lora=str(ckpt))):
        cmd = build_command(spec)
        assert flag(cmd.argv, "--model") == str(model_dir.resolve())
        assert flag(cmd.argv, "--lora-modules") == f"my-adapter={ckpt.resolve()}"
        assert flag(cmd.argv, "--max-lora-rank") == "8" and "--enable-lora" in cmd.argv
        assert cmd.served_model_name == "my-adapter" and flag(cmd.argv, "--served-model-name") == model_dir.name
    named = build_command(ServeSpec(model=str(ckpt), served_model_name=model_dir.name))
    assert flag(named.argv, "--served-model-name") == f"{model_dir.name}-base"  # never the adapter's name
    with pytest.raises(ValueError, match="not a LoRA adapter directory"):
        build_command(ServeSpec(model=str(model_dir), lora=str(model_dir)))


def test_cli_serve_dry_run_and_merge(model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tmax.cli.main import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ckpt = Learner(model_dir, LearnerConfig(lora=SPEC)).export(tmp_path / "ad")
    r = CliRunner().invoke(app, ["serve", str(ckpt), "--dry-run"])
    assert r.exit_code == 0 and "--lora-modules ad=" in r.stdout, r.output
    r = CliRunner().invoke(app, ["serve", str(model_dir), "--lora", str(model_dir), "--dry-run"])
    assert r.exit_code == 2 and "not a LoRA adapter directory" in r.output
    r = CliRunner().invoke(app, ["learn", "merge", str(model_dir), "-o", str(tmp_path / "m")])
    assert r.exit_code == 2 and "is not a LoRA checkpoint" in r.output
    r = CliRunner().invoke(app, ["learn", "merge", str(ckpt), "-o", str(tmp_path / "m")])
    assert r.exit_code == 0 and (tmp_path / "m" / "model.safetensors").is_file(), r.output
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": str(tmp_path / "gone")}))
    r = CliRunner().invoke(app, ["learn", "merge", str(ckpt), "-o", str(tmp_path / "m2")])
    assert r.exit_code == 2 and "is not a model directory here" in r.output


def test_dropout_is_off_by_default_and_seeded_runs_repeat(model_dir):
    """Dropout would make the trainer's logprobs of a sample differ from the sampler's:
    off by default, so two forwards of the same adapter agree exactly."""
    assert LoraSpec(rank=2).dropout == 0.0
    learner = Learner(model_dir, LearnerConfig(lora=SPEC))
    samples = sampled_batch(model_dir)
    assert max_diff(learner.logprobs(samples), learner.logprobs(samples)) == 0.0
