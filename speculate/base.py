"""The speculator interface: given the committed tokens, propose a chain of k drafts (with or without the
draft's probabilities) or a tree of candidates. The loop in ``speculate.generate`` verifies every proposal
with the one verifier (``speculate.verify``) in one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.sampling import SamplingParams
from speculate.verify import CandidateTree


class SpeculatorError(ValueError):
    """A speculator that cannot run with this target or these settings."""


@dataclass
class SpecState:
    """What a speculator sees at each step (owned by the generation loop; read-only for speculators)."""

    tokens: Tensor  # [B, capacity] committed tokens per row (prompt + generated), right-padded
    lengths: Tensor  # [B] committed tokens; the last one is not yet in the target's KV cache
    hidden: Tensor  # [B, H] target's final-norm hidden state that produced each row's last token
    active: Tensor  # [B] bool: rows still generating
    params: SamplingParams
    generator: torch.Generator
    # per row: its grammar matcher (runtime.grammar.TokenConstraint) or None; None: no row is constrained.
    # Positioned after the committed tokens; a speculator may advance it through its drafts but must roll back.
    constraints: list | None = None


@dataclass
class Proposal:
    """Chain: tokens [B, k] drafts following each row's last committed token, num_drafted [B] <= k valid
    drafts per row (None: all k), draft_probs [B, k, V] the draft distributions q the drafts were sampled
    from (None: deterministic drafts, q = one-hot).
    Tree: tokens [B, N] one token per tree node, node 0 = each row's last committed token.
    masks [B, k+1, V]: under a grammar, the allowed tokens after each prefix of the drafts, when the speculator
    computed them already (a draft model masks its own distributions); None: the loop computes them."""

    tokens: Tensor
    num_drafted: Tensor | None = None
    draft_probs: Tensor | None = None
    tree: CandidateTree | None = None
    masks: Tensor | None = None


class Speculator:
    name = "speculator"
    # "rejection": the lossless verifier (greedy when temperature 0). "typical": Medusa typical acceptance,
    # APPROXIMATE (the output distribution is not the target's).
    acceptance = "rejection"

    @property
    def lossless(self) -> bool:
        return self.acceptance == "rejection"

    def max_tokens_per_step(self) -> int:
        """Upper bound on tokens fed to the target per step (sizes the KV cache headroom)."""
        raise NotImplementedError

    def start(self, state: SpecState) -> None:
        """Called once after the target's prefill (state.lengths = prompt lengths + 1)."""

    def propose(self, state: SpecState) -> Proposal:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "acceptance": self.acceptance, "lossless": self.lossless}


def check_k(k: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise SpeculatorError(f"the number of speculative tokens k must be an integer >= 1, got {k!r}")
    return k
