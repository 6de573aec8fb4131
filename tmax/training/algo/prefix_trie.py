"""A prefix trie over the token sequences of one micro-batch: every distinct prefix once.

The samples of an RL batch repeat each other's beginnings: all of them start with the same
system prompt, the samples of a group with the same task prompt, and often with the same
first turns. `build_trie` stores each distinct prefix once, as one node per token, laid
out depth first (pre-order), so

* a node's ancestors all come before it, and its subtree is the run of nodes right after it;
* a node's position id is its depth (its index in every sequence that passes through it);
* each sequence is a root-to-node path (`PrefixTrie.paths`).

A causal LM run over the nodes, with each node attending to exactly its ancestors and
itself, gives every node the hidden state it has in each of its sequences: that is how the
learner computes a shared prefix once (training.learner.trie_attention). `chains` cuts the
nodes into runs where each node is the child of the one before (one run per sequence that
added nodes), the unit that attention is computed in.

`pack_by_prefix` splits a batch into micro-batches whose tries stay within a node budget.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Chain:
    """Nodes `start .. end - 1`, each the child of the one before; `ancestors` are the
    nodes above `start`, root first (what the chain's tokens attend to besides the chain)."""

    start: int
    end: int
    ancestors: tuple[int, ...]


@dataclass(frozen=True)
class PrefixTrie:
    tokens: list[int]  # token of each node, depth-first pre-order
    depths: list[int]  # position of each node in the sequences through it
    parents: list[int]  # parent node, -1 for a root
    paths: list[list[int]]  # per input sequence, the node of each of its tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def chains(self) -> list[Chain]:
        """The nodes cut into chains, in node order (they tile 0 .. len - 1)."""
        starts = [n for n in range(len(self.tokens)) if n == 0 or self.parents[n] != n - 1]
        out = []
        for start, end in zip(starts, starts[1:] + [len(self.tokens)]):
            out.append(Chain(start, end, tuple(self.ancestors(start))))
        return out

    def ancestors(self, node: int) -> list[int]:
        """The nodes above `node`, root first."""
        up = []
        parent = self.parents[node]
        while parent >= 0:
            up.append(parent)
            parent = self.parents[parent]
        return up[::-1]


def shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def lexicographic_order(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `seqs` sorted by their tokens: sequences sharing a prefix end up next to
    each other, and each one's longest prefix shared with any sequence before it is the
    one shared with its predecessor."""
    return sorted(range(len(seqs)), key=lambda i: list(seqs[i]))


def build_trie(seqs: Sequence[Sequence[int]]) -> PrefixTrie:
    """The prefix trie of `seqs` (each non-empty). Identical sequences share every node."""
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"sequence {i} is empty: a trie path needs at least one token")
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = [[] for _ in seqs]
    prev: Sequence[int] = ()
    prev_path: list[int] = []
    for i in lexicographic_order(seqs):
        s = seqs[i]
        path = prev_path[: shared_prefix_len(prev, s)]
        for depth in range(len(path), len(s)):
            parents.append(path[-1] if path else -1)
            tokens.append(s[depth])
            depths.append(depth)
            path.append(len(tokens) - 1)
        paths[i] = path
        prev, prev_path = s, path
    return PrefixTrie(tokens, depths, parents, paths)


def pack_by_prefix(seqs: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Sequence indices per micro-batch: in lexicographic order, each sequence joins the
    current micro-batch while its trie stays within `budget` nodes (a sequence adds the
    tokens past its prefix shared with the one before). A sequence longer than `budget`
    gets a micro-batch of its own."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    packs: list[list[int]] = []
    nodes = 0
    prev: Sequence[int] = ()
    for i in lexicographic_order(seqs):
        s = seqs[i]
        added = len(s) - shared_prefix_len(prev, s)
        if packs and nodes + added <= budget:
            packs[-1].append(i)
            nodes += added
        else:
            packs.append([i])
            nodes = len(s)
        prev = s
    return packs
