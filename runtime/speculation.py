"""The speculation contract: what a speculator sees, what it proposes, and what verification returns.

Every generation loop that speculates (``speculate.generate``'s static batch, the serving engine's
continuous batch) runs the same step per sequence:

    proposal = speculator.propose(state)             # chain drafts (+ their q) or a candidate tree
    proposal = proposal.within(budgets)              # no drafts past a row's max_tokens
    logits = target(last committed token + drafts)   # one forward (tree: a tree attention mask)
    verdict = speculator.verify(state, proposal, logits)   # the one verifier (speculate.verify), per row

and commits ``verdict.tokens[b]``. Implementations live in ``speculate/`` (their ``verify`` delegates to
``speculate.verify``); this module is the lowest layer and imports none of them.

Sequences are identified by ``SpecState.ids`` (the engine's request ids; a loop's own row keys), so a
speculator with per-sequence state (a draft model's KV cache) keys it by id, builds it lazily (or in
``prefill(state)``, which the static loop calls after the target's prefill so that cost counts as prefill), and
frees it on ``release(ids)``, which the loop calls when a sequence finishes or is aborted.

Randomness: every row draws only from its own generator (``SpecState.generators``) under its own
SamplingParams, always in the same order (draft samples, then acceptance tests, then the residual or
bonus sample), so a request's sampled tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from runtime.sampling import SamplingParams


@dataclass
class CandidateTree:
    """A static tree of candidate slots, node 0 = root (the last committed token, not yet in the cache).

    Nodes are in topological order (parents before children); siblings are tried in index order, so
    put the most likely candidate first. ``choices[i]`` is the path of candidate ranks from the root
    (Medusa's notation: node (0, 1) = head-1's top candidate, then head-2's second candidate).
    """

    parents: list[int]  # [N], parents[0] = -1
    choices: list[tuple[int, ...]]  # [N], choices[0] = ()

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a candidate tree needs a root (node 0) with parent -1")
        for i, par in enumerate(self.parents[1:], 1):
            if not 0 <= par < i:
                raise ValueError(f"node {i}'s parent {par} must be an earlier node")
        self.depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            self.depth[i] = self.depth[self.parents[i]] + 1
        self.children = [[] for _ in self.parents]
        for i, par in enumerate(self.parents[1:], 1):
            self.children[par].append(i)

    @classmethod
    def from_choices(cls, choices: list[tuple[int, ...]] | list[list[int]]) -> CandidateTree:
        """Build from rank paths (any order); missing prefixes are an error."""
        paths = sorted({tuple(c) for c in choices if len(c) > 0}, key=lambda c: (len(c), c))
        index = {(): 0}
        parents = [-1]
        for path in paths:
            if path[:-1] not in index:
                raise ValueError(f"tree choice {list(path)} has no parent {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
        return cls(parents=parents, choices=[(), *paths])

    @classmethod
    def chain(cls, k: int) -> CandidateTree:
        return cls.from_choices([(0,) * d for d in range(1, k + 1)])

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def ancestor_mask(self, device=None) -> Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        N = len(self)
        mask = torch.eye(N, dtype=torch.bool, device=device)
        for i in range(1, N):
            mask[i] |= mask[self.parents[i]]
        return mask

    def padded_children(self, device=None) -> Tensor:
        """[N, C] child indices per node, -1 padded (C = the widest node's child count, >= 1)."""
        width = max(1, max(len(c) for c in self.children))
        out = torch.full((len(self), width), -1, dtype=torch.long, device=device)
        for i, ch in enumerate(self.children):
            out[i, : len(ch)] = torch.tensor(ch, dtype=torch.long)
        return out


@dataclass
class SpecState:
    """What a speculator sees at a step, for the B sequences that speculate in it (read-only)."""

    ids: list[Hashable]  # [B] sequence identities: the key of any per-sequence speculator state
    token_ids: list[list[int]]  # [B] committed tokens (prompt + generated); the last one is not yet in the target's KV
    hidden: Tensor | None  # [B, H] the target's final-norm hidden state that produced each row's last token
    params: list[SamplingParams]  # [B] each row's own sampling parameters
    generators: list[torch.Generator]  # [B] each row's own generator (every draw of the row uses it)
    device: torch.device | str = "cpu"  # the target's device (proposal tensors live there)
    # [B] each row's grammar matcher (runtime.grammar.TokenConstraint) or None; None: no row is constrained.
    # Positioned after the committed tokens; a speculator may advance one through its drafts but rolls it back.
    constraints: list | None = None

    def __post_init__(self):
        B = len(self.ids)
        if not (len(self.token_ids) == len(self.params) == len(self.generators) == B):
            raise ValueError("SpecState needs one token list, SamplingParams and generator per sequence id")

    def row(self, b: int) -> SpecState:
        """Sequence b alone (a batch of one)."""
        return self.select([b])

    def select(self, rows: list[int]) -> SpecState:
        """The sequences at these rows, in this order."""
        hidden = None if self.hidden is None else self.hidden[rows]
        constraints = None if self.constraints is None else [self.constraints[b] for b in rows]
        return SpecState(
            [self.ids[b] for b in rows],
            [self.token_ids[b] for b in rows],
            hidden,
            [self.params[b] for b in rows],
            [self.generators[b] for b in rows],
            self.device,
            constraints,
        )


@dataclass
class Proposal:
    """Chain: tokens [B, k] drafts following each row's last committed token; num_drafted [B] <= k valid
    drafts per row (None: all k); draft_probs [B, k, V] the distributions q the drafts were sampled from
    (None: deterministic drafts, q = one-hot).
    Tree: tokens [B, N] one token per tree node, node 0 = each row's last committed token; num_drafted [B]
    is N - 1 where the row offers the tree and 0 where it offers nothing this step (None: all offer).
    masks [B, k+1, V]: under a grammar, the allowed tokens after each prefix of a chain, when the speculator
    computed them already (a draft model masks its own distributions); None: verification computes them."""

    tokens: Tensor
    num_drafted: Tensor | None = None
    draft_probs: Tensor | None = None
    tree: CandidateTree | None = None
    masks: Tensor | None = None

    def row(self, b: int) -> Proposal:
        """Row b alone (a batch of one)."""

        def one(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[b : b + 1]

        return replace(
            self,
            tokens=one(self.tokens),
            num_drafted=one(self.num_drafted),
            draft_probs=one(self.draft_probs),
            masks=one(self.masks),
        )

    def drafted(self) -> list[int]:
        """Drafts (chain) or non-root nodes (tree) each row offers."""
        B, width = self.tokens.shape
        full = width - 1 if self.tree is not None else width
        return [full] * B if self.num_drafted is None else self.num_drafted.tolist()

    def within(self, budgets: list[int]) -> Proposal:
        """Cut each row's offer to its budget: at most budgets[b] drafted tokens may still be committed
        before the row's token limit (its max_tokens, minus the token that verification always emits). A
        chain is cut to the budget; a tree deeper than the budget is withdrawn for that row (the row then
        takes one plain step). Every loop applies the same cut, so a request's draws never depend on it."""
        offered = self.drafted()
        if self.tree is None:
            num = [max(0, min(n, b)) for n, b in zip(offered, budgets)]
        else:
            num = [n if self.tree.max_depth <= b else 0 for n, b in zip(offered, budgets)]
        return replace(self, num_drafted=torch.tensor(num, dtype=torch.long, device=self.tokens.device))

    def fed(self) -> list[int]:
        """Tokens each row feeds the target in the verification forward: its last committed token plus its
        drafts (chain), or the whole tree (N; 1 where the row withdrew it)."""
        if self.tree is None:
            return [1 + n for n in self.drafted()]
        return [len(self.tree) if n > 0 else 1 for n in self.drafted()]


@dataclass
class Verdict:
    """What verification decided, per row of the proposal."""

    tokens: list[list[int]]  # [B] accepted drafts followed by the one corrected or bonus token
    last: list[int]  # [B] index (in the verification forward) whose hidden state produced the last token
    paths: list[list[int]]  # [B] accepted positions of the forward, root (0) first; a chain's are 0..n
    offered: list[int]  # [B] draft positions offered (chain: drafts; tree: depth, 0 if withdrawn)

    @property
    def num_accepted(self) -> list[int]:
        return [len(t) - 1 for t in self.tokens]


class Speculator(Protocol):
    """What a generation loop needs from a speculator (implementations: speculate/)."""

    name: str
    acceptance: str  # "rejection": lossless (greedy when temperature 0); "typical": Medusa's, APPROXIMATE

    def max_tokens_per_step(self) -> int:
        """Upper bound on the tokens fed to the target per step, the last committed token included."""
        ...

    def propose(self, state: SpecState) -> Proposal: ...

    def verify(self, state: SpecState, proposal: Proposal, target_logits: Tensor) -> Verdict:
        """target_logits [B, T >= max(proposal.fed()), V]: the target's logits at each fed position (chain: after
        the last committed token and each draft; tree: after each node's path)."""
        ...

    def prefill(self, state: SpecState) -> None:
        """Build these sequences' own state before their first proposal (a draft model's KV of the prompt), so a
        loop can count it in the prefill phase as a serving system does; propose() works without it (lazily)."""
        ...

    def release(self, ids: list[Hashable]) -> None:
        """Forget the per-sequence state of these ids (finished, aborted, or the loop ended)."""
        ...

    def describe(self) -> dict: ...


def draft_budget(generated: int, max_tokens: int) -> int:
    """Drafted tokens a row may still commit: all but the one token verification always emits."""
    return max(0, max_tokens - generated - 1)
