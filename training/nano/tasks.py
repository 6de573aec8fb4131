"""Generated terminal tasks for the nano recipe, written in Harbor format.

Each task is one short shell action on a few small files (create, transform, count,
search), verifiable by a bash-only `tests/test.sh`. The action space is small on purpose:
a tiny model can learn it, and a half-trained one solves some tasks but not all, which is
what RL needs (groups with reward variance).

Two splits. Every parameter (file names, words, numbers) is drawn from a pool that
belongs to one split only, so nothing in the held-out split was ever seen in training:
held-out success means the model copied parameters from the instruction, not memorised.

Layout of a task directory (what `tasks.model.Task.load` reads):

    task.toml                 [metadata.nano] holds kind, split, params and the oracle
    instruction.md
    environment/Dockerfile    FROM localhost/tmax-base:bookworm, WORKDIR /app, COPY files/
    environment/files/        seed files, copied into the work dir (image or host workspace)
    tests/test.sh, tests/expected.txt
    solution/solve.sh

The verifier checks the work dir `$TMAX_WORKDIR` (default: its cwd, or /app when run from
/) and writes `$TMAX_LOGS_DIR/verifier/reward.txt` (default /logs), so the same task runs
in a podman container and on the `local` / `bwrap` sandboxes.
"""

from __future__ import annotations

import json
import random
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from agents.prompts import SUBMIT_COMMAND

BASE_IMAGE = "localhost/tmax-base:bookworm"
WORKDIR = "/app"
SPLITS = ("train", "heldout")

# Plain lowercase words; none is a substring of another (the grep-based kinds rely on it).
_WORDS = """
acorn amber anchor apple arrow aspen autumn badge bakery bamboo banjo barley basin beacon
bison blossom bonnet bramble breeze bridge bronze bucket bugle button cabin cactus camel
candle canyon carbon carpet castle cedar cello cherry chimney cider cinema circus clover
cobalt comet copper coral cotton coyote crater crayon cricket crystal cupboard dahlia daisy
delta desert dolphin dragon ember falcon feather fennel ferry fiddle figure flannel forest
fossil fountain gadget garden garlic gazelle geyser ginger glacier goblet granite gravel
guitar hammer harbor harvest hazel helmet heron hollow honey hornet iceberg indigo island
ivory jacket jasmine jigsaw jungle kettle kiwi ladder lagoon lantern lemon lentil lilac
lizard lobster locket lotus magnet mango maple marble meadow melon mirror mitten monsoon
mosaic muffin mustard nectar needle nickel noodle nutmeg oasis olive onion orchid otter
oyster paddle palace panda papaya parrot pebble pepper pickle pigeon pillow pistol planet
plum pollen poppy potato pretzel puzzle quartz quill rabbit radish raven ribbon rocket
saddle saffron salmon sandal satchel scarf sequoia shadow shovel silver sketch sparrow
spider spruce squash statue stove sugar summit sunset swallow tablet teapot thimble thistle
thunder tiger timber tomato topaz tornado trumpet tulip tunnel turnip turtle umbrella
valley velvet violet volcano waffle walnut walrus willow window winter wizard yogurt zebra
""".split()

_EXTS = (".txt", ".log", ".md", ".dat")
# Line counts and `n` parameters: disjoint ranges per split.
_NUMBERS = {"train": (2, 3, 4, 5, 6), "heldout": (7, 8, 9)}

KINDS = (
    "create",
    "upper",
    "replace",
    "sort",
    "head",
    "count_lines",
    "count_words",
    "count_matches",
    "find_line",
    "find_file",
)

# One short THOUGHT per kind, for oracle trajectories (the harness requires a THOUGHT;
# short, because the nano recipe caps a turn at a few dozen tokens).
_THOUGHTS = {
    "create": "Write the line with echo.",
    "upper": "Use tr.",
    "replace": "Use sed.",
    "sort": "Use sort.",
    "head": "Use head.",
    "count_lines": "Count with wc.",
    "count_words": "Count with wc.",
    "count_matches": "Count with grep.",
    "find_line": "Search with grep.",
    "find_file": "Search with grep.",
}
SUBMIT_THOUGHT = "Done, so I submit."


def _word_pools() -> dict[str, list[str]]:
    words = sorted(set(_WORDS))
    clash = {w for w in words for v in words if w != v and w in v}
    words = [w for w in words if w not in clash]
    # Every fourth word is held out; the split is fixed, independent of any seed.
    return {"train": [w for i, w in enumerate(words) if i % 4 != 3], "heldout": [w for i, w in enumerate(words) if i % 4 == 3]}


POOLS = _word_pools()


