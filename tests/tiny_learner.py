"""A real tiny Qwen3 model on disk and token traces sampled from it, for the learner's tests
(tests/unit and tests/integration).

The "sampler" is a second copy of the weights loaded from disk, decoding token by token with
a KV cache and recording the post-temperature logprob of each sampled token, with
observation tokens fed in between turns (mask 0), as an inference engine does."""

import torch

from tmax.agents.policy import TokenTrace
from tmax.training.learner.packing import TrainSample

VOCAB = 300


def make_model_dir(path, seed=0, tied=True):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=VOCAB, intermediate_size=128, tie_word_embeddings=tied, max_position_embeddings=512,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


@torch.no_grad()
def sample_episode(model, prompt, advantage, temperature, gen, turns=3, turn_len=5, obs_len=4):
    """Multi-turn decoding: sampled turns (mask 1, sampler logprob) and observations (mask 0)."""
    ids, lps, mask = [], [], []
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    for turn in range(turns):
        for _ in range(turn_len):
            logp = torch.log_softmax(logits.float() / temperature, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(tok), lps.append(float(logp[tok])), mask.append(1)
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        if turn < turns - 1:
            obs = torch.randint(0, VOCAB, (obs_len,), generator=gen).tolist()
            ids += obs
            lps += [0.0] * obs_len
            mask += [0] * obs_len
            out = model(input_ids=torch.tensor([obs]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return TrainSample(TokenTrace(list(prompt), ids, lps, mask), advantage)


def sampled_batch(model_dir, temperature=1.0, seed=0, advantages=(1.0, -1.0, 0.5, -0.5), **kw):
    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, adv in enumerate(advantages):
        prompt = torch.randint(0, VOCAB, (3 + 2 * n,), generator=gen).tolist()
        out.append(sample_episode(sampler, prompt, adv, temperature, gen, **kw))
    return out


def grads(learner):
    return [p.grad.detach().clone() for p in learner.params]


def small_nano(root):
    """(tokenizer, splits, root): a smaller nano model than the recipe's (same architecture)
    under root/base, and 6 train + 2 held-out nano tasks under root/tasks."""
    from transformers import AutoTokenizer

    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import write_splits

    # A smaller model than the recipe's keeps the tests fast; same architecture.
    build_nano_model(root / "base", seed=0, spec=NanoSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    splits = write_splits(root / "tasks", 6, 2, seed=0)
    return AutoTokenizer.from_pretrained(root / "base"), splits, root
