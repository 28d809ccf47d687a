"""A toy draft tree and its greedy verification (docs/design.md 2.11).

The tree a block drafter's logits give within the Stager's node budget of
``B + 1`` nodes: the greedy chain to depth ``K = (B + 1) // 2`` and, beside
each of its first ``B - K`` nodes, the drafter's second choice at that depth
as a leaf. Nodes are numbered so that a parent always comes before its
child (what ``Stager.process_tree`` requires). A chain alone (no second
choices) is the same budget spent on depth: ``parents = [-1, 0, 1, ...]``.

Greedy verification keeps the path that follows the target's own choices:
from the root, step to the child whose token is the target's next token
after the current node, while there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DraftTree", "draft_tree", "accepted_path"]


@dataclass(frozen=True)
class DraftTree:
    """Node ``i``'s token and parent (``parents[0] == -1``, the root ``last``) and depth."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @property
    def chain(self) -> list[int]:
        """The greedy chain's nodes, root first (the nodes with the greedy token at each depth)."""
        out = [0]
        for i in range(1, len(self.parents)):
            if self.parents[i] == out[-1] and self.depths[i] == len(out):
                out.append(i)
        return out


def draft_tree(last: int, draft: np.ndarray, second: np.ndarray | None, block: int) -> DraftTree:
    """The tree of ``block + 1`` nodes: the chain of ``draft`` (greedy tokens per depth) to
    depth ``(block + 1) // 2`` with ``second`` (second choices per depth) as leaves beside its
    first nodes; with no ``second``, the whole chain of ``block`` drafts."""
    tokens, parents, depths = [int(last)], [-1], [0]
    depth = block if second is None else (block + 1) // 2
    siblings = 0 if second is None else block - depth
    parent = 0
    for d in range(1, depth + 1):
        tokens.append(int(draft[d - 1]))
        parents.append(parent)
        depths.append(d)
        chain_node = len(tokens) - 1
        if d <= siblings:
            tokens.append(int(second[d - 1]))  # type: ignore[index]
            parents.append(parent)
            depths.append(d)
        parent = chain_node
    return DraftTree(tokens, parents, depths)


def accepted_path(tree: DraftTree, next_tokens: np.ndarray) -> list[int]:
    """The greedy path: from the root, the child whose token is the target's choice after the node."""
    path = [0]
    while True:
        want = int(next_tokens[path[-1]])
        child = next((i for i, p in enumerate(tree.parents) if p == path[-1] and tree.tokens[i] == want), None)
        if child is None:
            return path
        path.append(child)