@dataclass
class NanoTask:
    name: str
    kind: str
    split: str
    instruction: str
    commands: list[str]  # the oracle: shell commands that solve it (submit not included)
    files: dict[str, str] = field(default_factory=dict)  # seed files, relative to the work dir
    check: str = ""  # bash condition that is true when solved (in test.sh, cwd = work dir)
    expected: str = ""  # tests/expected.txt
    params: dict[str, str | int] = field(default_factory=dict)

    def oracle_steps(self) -> list[tuple[str, str]]:
        """(thought, command) per step, ending with the submit command."""
        steps = [(f"THOUGHT: {_THOUGHTS[self.kind]}", c) for c in self.commands]
        return steps + [(f"THOUGHT: {SUBMIT_THOUGHT}", SUBMIT_COMMAND)]


class _Picker:
    """Draws parameters from one pool; names in one task never repeat."""

    def __init__(self, words: list[str], numbers: tuple[int, ...], rng: random.Random):
        self.words = words
        self.numbers = numbers
        self.rng = rng
        self.used: set[str] = set()

    def word(self) -> str:
        w = self.rng.choice([w for w in self.words if w not in self.used])
        self.used.add(w)
        return w

    def fname(self) -> str:
        return self.word() + self.rng.choice(_EXTS)

    def number(self) -> int:
        return self.rng.choice(self.numbers)

    def lines(self, n: int, words_per_line: int = 1) -> list[str]:
        return [" ".join(self.word() for _ in range(words_per_line)) for _ in range(n)]


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """Made-up consonant-vowel words (`bakori`, `tunefa`, ...), disjoint from both pools."""
    rng = random.Random(f"nano-pseudo-{seed}")
    real = set(_WORDS)
    out: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3))))
        if w not in real:
            out.add(w)
    words = sorted(out)
    return [w for w in words if not any(w != v and w in v for v in words)]


