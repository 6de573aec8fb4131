"""The long-horizon nano family (`tasks.family = "long"`, preset `nano-long`): tasks whose
answer has to be found over several dependent commands.

A nano task is one command chosen from the instruction. Here no command after the first can
be written from the instruction: each needs a value an earlier observation showed (a note's
next file, a table's row, what a check says is wrong, what a manifest lists), and the answer
holds a value only an observation reveals. Four kinds, each one formulaic instruction:

    chain     start.txt names the next note, that one the next, ... the last gives the word
              to write: 3 to 5 commands
    lookup    key.txt holds a key, table.dat maps it to the value to write: 3 commands
    fix       check.sh says which setting of app.conf is wrong; fix it, run it again (once
              more for a second problem), its output is the answer: 3 or 5 commands
    manifest  manifest.lst names a folder (the instruction does not) and the files in it to
              combine, in its order: 3 commands

`depth` is the number of commands the oracle needs (the submit not counted); each after
the first uses something an earlier command printed. It is structure, like the kind, and
shared by both splits; every value (names, words, keys, tokens, table sizes) comes from the
split's own pools (`LONG_POOLS`, `base.NUMBERS`), so held-out tasks hold nothing seen in
training.

What observations reveal is listed in the task's metadata (`revealed`): the one-command
baseline (`one_command_pass_rate`) writes each oracle command alone with those values
guessed from the split's pool, the best a policy that cannot read an observation can do
with the oracle's own commands. Command substitution (`$(cat start.txt)`) can chain
commands in one call; the oracle and the teacher never use it.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.common.records import NanoMeta
from tmax.training.nano.family import (ANSWER, SPLITS, SUBMIT_THOUGHT, NanoTask, NUMBERS, Picker, lines_text,
                                     pseudo_words, round_robin)

FAMILY = "long"

_INSTRUCTIONS = {
    "chain": "Start at start.txt and follow the notes. Write the word the last note gives to answer.txt.",
    "lookup": "Look up the key in key.txt in table.dat and write its value to answer.txt.",
    "fix": "Run check.sh and fix app.conf as it says until it passes, then write what it prints to answer.txt.",
    "manifest": "Combine the files manifest.lst lists, in its order, into answer.txt.",
}
LONG_KINDS = tuple(_INSTRUCTIONS)


def _long_pools() -> dict[str, list[str]]:
    """The values' pools: made-up consonant-vowel words (`pseudo_words`), dealt at random
    into a train pool of 1,500 and a held-out pool of its own (550). So many that a value
    seldom repeats: a policy can only solve a task by copying what it read, never by
    recalling a value. Both pools are built of the same syllables, so a held-out value is
    new as a word but tokenizes into pieces (`nano.model`) that training values taught the
    model to copy; no word of one pool is part of a word of the other."""
    words = pseudo_words(2600, seed=49)
    random.Random("nano-long-pools").shuffle(words)
    return {"train": sorted(words[:1500]), "heldout": sorted(words[1500:])}


LONG_POOLS = _long_pools()

# It reports the first wrong setting and exits 0 either way (the report is its output), so a
# failed command (exit code) in a rollout means a command the policy got wrong. Every value
# in a file, an observation or a command follows a space, so it tokenizes the same way
# wherever it appears.
_CHECK_SH = """#!/bin/bash
# Checks app.conf one setting at a time; prints the token only when all are right.
%(checks)s
echo "OK %(token)s"
"""
_CHECK_ONE = ("grep -qx '%(key)s = %(want)s' app.conf || { echo \"FAIL: set %(key)s = %(want)s in app.conf\"; exit 0; }")


def _chain(p: Picker, depth: int) -> NanoTask:
    """start.txt -> note -> ... -> the last note, with the answer word."""
    hops = depth - 2  # notes after start.txt
    notes = [p.word() for _ in range(hops)]
    word, decoy_note, decoy = p.word(), p.word(), p.word()
    files = {"start.txt": f"next: {notes[0]}.txt\n"}
    for here, nxt in zip(notes, notes[1:]):
        files[f"{here}.txt"] = f"next: {nxt}.txt\n"
    files[f"{notes[-1]}.txt"] = f"answer: {word}\n"
    files[f"{decoy_note}.txt"] = f"answer: {decoy}\n"  # a note off the chain: `cat *.txt` shows two answers
    commands = ["cat start.txt"] + [f"cat {n}.txt" for n in notes] + [f"echo {word} > {ANSWER}"]
    thoughts = ["Read the first note."] + ["Follow the note."] * hops + ["Write the word."]
    t = NanoTask(name="", kind="chain", split="", instruction=_INSTRUCTIONS["chain"], commands=commands, files=files,
                 check='number "$DST" "$EXPECTED"', expected=word + "\n")
    t.thoughts = thoughts
    t.params = {"notes": " ".join(notes), "word": word, "decoy": decoy}
    t.revealed = [*notes, word]
    t.value, t.decoy, t.value_step = word, decoy, len(commands) - 1
    return t


def _lookup(p: Picker, depth: int) -> NanoTask:
    n = p.number()
    rows = [(p.word(), p.word()) for _ in range(n)]
    i = p.rng.randrange(n)
    key, value = rows[i]
    decoy = rows[(i + 1) % n][1]  # the next row's value: a misread line
    commands = ["cat key.txt", f"grep {key} table.dat", f"echo {value} > {ANSWER}"]
    t = NanoTask(name="", kind="lookup", split="", instruction=_INSTRUCTIONS["lookup"], commands=commands,
                 files={"key.txt": f"key: {key}\n", "table.dat": lines_text([f"row {k} {v}" for k, v in rows])},
                 check='number "$DST" "$EXPECTED"', expected=value + "\n")
    t.thoughts = ["Read the key.", "Find its row.", "Write the value."]
    t.params = {"key": key, "value": value, "n_rows": n}
    t.revealed, t.value, t.decoy, t.value_step = [key, value], value, decoy, 2
    return t


def _fix(p: Picker, depth: int) -> NanoTask:
    problems = (depth - 1) // 2  # check, then (fix, check) per problem
    settings = [(p.word(), p.word(), p.word()) for _ in range(problems)]  # key, wrong value, wanted value
    name, token = p.word(), p.word()
    conf = lines_text([f"name = {name}"] + [f"{k} = {bad}" for k, bad, _ in settings])
    checks = "\n".join(_CHECK_ONE % {"key": k, "want": want} for k, _, want in settings)
    commands = ["bash check.sh"]
    thoughts = ["Run the check."]
    for k, _, want in settings:
        commands.append(f"echo {k} = {want} >> app.conf")
        thoughts.append("Set what the check asks.")
        commands.append("bash check.sh")
        thoughts.append("Run the check again.")
    commands[-1] = f"bash check.sh > {ANSWER}"
    thoughts[-1] = "Check again and write its output."
    t = NanoTask(name="", kind="fix", split="", instruction=_INSTRUCTIONS["fix"], commands=commands,
                 files={"app.conf": conf, "check.sh": _CHECK_SH % {"checks": checks, "token": token}},
                 check='same "$DST" "$EXPECTED"', expected=f"OK {token}\n")
    t.thoughts = thoughts
    t.params = {"settings": " ".join(f"{k}={want}" for k, _, want in settings), "token": token}
    t.revealed = [w for k, _, want in settings for w in (k, want)]
    k, bad, want = settings[0]
    t.value, t.decoy, t.value_step = f"{k} = {want}", f"{k} = {bad}", 1  # the slip keeps the old value
    return t


def _manifest(p: Picker, depth: int) -> NanoTask:
    """manifest.lst names a folder and the files in it to combine, in its order."""
    folder = p.word()
    parts = [p.word() for _ in range(p.rng.choice((2, 3)))]
    while parts == sorted(parts):  # the listed order is not the glob's
        p.rng.shuffle(parts)
    decoy = p.word()
    listed = " ".join(f"{f}.txt" for f in parts)
    files = {"manifest.lst": f"folder: {folder}\nfiles: {listed}\n",
             f"{folder}/{decoy}.txt": lines_text([f"line {w}" for w in p.lines(2)])}
    for f in parts:
        files[f"{folder}/{f}.txt"] = lines_text([f"line {w}" for w in p.lines(p.rng.choice((1, 2)))])
    commands = ["cat manifest.lst", f"cd {folder}", f"cat {listed} > ../{ANSWER}"]
    t = NanoTask(name="", kind="manifest", split="", instruction=_INSTRUCTIONS["manifest"], commands=commands,
                 files=files, check='same "$DST" "$EXPECTED"',
                 expected="".join(files[f"{folder}/{f}.txt"] for f in parts))
    t.thoughts = ["Read the manifest.", "Go to its folder.", "Combine the listed files."]
    t.params = {"folder": folder, "parts": listed}
    t.revealed = [folder, *parts]
    t.value, t.decoy, t.value_step = f"{parts[-1]}.txt", f"{decoy}.txt", 2
    return t


_MAKERS = {"chain": (_chain, (3, 4, 5)), "lookup": (_lookup, (3,)), "fix": (_fix, (3, 5)),
           "manifest": (_manifest, (3,))}


def make(kind: str, split: str, p: Picker, depth: int | None = None) -> NanoTask:
    """One task of `kind` with parameters drawn by `p`; its depth drawn from the kind's
    depths unless given."""
    if kind not in _MAKERS:
        raise ValueError(f"unknown long-horizon task kind {kind!r}; known kinds: {', '.join(LONG_KINDS)}")
    maker, depths = _MAKERS[kind]
    depth = depth if depth is not None else p.rng.choice(depths)
    if depth not in depths:
        raise ValueError(f"a {kind} task has depth {', '.join(map(str, depths))}, not {depth}")
    p.used = set()
    t = maker(p, depth)
    t.split, t.family, t.depth = split, FAMILY, len(t.commands)
    return t


def generate(split: str, n: int, seed: int = 0, kinds: list[str] | tuple[str, ...] | None = None) -> list[NanoTask]:
    """`n` long-horizon tasks of one split, kinds in round-robin."""
    picker = Picker(LONG_POOLS.get(split, []), NUMBERS.get(split, ()), random.Random(f"nano-long-{split}-{seed}"))
    return round_robin(split, n, tuple(kinds or LONG_KINDS), LONG_KINDS, make, picker,
                       lambda s, i, t: f"long-{s}-{i:04d}-{t.kind}-d{t.depth}", family="long-horizon")


def template_tasks(words: list[str], n: int, seed: int = 0) -> list[NanoTask]:
    """Tasks of every kind with made-up words (the tokenizer corpus: see `tasks.template_tasks`)."""
    picker = Picker(words, tuple(range(3, 10)), random.Random(f"nano-long-template-{seed}"))
    return [make(LONG_KINDS[i % len(LONG_KINDS)], "template", picker) for i in range(n)]


# ---- the sloppy teacher ------------------------------------------------------------------

# What goes wrong in a non-oracle demonstration. The detours still solve the task (and make
# the episode longer); the others fail it: the answer never written (submitted one command
# early), the wrong value used (a decoy the task holds: another note's word, the next row, the
# old setting, an unlisted file), or a typo in the answer's name.
SLIPS = ("detour_ls", "detour_reread", "early_submit", "wrong_value", "typo")
FATAL_SLIPS = ("early_submit", "wrong_value", "typo")


def teacher_steps(meta: NanoMeta, accuracy: float, rng: random.Random) -> tuple[list[tuple[str, str]], bool]:
    """A sloppy teacher's (THOUGHT, command) steps for a written long-horizon task (its
    `[metadata.nano]` table) and whether they solve it: the oracle's with probability
    `accuracy`, else one slip (`SLIPS`, uniformly), then the submit."""
    steps = [(f"THOUGHT: {th}", c) for th, c in zip(meta.thoughts, meta.commands)]
    submit = (f"THOUGHT: {SUBMIT_THOUGHT}", SUBMIT_COMMAND)
    if rng.random() < accuracy:
        return steps + [submit], True
    slip = rng.choice(SLIPS)
    if slip == "detour_ls":
        steps.insert(0, ("THOUGHT: Look around first.", "ls"))
    elif slip == "detour_reread":
        i = rng.randrange(len(steps) - 1)
        steps.insert(i + 1, ("THOUGHT: Read it again.", steps[i][1]))
    elif slip == "early_submit":
        steps = steps[:-1]
    elif slip == "wrong_value":
        i = meta.value_step
        steps[i] = (steps[i][0], steps[i][1].replace(meta.value, meta.decoy))
    else:
        steps[-1] = (steps[-1][0], steps[-1][1].replace(ANSWER, ANSWER[:-1]))
    return steps + [submit], slip not in FATAL_SLIPS


# ---- the one-command baseline ------------------------------------------------------------


def guessed(command: str, revealed: list[str], pool: list[str], rng: random.Random) -> str:
    """`command` as a policy that never read an observation could write it: every value an
    observation revealed replaced by a guess from the split's pool."""
    guesses = {w: rng.choice(pool) for w in revealed}
    return re.sub(r"[a-z]+", lambda m: guesses.get(m.group(0), m.group(0)), command)


