"""The one verifier: which drafted tokens the target accepts, and the token it emits after them.

Lossless rules (the output has exactly the target's distribution):
- ``rejection_sample`` (chain of k drafts per sequence, batched): accept draft x_j with probability
  min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a sample of norm(max(0, p_j - q_j)); when all
  drafts are accepted emit a bonus sample of p_k. Deterministic drafts (n-gram, Medusa) are the case
  q = one-hot (``draft_probs=None``): accept with probability p_j(x_j), on rejection sample p_j with x_j
  removed. Greedy is the case p = one-hot: ``greedy_verify`` is that case without random draws.
- ``tree_rejection_sample`` / ``tree_greedy_verify``: a tree of deterministic candidates. At each node one
  token is drawn from the target's distribution and the child holding it (if any) is descended into:
  multi-candidate rejection with one-hot drafts (SpecInfer-style), in the form that uses one draw per
  committed token, so a row's draws never depend on the tree's shape.

Approximate rules (change the output distribution; labelled as such wherever reported):
- ``typical_accept_chain`` / ``typical_accept_tree``: Medusa's typical acceptance, a candidate is kept if
  p(x) > min(epsilon, delta * exp(-H(p))).

p and q are probabilities from ``runtime.sampling.logits_to_probs`` with the same SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.sampling import SamplingParams, argmax, logits_to_probs, sample
from runtime.speculation import CandidateTree  # the tree is part of the contract (runtime.speculation)


@dataclass
class ChainResult:
    num_accepted: Tensor  # [B] drafted tokens accepted (a prefix of each row's drafts)
    next_token: Tensor  # [B] the token emitted after them (residual sample at a rejection, or bonus)


@dataclass
class TreeResult:
    path: list[list[int]]  # per row: accepted node indices, root (0) first; the last one produced next_token
    next_token: Tensor  # [B]

    @property
    def num_accepted(self) -> Tensor:
        return torch.tensor([len(p) - 1 for p in self.path], device=self.next_token.device)


def _draft_mask(num_drafted: Tensor | None, B: int, k: int, device) -> Tensor:
    """[B, k] True where a draft exists (rows may draft fewer than k tokens)."""
    if num_drafted is None:
        return torch.ones(B, k, dtype=torch.bool, device=device)
    return torch.arange(k, device=device)[None, :] < num_drafted[:, None]


def _prefix_length(ok: Tensor) -> Tensor:
    """[B, k] bool -> [B] length of the all-True prefix of each row."""
    return ok.long().cumprod(-1).sum(-1)


def rejection_sample(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    num_drafted: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> ChainResult:
    """Speculative sampling for a batch of drafted chains.

    draft_tokens [B, k]; target_probs [B, k+1, V] (p_j: the target's distribution of the token after
    draft j-1, p_k for the bonus); draft_probs [B, k, V] (q_j, the draft's distribution x_j was sampled
    from) or None for deterministic drafts (q_j = one-hot(x_j)); num_drafted [B] (<= k) drafts per row.
    """
    B, k = draft_tokens.shape
    device = target_probs.device
    p = target_probs.float()
    drafted = _draft_mask(num_drafted, B, k, device)
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_draft = (
        torch.ones_like(p_draft)
        if draft_probs is None
        else draft_probs.float().gather(-1, draft_tokens[..., None]).squeeze(-1)
    )
    u = torch.rand(B, k, generator=generator, device=device)
    accept = (u * q_draft < p_draft) & drafted  # u < p/q without dividing by q
    n = _prefix_length(accept)  # [B]
    rows = torch.arange(B, device=device)
    p_next = p[rows, n]  # [B, V]
    rejected = n < (k if num_drafted is None else num_drafted)  # a real rejection (not out of drafts)
    j = n.clamp(max=k - 1) if k > 0 else n
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        if k > 0:
            q_next.scatter_(-1, draft_tokens[rows, j][:, None], 1.0)
    else:
        q_next = draft_probs.float()[rows, j]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q at a rejection has probability 0; guard the rounding case by falling back to p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    dist = torch.where(rejected[:, None], residual, p_next)
    next_token = sample(dist, generator)
    return ChainResult(num_accepted=n, next_token=next_token)


def greedy_verify(draft_tokens: Tensor, target_argmax: Tensor, num_drafted: Tensor | None = None) -> ChainResult:
    """p = one-hot: accept the longest prefix equal to the target's argmax, then emit the target's token.

    draft_tokens [B, k]; target_argmax [B, k+1] (argmax of the target's logits after each prefix)."""
    B, k = draft_tokens.shape
    match = (draft_tokens == target_argmax[:, :k]) & _draft_mask(num_drafted, B, k, draft_tokens.device)
    n = _prefix_length(match)
    return ChainResult(num_accepted=n, next_token=target_argmax[torch.arange(B, device=n.device), n])


def verify_chain(
    draft_tokens: Tensor,
    target_logits: Tensor,
    params: SamplingParams,
    draft_probs: Tensor | None = None,
    num_drafted: Tensor | None = None,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
) -> ChainResult:
    """Lossless verification from the target's logits [B, k+1, V] under ``params`` (the one sampler); mask
    [B, k+1, V] (a grammar's allowed tokens at each position) applies to the target's distributions."""
    if params.greedy and mask is None:
        return greedy_verify(draft_tokens, argmax(target_logits), num_drafted)
    target_probs = logits_to_probs(target_logits, params, mask)
    if params.greedy:  # one-hot on the allowed argmax
        return greedy_verify(draft_tokens, argmax(target_probs), num_drafted)
    return rejection_sample(draft_tokens, target_probs, draft_probs, num_drafted, generator)


# ---- trees of deterministic candidates ----------------------------------------------------------------


def tree_rejection_sample(
    tree: CandidateTree, node_tokens: Tensor, target_probs: Tensor, generator: torch.Generator | None = None
) -> TreeResult:
    """Multi-candidate rejection sampling down a tree of deterministic candidates, batched over rows.

    node_tokens [B, N] (node 0 = root); target_probs [B, N, V]: the target's distribution of the token
    after each node's path. At the current node one token x is drawn from p_node; if a child holds x the
    walk descends into it (the first such child), otherwise x is emitted (at a leaf it is the bonus token).

    This is SpecInfer's multi-candidate rule for one-hot drafts, child c accepted with probability
    r(c) / sum(r) where r is p_node with the rejected elder siblings removed: P(descend into c) = p_node(c)
    and, given no child was taken, x follows p_node restricted to the non-children, normalised, which is
    the final residual. So every emitted token (and every accepted one) is an exact draw of the target's
    distribution after the path before it. Drawing it first makes each row use exactly one draw of its
    generator per committed token, whatever the tree's shape: a row's sampled tokens are those of plain
    sampling with the same generator (up to the logits' float noise), and never depend on a tree that
    its batch mates helped to shape (EAGLE's dynamic trees).
    """
    B, N = node_tokens.shape
    device = target_probs.device
    children = tree.padded_children(device)  # [N, C]
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    paths = [[0] for _ in range(B)]
    for _ in range(tree.max_depth + 1):
        if not bool(active.any()):
            break
        drawn = torch.zeros(B, dtype=torch.long, device=device)  # one draw per active row and depth
        drawn[active] = sample(target_probs[rows[active], cur[active]].float(), generator)
        kids = children[cur]  # [B, C]
        hit = (kids >= 0) & (node_tokens[rows[:, None], kids.clamp(min=0)] == drawn[:, None])  # [B, C]
        moved = active & hit.any(-1)
        child = kids[rows, hit.long().argmax(-1)]  # the first child holding the drawn token
        next_token = torch.where(active & ~moved, drawn, next_token)
        for b in torch.nonzero(moved).flatten().tolist():
            paths[b].append(int(child[b]))
        cur = torch.where(moved, child, cur)
        active = moved
    return TreeResult(path=paths, next_token=next_token)


def tree_greedy_verify(tree: CandidateTree, node_tokens: Tensor, target_argmax: Tensor) -> TreeResult:
    """p = one-hot: follow the child equal to the target's argmax while one exists.

    node_tokens [B, N]; target_argmax [B, N]."""
    B = node_tokens.shape[0]
    toks, top = node_tokens.tolist(), target_argmax.tolist()
    paths = []
    for b in range(B):
        path = [0]
        while True:
            nxt = next((c for c in tree.children[path[-1]] if toks[b][c] == top[b][path[-1]]), None)
            if nxt is None:
                break
            path.append(nxt)
        paths.append(path)
    next_token = torch.tensor([top[b][p[-1]] for b, p in enumerate(paths)], device=node_tokens.device)
    return TreeResult(path=paths, next_token=next_token)


def verify_tree(
    tree: CandidateTree,
    node_tokens: Tensor,
    target_logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
) -> TreeResult:
    """Lossless tree verification from the target's logits [B, N, V] under ``params`` (mask [B, N, V]: the
    allowed tokens after each node, as in verify_chain)."""
    probs = None if params.greedy and mask is None else logits_to_probs(target_logits, params, mask)
    if params.greedy:
        return tree_greedy_verify(tree, node_tokens, argmax(target_logits if probs is None else probs))
    return tree_rejection_sample(tree, node_tokens, probs, generator)


# ---- approximate: Medusa typical acceptance -----------------------------------------------------------


def typical_threshold(probs: Tensor, epsilon: float, delta: float) -> Tensor:
    """[..., V] -> [...]: min(epsilon, delta * exp(-entropy)) (Medusa, Cai et al. 2024, sec. 3.3.1)."""
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def typical_accept_chain(
    draft_tokens: Tensor,
    target_probs: Tensor,
    epsilon: float = 0.09,
    delta: float = 0.3,
    num_drafted: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> ChainResult:
    """APPROXIMATE: keep drafts whose target probability clears the typical threshold; the next token is
    a sample of p after the kept prefix. Does not preserve the target's distribution."""
    B, k = draft_tokens.shape
    p = target_probs.float()
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    ok = (p_draft > typical_threshold(p[:, :k], epsilon, delta)) & _draft_mask(num_drafted, B, k, p.device)
    n = _prefix_length(ok)
    p_next = p[torch.arange(B, device=p.device), n]
    return ChainResult(num_accepted=n, next_token=sample(p_next, generator))


def typical_accept_tree(
    tree: CandidateTree,
    node_tokens: Tensor,
    target_probs: Tensor,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> TreeResult:
    """APPROXIMATE: the deepest tree node whose whole path clears the typical threshold (first in node
    order among equals); the next token is a sample of p at that node."""
    B, N = node_tokens.shape
    p = target_probs.float()
    thresh = typical_threshold(p, epsilon, delta)  # [B, N]
    parents = torch.tensor(tree.parents[1:], device=p.device)
    node_ok = torch.ones(B, N, dtype=torch.bool, device=p.device)
    node_ok[:, 1:] = p[:, parents].gather(-1, node_tokens[:, 1:, None]).squeeze(-1) > thresh[:, parents]
    path_ok = node_ok.clone()
    for i in range(1, N):  # topological order: a node's path is ok if its parent's is
        path_ok[:, i] &= path_ok[:, tree.parents[i]]
    depth = torch.tensor(tree.depth, device=p.device)
    score = torch.where(
        path_ok, depth * N - torch.arange(N, device=p.device), torch.full_like(path_ok, -1, dtype=torch.long)
    )
    best = score.argmax(-1).tolist()
    paths = []
    for b in range(B):
        path, node = [], best[b]
        while node != -1:
            path.append(node)
            node = tree.parents[node]
        paths.append(path[::-1])
    p_end = p[torch.arange(B, device=p.device), torch.tensor(best, device=p.device)]
    return TreeResult(path=paths, next_token=sample(p_end, generator))
