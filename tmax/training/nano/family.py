"""What every generated nano task family shares (`tasks`: one command each; `long_tasks`:
several dependent commands): the conventions, the split-disjoint word pools, the task record
and the parameter picker. A written task's `[metadata.nano]` table is
`common.records.NanoMeta`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.common.records import NanoMeta
from tmax.sandbox.base_image import DEFAULT_BASE_TAG

SUBMIT_THOUGHT = "Done, so I submit."

BASE_IMAGE = DEFAULT_BASE_TAG
WORKDIR = "/app"
SPLITS = ("train", "heldout")

# Plain lowercase words; none is a substring of another (the grep-based kinds rely on it).
WORDS = """
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

EXTS = (".txt", ".log", ".md", ".dat")  # exploration vocabulary of the tokenizer corpus
# Conventions shared by every task (not parameters): the input is the one `*.dat` file in
# the work dir, the answer goes to answer.txt. A command can address the input by a glob,
# so solving a task needs the task kind, never a copy of a name the model has not seen.
INPUT_EXT = ".dat"
INPUT_GLOB = "*" + INPUT_EXT
ANSWER = "answer.txt"
# Line counts: disjoint ranges per split (they are the answers of the counting kinds).
NUMBERS = {"train": (3, 4, 5, 6), "heldout": (7, 8, 9)}


def _word_pools() -> dict[str, list[str]]:
    words = sorted(set(WORDS))
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
    params: dict[str, str | int] = field(default_factory=dict)  # what varies between tasks
    dst: str = ANSWER
    thoughts: list[str] = field(default_factory=list)  # one per command (the demos' THOUGHT text)
    # The long-horizon family (`long_tasks`): the commands the task needs (`depth`), the
    # values only observations reveal, and the value a sloppy teacher swaps for a decoy in
    # command `value_step`.
    family: str = "nano"
    depth: int = 1
    revealed: list[str] = field(default_factory=list)
    value: str = ""
    decoy: str = ""
    value_step: int = 0

    def meta(self) -> NanoMeta:
        """The task's `[metadata.nano]` table."""
        return NanoMeta(kind=self.kind, split=self.split, commands=list(self.commands), params=dict(self.params),
                        family=self.family, depth=self.depth, thoughts=list(self.thoughts),
                        revealed=list(self.revealed), value=self.value, decoy=self.decoy, value_step=self.value_step)

    def oracle_steps(self) -> list[tuple[str, str]]:
        """(thought, command) per step, ending with the submit command."""
        steps = [(f"THOUGHT: {th}", c) for th, c in zip(self.thoughts, self.commands)]
        return steps + [(f"THOUGHT: {SUBMIT_THOUGHT}", SUBMIT_COMMAND)]


class Picker:
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

    def number(self) -> int:
        return self.rng.choice(self.numbers)

    def lines(self, n: int, words_per_line: int = 1) -> list[str]:
        return [" ".join(self.word() for _ in range(words_per_line)) for _ in range(n)]


def round_robin(split: str, n: int, kinds: tuple[str, ...], known: tuple[str, ...], make, picker: Picker,
                name, family: str = "nano") -> list[NanoTask]:
    """`n` tasks of one split, `kinds` in turn so each is equally common: `make(kind, split,
    picker)` builds one, `name(split, i, task)` names it. Both task families generate through it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    for k in kinds:
        if k not in known:
            raise ValueError(f"unknown {family} task kind {k!r}; known kinds: {', '.join(known)}")
    tasks = []
    for i in range(n):
        t = make(kinds[i % len(kinds)], split, picker)
        t.name = name(split, i, t)
        tasks.append(t)
    return tasks


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """Made-up consonant-vowel words (`bakori`, `tunefa`, ...), disjoint from both pools."""
    rng = random.Random(f"nano-pseudo-{seed}")
    real = set(WORDS)
    out: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.choice((2, 3))))
        if w not in real:
            out.add(w)
    words = sorted(out)
    return [w for w in words if not any(w != v and w in v for v in words)]


def lines_text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)