def template_tasks(n: int, seed: int = 0) -> list[NanoTask]:
    """Tasks of every kind with made-up parameters: the task wording and command shapes
    without any real parameter, e.g. for training a tokenizer that must not learn the
    train split's names as whole tokens (held-out names would then look different)."""
    picker = _Picker(pseudo_words(400, seed), tuple(range(2, 10)), random.Random(f"nano-template-{seed}"))
    return [_make(KINDS[i % len(KINDS)], "template", picker) for i in range(n)]


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _make(kind: str, split: str, p: _Picker) -> NanoTask:
    rng = p.rng
    p.used = set()  # names may repeat across tasks, never within one
    t = NanoTask(name="", kind=kind, split=split, instruction="", commands=[])
    same = 'same "$DST" "$EXPECTED"'
    if kind == "create":
        word, dst = p.word(), p.fname()
        t.instruction = f"Create a file named {dst} that contains the single line {word}."
        t.commands = [f"echo {word} > {dst}"]
        t.expected, t.check, t.params = word + "\n", same, {"dst": dst, "word": word}
    elif kind == "upper":
        src, dst, n = p.fname(), p.fname(), p.number()
        lines = p.lines(n, 2)
        t.files = {src: _text(lines)}
        t.instruction = f"Convert the text of {src} to upper case and write it to {dst}."
        t.commands = [f"tr a-z A-Z < {src} > {dst}"]
        t.expected, t.check = _text([x.upper() for x in lines]), same
        t.params = {"src": src, "dst": dst, "n_lines": n}
    elif kind == "replace":
        src, dst, n = p.fname(), p.fname(), p.number()
        old, new = p.word(), p.word()
        lines = [f"{old} {w}" if i % 2 == 0 else f"{w} {old}" for i, w in enumerate(p.lines(n))]
        t.files = {src: _text(lines)}
        t.instruction = f"Replace every {old} with {new} in {src} and write the result to {dst}."
        t.commands = [f"sed 's/{old}/{new}/g' {src} > {dst}"]
        t.expected, t.check = _text([x.replace(old, new) for x in lines]), same
        t.params = {"src": src, "dst": dst, "old": old, "new": new, "n_lines": n}
    elif kind == "sort":
        src, dst, n = p.fname(), p.fname(), p.number()
        lines = p.lines(n)
        if lines == sorted(lines):  # a seed file that is already sorted would be no task
            lines.reverse()
        t.files = {src: _text(lines)}
        t.instruction = f"Sort the lines of {src} alphabetically and write them to {dst}."
        t.commands = [f"sort {src} > {dst}"]
        # Single lowercase ASCII words sort the same in every locale.
        t.expected, t.check = _text(sorted(lines)), same
        t.params = {"src": src, "dst": dst, "n_lines": n}
    elif kind == "head":
        src, dst = p.fname(), p.fname()
        k = p.number()
        lines = p.lines(k + rng.choice((2, 3)))
        t.files = {src: _text(lines)}
        t.instruction = f"Write the first {k} lines of {src} to {dst}."
        t.commands = [f"head -n {k} {src} > {dst}"]
        t.expected, t.check = _text(lines[:k]), same
        t.params = {"src": src, "dst": dst, "n": k}
    elif kind in ("count_lines", "count_words"):
        src, dst, n = p.fname(), p.fname(), p.number()
        per_line = 1 if kind == "count_lines" else 2
        lines = p.lines(n, per_line)
        t.files = {src: _text(lines)}
        what = "lines" if kind == "count_lines" else "words"
        t.instruction = f"Count the {what} in {src} and write the number to {dst}."
        t.commands = [f"wc -{what[0]} < {src} > {dst}"]
        t.expected, t.check = f"{n * per_line}\n", 'number "$DST" "$EXPECTED"'
        t.params = {"src": src, "dst": dst, "n_lines": n}
    elif kind == "count_matches":
        src, dst, word = p.fname(), p.fname(), p.word()
        n, hits = p.number(), p.number()
        lines = p.lines(n + hits)
        idx = sorted(rng.sample(range(len(lines)), hits))
        lines = [f"{x} {word}" if i in idx else x for i, x in enumerate(lines)]
        t.files = {src: _text(lines)}
        t.instruction = f"Count the lines of {src} that contain {word} and write the number to {dst}."
        t.commands = [f"grep -c {word} {src} > {dst}"]
        t.expected, t.check = f"{hits}\n", 'number "$DST" "$EXPECTED"'
        t.params = {"src": src, "dst": dst, "word": word, "n_lines": n, "hits": hits}
    elif kind == "find_line":
        src, dst, word = p.fname(), p.fname(), p.word()
        lines = p.lines(p.number(), 2)
        hit = rng.randrange(len(lines))
        lines[hit] = f"{lines[hit]} {word}"
        t.files = {src: _text(lines)}
        t.instruction = f"Find the line of {src} that contains {word} and write that line to {dst}."
        t.commands = [f"grep {word} {src} > {dst}"]
        t.expected, t.check = lines[hit] + "\n", same
        t.params = {"src": src, "dst": dst, "word": word}
    elif kind == "find_file":
        folder, dst, word = p.word(), p.fname(), p.word()
        names = [p.fname() for _ in range(p.number())]
        hit = rng.randrange(len(names))
        for i, name in enumerate(names):
            body = p.lines(2)
            t.files[f"{folder}/{name}"] = _text(body + [word] if i == hit else body)
        t.instruction = f"One file in the folder {folder} contains the word {word}. Write the path of that file to {dst}."
        t.commands = [f"grep -l {word} {folder}/* > {dst}"]
        t.expected, t.check = f"{folder}/{names[hit]}\n", 'path "$DST" "$EXPECTED"'
        t.params = {"dir": folder, "dst": dst, "word": word, "n_files": len(names)}
    else:
        raise ValueError(f"unknown nano task kind {kind!r}; known kinds: {', '.join(KINDS)}")
    return t


def generate(split: str, n: int, seed: int = 0, kinds: list[str] | tuple[str, ...] | None = None) -> list[NanoTask]:
    """`n` tasks of one split, kinds in round-robin so every kind is equally common."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    kinds = tuple(kinds or KINDS)
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown nano task kind {k!r}; known kinds: {', '.join(KINDS)}")
    # The split is part of the stream so train and held-out differ even with one seed.
    picker = _Picker(POOLS[split], _NUMBERS[split], random.Random(f"nano-{split}-{seed}"))
    tasks = []
    for i in range(n):
        t = _make(kinds[i % len(kinds)], split, picker)
        t.name = f"nano-{split}-{i:04d}-{t.kind.replace('_', '-')}"
        tasks.append(t)
    return tasks


_TEST_SH = """#!/bin/bash
# Verifier of a generated nano task: writes 1 or 0 to $LOGS/verifier/reward.txt.
# The work dir is $TMAX_WORKDIR, else the cwd (the image WORKDIR), else /app.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${TMAX_WORKDIR:-$PWD}"
[ "$WORK" = / ] && WORK=/app
LOGS="${TMAX_LOGS_DIR:-/logs}"
mkdir -p "$LOGS/verifier"
cd "$WORK" || { echo "verifier: no work dir $WORK" >&2; exit 2; }
DST=%(dst)s
EXPECTED="$HERE/expected.txt"
# same: equal text up to trailing newlines; number: equal after removing blanks;
# path: equal after dropping a leading ./ (a bare file name is accepted too).
same() { [ -f "$1" ] && [ "$(cat "$1")" = "$(cat "$2")" ]; }
number() { [ -f "$1" ] && [ "$(tr -d '[:space:]' < "$1")" = "$(tr -d '[:space:]' < "$2")" ]; }
path() {
    [ -f "$1" ] || return 1
    local got want
    got="$(tr -d '[:space:]' < "$1")"; got="${got#./}"; want="$(cat "$2")"
    [ "$got" = "$want" ] || [ "$got" = "${want##*/}" ] || [ "$got" = "$WORK/$want" ]
}
if %(check)s; then
    echo 1 > "$LOGS/verifier/reward.txt"; echo "PASS: $DST is correct"
