"""The nano model: a byte-level BPE tokenizer and a random-init Qwen3 causal LM, built here.

No hub access: the tokenizer is trained with the `tokenizers` library on text the nano
agent will actually see (the harness prompts, the bash tool schema, hermes-style tool-call
JSON, the generated tasks' instructions and commands, observations), so a whole episode
fits in ~1k tokens and a tool call costs a few dozen. The model is a `Qwen3ForCausalLM`
small enough to train on 2 CPU cores in minutes, with head_dim 32 because vLLM's CPU
attention backend rejects smaller heads.

The output directory is a normal HF model dir (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json),
loadable by `AutoTokenizer` / `AutoModelForCausalLM` and servable by vLLM.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tmax.agents import prompts
from tmax.agents.tools import TOOLS
from tmax.training.nano import tasks as nano_tasks

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# The fixed head of every bash call as the chat template renders it: one token instead of
# the 13 the pre-tokenizer would cut it into, so a whole turn fits the nano per-turn budget.
BASH_CALL_PREFIX = '{"name": "bash", "arguments": {"command": "'
# A consonant-vowel syllable of a word made only of them (a made-up value: `long_tasks`),
# after a space or another such syllable and before a space, '.', '/' or the end.
_SYL = "[bdfgklmnprstvz][aeiou]"
SYLLABLE_PIECE = rf"(?<=\s|{_SYL}){_SYL}(?=(?:{_SYL})*(?:[\s./]|$))"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2.5/Qwen3-style ChatML with hermes tool calls. Differences from Qwen's own template,
# both deliberate: every `tool` message is its own user turn (Qwen merges consecutive
# ones), so rendering is prefix-stable (rendering messages[:n+1] extends messages[:n]),
# which is what a token policy appending one observation at a time needs; and assistant
# content is rendered verbatim (no <think> stripping), so history is never rewritten.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tc in (message.tool_calls or []) %}"
    "{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (tc.name | tojson) + ', \"arguments\": ' }}"
    "{%- if tc.arguments is string %}{{- tc.arguments }}{%- else %}{{- tc.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class NanoSpec:
    """Shape of the nano model. The defaults train at well under a second per step of
    8 x 1k tokens on 2 cores, and still have enough depth to copy names from the prompt."""

    vocab_size: int = 3072  # BPE target; the trained vocab can come out smaller
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # >= 32: vLLM CPU attention supports 32, 64, 80, ... only
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.02


# Shell commands beyond the task oracles, so common exploration commands tokenize well.
_SHELL_LINES = [
    "ls", "ls -la", "pwd", "cat {f}", "head -n 3 {f}", "tail -n 2 {f}", "wc -l {f}", "wc -w {f}",
    "grep -n {w} {f}", "grep -rl {w} .", "find . -name '*.txt'", "sort {f}", "sort -r {f}",
    "uniq {f}", "cut -d ' ' -f 1 {f}", "tr a-z A-Z < {f}", "sed -n '1,3p' {f}", "echo {w} >> {f}",
    "cp {f} {w}.bak", "mv {f} {w}.txt", "mkdir -p {w}", "rm -f {f}", "cd {w}", "cd ..",
    "printf '%s\\n' {w}", "diff {f} {w}.txt", "test -f {f} && echo yes", "cat {f} | wc -l",
]


def _observation(output: str, exit_code: int) -> str:
    return f"{output.rstrip() or '(no output)'}\n\n(exit_code={exit_code})"


def corpus(seed: int = 0, n_tasks: int = 400, family: str = "nano") -> list[str]:
    """Training text for the tokenizer: everything a nano episode is made of.

    Task texts come with made-up parameters (`tasks.template_tasks`): if the train split's
    names were in the corpus they would become single tokens while held-out names split
    into pieces, and a model that only ever copied single tokens would fail on held-out
    tasks for a reason that has nothing to do with the task. This way names of both
    splits split into sub-words by the same merges."""
    import random

    rng = random.Random(f"nano-corpus-{seed}")
    tool_json = [json.dumps(t) for t in TOOLS]
    template_text = [
        prompts.SYSTEM_TEMPLATE,
        prompts.INSTANCE_TEMPLATE,
        prompts.FORMAT_ERROR_TEMPLATE,
        prompts.FORMAT_ERROR_TEXT,
        prompts.TOO_LONG_HINT,
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(tool_json)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>',
    ]
    texts: list[str] = []
    # The fixed prompt text repeats in every episode: weight it so all its words merge.
    texts += template_text * 40
    # The long family's values are made-up words (`long_tasks.LONG_POOLS`), cut into syllables
    # before the merges (`SYLLABLE_PIECE`); its corpus draws thousands of them so that every
    # syllable is common in it.
    words = nano_tasks.pseudo_words(200 if family == "nano" else 4000, seed + 1)
    for t in nano_tasks.template_tasks(n_tasks, seed):
        texts.append(prompts.render(prompts.INSTANCE_TEMPLATE, task=t.instruction))
        for thought, cmd in t.oracle_steps():
            call = json.dumps({"name": "bash", "arguments": {"command": cmd}})
            texts.append(f"{thought}\n<tool_call>\n{call}\n</tool_call>")
        texts += list(t.files.values())
        texts.append(_observation("".join(t.files.values())[:200], 0))
    if family == "long":
        texts += _long_texts(words, n_tasks, seed)
    for _ in range(2000):
        line = rng.choice(_SHELL_LINES).format(f=rng.choice(words) + rng.choice(nano_tasks.EXTS), w=rng.choice(words))
        call = json.dumps({"name": "bash", "arguments": {"command": line}})
        texts.append(f"THOUGHT: Look at the files.\n<tool_call>\n{call}\n</tool_call>")
        texts.append(_observation(rng.choice(["", f"{rng.randint(0, 40)}", rng.choice(words)]), rng.choice([0, 0, 1, 2, 127])))
    return texts


def _long_texts(words: list[str], n_tasks: int, seed: int) -> list[str]:
    """The long-horizon tasks' instructions, steps and files, with made-up words."""
    from tmax.training.nano import long_tasks

    texts = []
    for t in long_tasks.template_tasks(words, n_tasks, seed):
        texts.append(prompts.render(prompts.INSTANCE_TEMPLATE, task=t.instruction))
        for thought, cmd in t.oracle_steps():
            call = json.dumps({"name": "bash", "arguments": {"command": cmd}})
            texts.append(f"{thought}\n<tool_call>\n{call}\n</tool_call>")
        texts += [_observation(text, 0) for text in t.files.values()]
    return texts


