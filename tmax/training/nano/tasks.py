"""Generated terminal tasks for the nano recipe, written in Harbor format.

Each task is one short shell action on one small input file (count, transform, select
lines), verifiable by a bash-only `tests/test.sh`. The action space is small on purpose:
eight kinds, each with one short formulaic instruction and one oracle command that
depends on the kind only (the input is addressed by the `*.dat` glob, the answer always
goes to answer.txt). A from-scratch model of a million parameters learns the format and
the kind-to-command map in minutes; a half-trained one picks the right command for some
tasks but not all, which is what RL needs (groups with reward variance).

Two splits. Every parameter (the input file's name, its words, its line count) is drawn
from a pool that belongs to one split only, so nothing in the held-out split was ever
seen in training: held-out success means the policy solves the kind of task, not that
it memorised a task.

Layout of a task directory (what `tasks.task_format.Task.load` reads):

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

import random
import shutil
from pathlib import Path

import tomli_w

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.common.records import NanoMeta
from tmax.training.nano import long_tasks
from tmax.training.nano.family import (  # noqa: F401 (re-exported: the generator's public names)
    ANSWER, BASE_IMAGE, INPUT_EXT, INPUT_GLOB, POOLS, SPLITS, SUBMIT_THOUGHT, WORKDIR, NanoTask, EXTS, NUMBERS,
    Picker, WORDS, lines_text, pseudo_words, round_robin,
)

# kind -> (instruction with {src}, oracle command, THOUGHT). One short, formulaic sentence
# per kind; the oracle command depends on the kind only.
_KINDS = {
    "count_lines": ("Count the lines in {src} and write the number to answer.txt.",
                    "wc -l < *.dat > answer.txt", "Count lines with wc."),
    "count_words": ("Count the words in {src} and write the number to answer.txt.",
                    "wc -w < *.dat > answer.txt", "Count words with wc."),
    "upper": ("Convert {src} to upper case and write it to answer.txt.",
              "tr a-z A-Z < *.dat > answer.txt", "Use tr."),
    "sort": ("Sort the lines of {src} and write them to answer.txt.",
             "sort *.dat > answer.txt", "Use sort."),
    "reverse": ("Write the lines of {src} in reverse order to answer.txt.",
                "tac *.dat > answer.txt", "Use tac."),
    "first": ("Write the first line of {src} to answer.txt.",
              "head -n 1 *.dat > answer.txt", "Use head."),
    "last": ("Write the last line of {src} to answer.txt.",
             "tail -n 1 *.dat > answer.txt", "Use tail."),
    "unique": ("Write the distinct lines of {src}, sorted, to answer.txt.",
               "sort -u *.dat > answer.txt", "Use sort -u."),
}
KINDS = tuple(_KINDS)
_THOUGHTS = {k: v[2] for k, v in _KINDS.items()}


def template_tasks(n: int, seed: int = 0) -> list[NanoTask]:
    """Tasks of every kind with made-up parameters: the task wording and command shapes
    without any real parameter, e.g. for training a tokenizer that must not learn the
    train split's names as whole tokens (held-out names would then look different)."""
    picker = Picker(pseudo_words(400, seed), tuple(range(3, 10)), random.Random(f"nano-template-{seed}"))
    return [_make(KINDS[i % len(KINDS)], "template", picker) for i in range(n)]


def _input_lines(kind: str, p: Picker) -> list[str]:
    """Seed lines such that the kind's answer differs from the input and from the answers
    of the kinds it is most easily confused with (sort vs unique vs reverse)."""
    n = p.number()
    while True:
        p.used = set()
        if kind == "unique":
            lines = p.lines(n - 1)
            lines.insert(p.rng.randrange(1, n), p.rng.choice(lines))  # one duplicate line
        else:
            lines = p.lines(n, 2 if kind in ("count_words", "upper") else 1)
        if kind == "unique" or (lines != sorted(lines) and lines != sorted(lines, reverse=True)):
            return lines


def _make(kind: str, split: str, p: Picker) -> NanoTask:
    if kind not in _KINDS:
        raise ValueError(f"unknown nano task kind {kind!r}; known kinds: {', '.join(KINDS)}")
    instruction, command, _ = _KINDS[kind]
    lines = _input_lines(kind, p)
    src = p.word() + INPUT_EXT
    t = NanoTask(name="", kind=kind, split=split, instruction=instruction.format(src=src), commands=[command],
                 thoughts=[_THOUGHTS[kind]])
    t.files = {src: lines_text(lines)}
    t.params = {"src": src, "n_lines": len(lines)}
    same, number = 'same "$DST" "$EXPECTED"', 'number "$DST" "$EXPECTED"'
    answer = {
        "count_lines": f"{len(lines)}\n",
        "count_words": f"{sum(len(x.split()) for x in lines)}\n",
        "upper": lines_text([x.upper() for x in lines]),
        "sort": lines_text(sorted(lines)),  # single lowercase ASCII words: locale-independent
        "reverse": lines_text(lines[::-1]),
        "first": lines_text(lines[:1]),
        "last": lines_text(lines[-1:]),
        "unique": lines_text(sorted(set(lines))),
    }[kind]
    t.expected, t.check = answer, (number if kind.startswith("count") else same)
    return t


FAMILIES = ("nano", "long")