def one_command_pass_rate(task_dirs: list[Path], seed: int = 0) -> float:
    """The share of tasks that some single oracle command solves alone, run in a fresh copy
    of the task's files with its observed values guessed (`guessed`), scored by the task's
    own verifier (tests/test.sh). One guess per command and task."""
    rng = random.Random(f"nano-long-one-command-{seed}")
    solved = 0
    for d in task_dirs:
        meta = NanoMeta.read(d)
        pool = LONG_POOLS[meta.split]
        if any(_passes_alone(d, guessed(c, meta.revealed, pool, rng)) for c in meta.commands):
            solved += 1
    return solved / max(1, len(task_dirs))


def _passes_alone(task_dir: Path, command: str) -> bool:
    """Run `command` in a fresh copy of the task's files, then its verifier."""
    with tempfile.TemporaryDirectory(prefix="tmax-one-command-") as tmp:
        work, logs = Path(tmp) / "work", Path(tmp) / "logs"
        shutil.copytree(Path(task_dir) / "environment" / "files", work)
        subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, timeout=10)
        subprocess.run(["bash", str(Path(task_dir) / "tests" / "test.sh")], cwd=work, capture_output=True,
                       timeout=10, env={"PATH": "/usr/bin:/bin", "TMAX_LOGS_DIR": str(logs)})
        reward = logs / "verifier" / "reward.txt"
        return reward.is_file() and reward.read_text().strip() == "1"