@functools.lru_cache(maxsize=4)
def _trained_bpe(seed: int, vocab_size: int, family: str = "nano") -> str:
    """The nano BPE trained on `corpus(seed)`, as its JSON. Training is most of a build's
    time (seconds on 2 cores) and deterministic, so a process that builds several nano
    models (a test session, a benchmark's runs) trains each (seed, vocab) once."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if family == "long":
        # Every syllable of a made-up word is a piece of its own (`SYLLABLE_PIECE`): a value of
        # either split is then a space and 2 or 3 of the same 70 syllable tokens, each copied
        # in every training demonstration, so a copy learned on training values copies a
        # held-out value too. Whole-word tokens cannot: a held-out value's token never occurs
        # in training, and the softmax only ever pushes its logit down.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SYLLABLE_PIECE), "isolated"),
                                                     tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, family=family), trainer=trainer)
    tok.add_tokens([AddedToken(BASH_CALL_PREFIX, normalized=False, special=False)])
    return tok.to_str()


def build_tokenizer(seed: int = 0, vocab_size: int = NanoSpec.vocab_size, family: str = "nano"):
    """A `PreTrainedTokenizerFast` with the nano chat template (deterministic), its merges
    trained on the text of the task `family` (`corpus`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(seed, vocab_size, family)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=NanoSpec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_nano_model(out_dir: str | Path, seed: int = 0, spec: NanoSpec | None = None, family: str = "nano") -> dict:
    """Write tokenizer (for the task `family`) + random-init Qwen3 model to `out_dir`;
    returns a summary dict.

    Deterministic: the same seed (and spec) gives byte-identical files."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    spec = spec or NanoSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = build_tokenizer(seed, spec.vocab_size, family)
    tok.save_pretrained(out)
    t_tok = time.time() - t0

    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    # Seed only a private generator's worth of state: fork_rng keeps the caller's RNG intact.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    # No sampling defaults: clients (and the RL sampler) set temperature/top_p themselves.
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "path": str(out),
        "seed": seed,
        "vocab_size": len(tok),
        "params": n_params,
        "spec": asdict(spec),
        **({"family": family} if family != "nano" else {}),
        "tokenizer_s": round(t_tok, 2),
        "total_s": round(time.time() - t0, 2),
    }
    # nano.json records what was built (no path or timings, so equal builds are equal files).
    record = {k: v for k, v in info.items() if not k.endswith("_s") and k != "path"}
    (out / "nano.json").write_text(json.dumps(record, indent=1) + "\n")
    return info


if __name__ == "__main__":  # python -m tmax.training.nano.model OUT_DIR [SEED]
    import sys

    print(json.dumps(build_nano_model(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0), indent=1))
