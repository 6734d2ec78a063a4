"""Medusa speculation: the heads read the target's hidden state of the last committed token and propose a
tree of candidates (node (i1, .., id) = head-1's i1-th token, then head-2's i2-th, ...), verified in one
target forward with a tree attention mask. Lossless with the rejection/greedy verifier; Medusa's typical
acceptance is available as an APPROXIMATE mode.

The tree is built from what the trainer measured on held-out data and stored in the checkpoint: the
``tree_size`` paths of candidate ranks most often accepted whole (``paths``, the joint measurement), or for
checkpoints without it best-first by the product of each rank's marginal accuracy. Either way a prefix-closed
set, since extending a path never raises its score.
"""

from __future__ import annotations

import heapq

import torch

from runtime.speculation import CandidateTree
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError
from speculate.medusa.heads import MedusaHeads


def build_tree(
    accuracy: list[list[float]], size: int, max_depth: int | None = None, paths: list[list] | None = None
) -> CandidateTree:
    """The ``size`` candidate paths (root excluded) with the highest acceptance probability: measured (``paths``,
    [[ranks], p] sorted by p then depth, as the trainer stores them) when it holds ``size`` paths within the depth
    limit, else estimated as the product of each rank's marginal ``accuracy``."""
    if size < 1:
        raise SpeculatorError(f"the Medusa tree needs at least 1 candidate node, got {size}")
    depth_limit = len(accuracy) if max_depth is None else min(max_depth, len(accuracy))
    measured = [
        tuple(p) for p, _ in sorted(paths or [], key=lambda e: (-e[1], len(e[0]), e[0])) if len(p) <= depth_limit
    ]
    if len(measured) >= size:
        return CandidateTree.from_choices(measured[:size])
    heap: list[tuple[float, tuple[int, ...]]] = [(-accuracy[0][i], (i,)) for i in range(len(accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < size:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth_limit:
            for i, acc in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (neg * acc, (*path, i)))
    return CandidateTree.from_choices(chosen)


class MedusaSpeculator(Speculator):
    name = "medusa"
    proposes_trees = True

    def __init__(self, target, heads: MedusaHeads, tree: CandidateTree, acceptance: str = "rejection"):
        if acceptance not in ("rejection", "typical"):
            raise SpeculatorError(f"Medusa acceptance must be 'rejection' (lossless) or 'typical', got {acceptance!r}")
        if tree.max_depth > heads.config.num_heads:
            raise SpeculatorError(f"tree depth {tree.max_depth} exceeds the {heads.config.num_heads} Medusa heads")
        self.target, self.heads, self.tree, self.acceptance = target, heads, tree, acceptance
        # candidates needed per head: the largest rank used at each depth
        self.ranks = [0] * tree.max_depth
        for choice in tree.choices[1:]:
            d = len(choice) - 1
            self.ranks[d] = max(self.ranks[d], choice[-1] + 1)
        depth, last_rank = tree.depth[1:], [c[-1] for c in tree.choices[1:]]
        self.node_depth = torch.tensor(depth)  # [N-1] depth (head index + 1) of each non-root node
        self.node_rank = torch.tensor(last_rank)  # [N-1] candidate rank within its head

    def max_tokens_per_step(self) -> int:
        return len(self.tree)

    def draft_depth(self) -> int:
        return self.tree.max_depth

    @torch.no_grad()
    def propose(self, state: SpecState) -> Proposal:
        if state.hidden is None:
            raise SpeculatorError("Medusa needs the target's last hidden state per sequence (SpecState.hidden)")
        logits = self.heads(state.hidden, self.target.lm_head)  # [K, B, V]
        width = max(self.ranks)
        top = logits[: len(self.ranks)].topk(width, -1).indices  # [D, B, width]
        nodes = top[self.node_depth - 1, :, self.node_rank].T  # [B, N-1]
        root = torch.tensor([seq[-1] for seq in state.token_ids], device=nodes.device)[:, None]
        return Proposal(tokens=torch.cat([root, nodes], 1), tree=self.tree)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "tree_size": len(self.tree) - 1,
            "tree_depth": self.tree.max_depth,
            "num_heads": self.heads.config.num_heads,
        }
