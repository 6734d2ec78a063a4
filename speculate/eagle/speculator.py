"""EAGLE speculation: the draft head (speculate.eagle.head) grows a dynamic candidate tree scored by its own
confidence (in the manner of EAGLE-2), and the one tree verifier (speculate.verify.verify_tree, through a
CandidateTree proposal) decides.

Growth, per step: level 1 reads [embed(last token); hidden state that produced it]; each level expands the
``frontier`` nodes with the highest path score (sum of the head's log-probabilities along the path) into
their ``topk`` most likely children; after ``depth`` levels the ``tree_size`` best nodes of every level are
kept (a prefix-closed set: a child never scores above its parent). Siblings are ordered by rank, so the
most likely candidate is tried first.

A batch shares one tree shape (nodes are rank paths, as Medusa's) chosen by the path scores summed over the
batch's active rows; each row fills the nodes with its own tokens, so any shape stays lossless, and the tree
verifier draws once per committed token whatever the shape, so a seeded request's tokens do not depend on the
batch mates that shaped its tree (runtime.speculation's seed contract).
"""

from __future__ import annotations

import torch

from runtime.speculation import CandidateTree
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError
from speculate.eagle.head import EagleHead


class EagleSpeculator(Speculator):
    name = "eagle"
    proposes_trees = True

    def __init__(self, target, head: EagleHead, depth: int = 4, topk: int = 4, frontier: int = 4, tree_size: int = 8):
        for label, v in (("depth", depth), ("topk", topk), ("frontier", frontier), ("tree_size", tree_size)):
            if not isinstance(v, int) or v < 1:
                raise SpeculatorError(f"EAGLE {label} must be an integer >= 1, got {v!r}")
        if target.config.hidden_size != head.config.model_config().hidden_size:
            raise SpeculatorError("the EAGLE head's hidden size differs from the target's")
        self.target, self.head = target, head
        self.depth, self.topk, self.frontier, self.tree_size = depth, topk, frontier, tree_size

    def max_tokens_per_step(self) -> int:
        return self.tree_size + 1

    def draft_depth(self) -> int:
        return min(self.depth, self.tree_size)  # a dynamic tree: at most depth levels, at most tree_size nodes

    @torch.no_grad()
    def propose(self, state: SpecState) -> Proposal:
        target, head = self.target, self.head
        if state.hidden is None:
            raise SpeculatorError("EAGLE needs the target's last hidden state per sequence (SpecState.hidden)")
        B = len(state.ids)
        root = torch.tensor([seq[-1] for seq in state.token_ids], device=state.hidden.device)  # [B]
        weight = torch.ones(B, device=root.device)  # every row of the state shapes the tree
        dtype = head.fc.weight.dtype
        # per node: rank path -> (tokens [B], head input [B, H], per-row cumulative log-prob [B])
        x0 = head.inputs(target.embed_tokens(root).to(dtype), state.hidden.to(dtype))
        inputs = {(): x0}
        cum = {(): torch.zeros(B, device=root.device)}
        node_tokens: dict[tuple[int, ...], torch.Tensor] = {}
        scores: dict[tuple[int, ...], float] = {}
        frontier = [()]
        for d in range(self.depth):
            # each frontier path: the head inputs root..node, one causal sequence per (node, row)
            seqs = torch.stack([torch.stack([inputs[p[:i]] for i in range(d + 1)], 1) for p in frontier])  # [F,B,d+1,H]
            out = head(seqs.flatten(0, 1))[:, -1].view(len(frontier), B, -1)  # [F, B, H] predicted features
            logp = torch.log_softmax(target.logits(out).float(), -1)  # [F, B, V]
            top_lp, top_tok = logp.topk(self.topk, -1)  # [F, B, K]
            children = []
            for f, path in enumerate(frontier):
                for r in range(self.topk):
                    child = (*path, r)
                    node_tokens[child] = top_tok[f, :, r]
                    cum[child] = cum[path] + top_lp[f, :, r]
                    scores[child] = float((cum[child] * weight).sum())
                    children.append((child, f))
            if d == self.depth - 1:
                break
            children.sort(key=lambda c: -scores[c[0]])
            frontier = []
            for child, f in children[: self.frontier]:
                inputs[child] = head.inputs(target.embed_tokens(node_tokens[child]).to(dtype), out[f])
                frontier.append(child)
        # best nodes overall; a parent always scores >= its child, and sorting by depth breaks ties parent-first
        chosen, kept = [], {()}
        for path in sorted(scores, key=lambda p: (-scores[p], len(p))):
            if path[:-1] in kept:
                chosen.append(path)
                kept.add(path)
                if len(chosen) == self.tree_size:
                    break
        tree = CandidateTree.from_choices(chosen)
        tokens = torch.stack([root, *(node_tokens[c] for c in tree.choices[1:])], 1)  # [B, N]
        return Proposal(tokens=tokens.to(state.device), tree=tree)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "depth": self.depth,
            "topk": self.topk,
            "frontier": self.frontier,
            "tree_size": self.tree_size,
        }