def generate(split: str, n: int, seed: int = 0, kinds: list[str] | tuple[str, ...] | None = None,
             family: str = "nano") -> list[NanoTask]:
    """`n` tasks of one split, kinds in round-robin so every kind is equally common; `family`
    "long" gives the long-horizon tasks (`long_tasks`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown nano task family {family!r}; use one of {', '.join(FAMILIES)}")
    if family == "long":
        return long_tasks.generate(split, n, seed, kinds)
    # The split is part of the stream so train and held-out differ even with one seed.
    picker = Picker(POOLS.get(split, []), NUMBERS.get(split, ()), random.Random(f"nano-{split}-{seed}"))
    return round_robin(split, n, tuple(kinds or KINDS), KINDS, _make, picker,
                       lambda s, i, t: f"nano-{s}-{i:04d}-{t.kind.replace('_', '-')}")


def value_pool(split: str, family: str = "nano") -> list[str]:
    """The words a split's task values are drawn from (`family`'s pools): copy pre-training
    (`learner.copy_warmup`) draws the train split's, so held-out values stay unseen."""
    if family not in FAMILIES:
        raise ValueError(f"unknown nano task family {family!r}; use one of {', '.join(FAMILIES)}")
    return (long_tasks.LONG_POOLS if family == "long" else POOLS)[split]


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


def _task_toml(t: NanoTask) -> dict:
    return {
        "version": "1.0",
        "metadata": {
            "author_name": "tmax nano task generator", "difficulty": "easy" if t.family == "nano" else "medium",
            "category": f"nano-{t.kind.split('_')[0]}", "tags": ["nano", t.kind],
            "nano": t.meta().toml_table(),
        },
        "verifier": {"timeout_sec": 30.0},
        "agent": {"timeout_sec": 300.0},
        "environment": {"build_timeout_sec": 300.0, "cpus": 1, "memory_mb": 512, "storage_mb": 1024,
                        "allow_internet": False},
    }


def write_task(t: NanoTask, task_dir: Path) -> Path:
    """Write one task directory (replacing an old one of the same name)."""
    task_dir = Path(task_dir)
    if task_dir.exists():
        shutil.rmtree(task_dir)
    env, tests, sol = task_dir / "environment", task_dir / "tests", task_dir / "solution"
    for d in (env / "files", tests, sol):
        d.mkdir(parents=True)
    (task_dir / "task.toml").write_text(tomli_w.dumps(_task_toml(t)))
    (task_dir / "instruction.md").write_text(t.instruction + "\n")
    copy = "COPY files/ ./\n" if t.files else ""
    (env / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nWORKDIR {WORKDIR}\n{copy}")
    for rel, text in t.files.items():
        (env / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (env / "files" / rel).write_text(text)
    dst = t.dst
    (tests / "test.sh").write_text(_TEST_SH % {"dst": dst, "check": t.check})
    (tests / "expected.txt").write_text(t.expected)
    solve = "#!/bin/bash\n# Reference solution (run in the task's work dir).\nset -e\n" + "".join(c + "\n" for c in t.commands)
    (sol / "solve.sh").write_text(solve)
    for f in (tests / "test.sh", sol / "solve.sh"):
        f.chmod(0o755)
    return task_dir


def write_splits(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0,
                 **generator: object) -> dict[str, list[Path]]:
    """Write `out_dir/train/*` and `out_dir/heldout/*`; returns the task dirs per split."""
    out = Path(out_dir)
    result: dict[str, list[Path]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        (out / split).mkdir(parents=True, exist_ok=True)
        result[split] = [write_task(t, out / split / t.name) for t in generate(split, n, seed, **generator)]  # type: ignore[arg-type]
    return result


def oracle_commands(task_dir: str | Path) -> list[str]:
    """The commands that solve a written task, then the submit command."""
    return NanoMeta.read(Path(task_dir)).commands + [SUBMIT_COMMAND]


def oracle_steps(task_dir: str | Path) -> list[tuple[str, str]]:
    """(THOUGHT text, command) per oracle step of a written task, ending with the submit."""
    meta = NanoMeta.read(Path(task_dir))
    thoughts = meta.thoughts or [_THOUGHTS[meta.kind]] * len(meta.commands)
    steps = [(f"THOUGHT: {th}", c) for th, c in zip(thoughts, meta.commands)]
    return steps + [(f"THOUGHT: {SUBMIT_THOUGHT}", SUBMIT_COMMAND)]


# A sloppy teacher's slips: each one breaks the oracle command of any kind (the answer file
# is missing or empty), independently of the task kind.
_SLIPS = (
    (" > " + ANSWER, " > " + ANSWER[:-1]),  # a typo in the output file name
    (INPUT_GLOB, "*.txt"),  # the wrong input file
    (" > " + ANSWER, ""),  # the answer printed instead of written
)


def teacher_steps(task_dir: str | Path, accuracy: float, rng: random.Random) -> tuple[list[tuple[str, str]], bool]:
    """An imperfect teacher's (THOUGHT, command) steps for a written task, and whether they
    are the oracle's: with probability `accuracy` the oracle's, otherwise the right command
    with one slip (a typo in the output name, the wrong input, no redirect), then the
    submit either way. The slips do not depend on the task kind, so SFT on such
    demonstrations still learns the kind-to-command map, plus a habit of slipping that
    the verifier's reward (RL) can remove."""
    if not 0.0 < accuracy <= 1.0:
        raise ValueError(f"teacher accuracy must be in (0, 1], got {accuracy}")
    meta = NanoMeta.read(Path(task_dir))
    if meta.family == long_tasks.FAMILY:
        return long_tasks.teacher_steps(meta, accuracy, rng)
    steps = oracle_steps(task_dir)
    if rng.random() < accuracy:
        return steps, True
    old, new = rng.choice(_SLIPS)
    thought, command = steps[0]
    if old not in command:
        raise ValueError(f"{task_dir}: oracle command {command!r} has no {old!r} to slip on")
    return [(thought, command.replace(old, new, 1))] + steps[1:], False