else
    echo 0 > "$LOGS/verifier/reward.txt"; echo "FAIL: $DST is missing or wrong"
fi
"""


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string of plain ASCII is a valid TOML basic string


def _task_toml(t: NanoTask) -> str:
    params = "\n".join(f"{k} = {_toml_str(v) if isinstance(v, str) else v}" for k, v in t.params.items())
    commands = ", ".join(_toml_str(c) for c in t.commands)
    return f"""version = "1.0"

[metadata]
author_name = "tmax nano task generator"
difficulty = "easy"
category = "nano-{t.kind.split('_')[0]}"
tags = ["nano", {_toml_str(t.kind)}]

[metadata.nano]
kind = {_toml_str(t.kind)}
split = {_toml_str(t.split)}
commands = [{commands}]

[metadata.nano.params]
{params}

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = 512
storage_mb = 1024
allow_internet = false
"""


def write_task(t: NanoTask, task_dir: Path) -> Path:
    """Write one task directory (replacing an old one of the same name)."""
    task_dir = Path(task_dir)
    if task_dir.exists():
        shutil.rmtree(task_dir)
    env, tests, sol = task_dir / "environment", task_dir / "tests", task_dir / "solution"
    for d in (env / "files", tests, sol):
        d.mkdir(parents=True)
    (task_dir / "task.toml").write_text(_task_toml(t))
    (task_dir / "instruction.md").write_text(t.instruction + "\n")
    copy = "COPY files/ ./\n" if t.files else ""
    (env / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nWORKDIR {WORKDIR}\n{copy}")
    for rel, text in t.files.items():
        (env / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (env / "files" / rel).write_text(text)
    dst = t.params["dst"]
    (tests / "test.sh").write_text(_TEST_SH % {"dst": dst, "check": t.check})
    (tests / "expected.txt").write_text(t.expected)
    solve = "#!/bin/bash\n# Reference solution (run in the task's work dir).\nset -e\n" + "".join(c + "\n" for c in t.commands)
    (sol / "solve.sh").write_text(solve)
    for f in (tests / "test.sh", sol / "solve.sh"):
        f.chmod(0o755)
    return task_dir


def write_splits(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0, **generator: object) -> dict[str, list[Path]]:
    """Write `out_dir/train/*` and `out_dir/heldout/*`; returns the task dirs per split."""
    out = Path(out_dir)
    result: dict[str, list[Path]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        (out / split).mkdir(parents=True, exist_ok=True)
        result[split] = [write_task(t, out / split / t.name) for t in generate(split, n, seed, **generator)]  # type: ignore[arg-type]
    return result


def _nano_meta(task_dir: Path) -> dict:
    meta = tomllib.loads((Path(task_dir) / "task.toml").read_text()).get("metadata", {}).get("nano")
    if not meta:
        raise ValueError(f"{task_dir}/task.toml: no [metadata.nano] table (not a generated nano task)")
    return meta


def oracle_commands(task_dir: str | Path) -> list[str]:
    """The commands that solve a written task, then the submit command."""
    return list(_nano_meta(Path(task_dir))["commands"]) + [SUBMIT_COMMAND]


def oracle_steps(task_dir: str | Path) -> list[tuple[str, str]]:
    """(THOUGHT text, command) per oracle step of a written task, ending with the submit."""
    meta = _nano_meta(Path(task_dir))
    steps = [(f"THOUGHT: {_THOUGHTS[meta['kind']]}", c) for c in meta["commands"]]
    return steps + [(f"THOUGHT: {SUBMIT_THOUGHT}", SUBMIT_COMMAND)]


def seed_workdir(task_dir: str | Path, workdir: str | Path) -> None:
    """Copy the task's seed files into a host work dir (what the Dockerfile's COPY does in
    an image), for the `local` and `bwrap` sandboxes."""
    files = Path(task_dir) / "environment" / "files"
    if files.is_dir():
        shutil.copytree(files, workdir, dirs_exist_ok=True)
