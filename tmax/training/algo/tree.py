"""Per-segment advantages of a branching group (`rollout.branching`): the tree its episodes form.

A branching group is a tree. Its roots are the group's episodes as sampled from the prompt;
an episode that reaches a branch point is forked there and each continuation is a child;
the leaves are the finished episodes, each with its reward. A leaf is named by its node
path: the root's index, then the branch taken at each fork (`(3,)` a root that ended before
its first fork, `(3, 0, 1)` root 3, branch 0 at the first fork, branch 1 at the second).
Leaf i's tokens split into segments at its forks: segment d is what node `path[:d + 1]`
sampled (the stretch of turns between fork d and fork d + 1).

The estimator (tree-structured Monte Carlo, as in VinePPO, with no value network):

    V(leaf) = its reward;   V(node) = mean of V over the node's children;
    A(segment d of a leaf) = V(path[:d + 1]) - V(path[:d]),   V(()) = mean of V over the roots.

A segment is credited with how much better the states below it did than the states its
siblings led to from the same parent: the turns before a fork are judged by the mean of
their continuations (a lower-variance value than one episode's reward), the turns after it
against their siblings from the same sandbox. Children are weighted equally, so a branch
lost to an infrastructure failure does not tilt its parent's value toward the branches
left. No division by a standard deviation (the `centered` choice of `advantages`). A group
without forks gets R_i - mean(R), the flat centered advantage; a group whose rewards are all
equal gets zeros.

`first_owner_depth` says which leaf trains each shared segment: the first leaf (in path
order) under a node owns that node's tokens, the others carry them only as context (the
learner's prefix trie computes them once), so every sampled token is one loss token.
"""

from __future__ import annotations

from collections.abc import Sequence

Path = tuple[int, ...]


def _check(paths: Sequence[Path], rewards: Sequence[float]) -> None:
    if not paths or len(paths) != len(rewards):
        raise ValueError(f"a tree needs one reward per leaf: {len(paths)} paths, {len(rewards)} rewards")
    if len(set(paths)) != len(paths):
        raise ValueError("two leaves have the same path")
    if any(not p for p in paths):
        raise ValueError("a leaf path starts with its root's index")
    for p in paths:
        for q in paths:
            if len(q) > len(p) and q[: len(p)] == p:
                raise ValueError(f"leaf {p} is above leaf {q}: a forked episode is not a leaf")


def node_values(paths: Sequence[Path], rewards: Sequence[float]) -> dict[Path, float]:
    """V of every node of the tree (the empty path: the group), children weighted equally."""
    _check(paths, rewards)
    values: dict[Path, float] = {tuple(p): float(r) for p, r in zip(paths, rewards)}
    children: dict[Path, set[Path]] = {}
    for p in paths:
        for d in range(len(p)):
            children.setdefault(tuple(p[:d]), set()).add(tuple(p[: d + 1]))

    def value(node: Path) -> float:
        if node not in values:
            kids = children[node]
            values[node] = sum(value(k) for k in kids) / len(kids)
        return values[node]

    value(())
    return values


def tree_advantages(paths: Sequence[Path], rewards: Sequence[float]) -> list[list[float]]:
    """Per leaf, the advantage of each of its segments (`len(path)` of them)."""
    _check(paths, rewards)
    if max(rewards) == min(rewards):
        return [[0.0] * len(p) for p in paths]  # exact zeros, not rounding residue
    v = node_values(paths, rewards)
    return [[v[tuple(p[: d + 1])] - v[tuple(p[:d])] for d in range(len(p))] for p in paths]


def first_owner_depth(paths: Sequence[Path]) -> list[int]:
    """Per leaf, the first segment it trains: the shallowest depth at which it is the first leaf
    (in path order) under its node. Segments above it are trained by an earlier sibling."""
    first: dict[Path, int] = {}
    for i in sorted(range(len(paths)), key=lambda i: paths[i]):
        for d in range(len(paths[i])):
            first.setdefault(tuple(paths[i][: d + 1]), i)
    return [next(d for d in range(len(p)) if first[tuple(p[: d + 1])] == i) for i, p in enumerate(paths)]
