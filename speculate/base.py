"""The base of every speculator: the contract of ``runtime.speculation`` (propose a chain of k drafts, with or
without the draft's probabilities, or a tree of candidates) plus the verification every loop calls, which
runs the one verifier (``speculate.verify``) row by row with each row's own SamplingParams and generator.
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import Tensor

from runtime.grammar import chain_masks, mask_logits, tree_masks
from runtime.sampling import logits_to_probs
from runtime.speculation import Proposal, SpecState, Verdict
from speculate.verify import typical_accept_chain, typical_accept_tree, verify_chain, verify_tree

__all__ = ["Proposal", "SpecState", "Speculator", "SpeculatorError", "Verdict", "check_k"]


class SpeculatorError(ValueError):
    """A speculator that cannot run with this target or these settings."""


class Speculator:
    """Implements runtime.speculation.Speculator; subclasses define max_tokens_per_step and propose."""

    name = "speculator"
    # "rejection": the lossless verifier (greedy when temperature 0). "typical": Medusa typical acceptance,
    # APPROXIMATE (the output distribution is not the target's).
    acceptance = "rejection"
    # a tree speculator's proposals are withdrawn (not cut) where a row has fewer tokens left than the tree is
    # deep (runtime.speculation.Proposal.within): a run that must see its trees verified needs draft_depth() left
    proposes_trees = False

    @property
    def lossless(self) -> bool:
        return self.acceptance == "rejection"

    def max_tokens_per_step(self) -> int:
        """Upper bound on tokens fed to the target per step (sizes the KV cache headroom)."""
        raise NotImplementedError

    def draft_depth(self) -> int:
        """The most draft positions one proposal offers past the last committed token (a chain's k, a tree's depth)."""
        return self.max_tokens_per_step() - 1

    def propose(self, state: SpecState) -> Proposal:
        raise NotImplementedError

    def prefill(self, state: SpecState) -> None:
        """Per-sequence state to build before the first proposal (none here; the draft model prefills its KV)."""

    def release(self, ids: list[Hashable]) -> None:
        """Per-sequence state to forget (none here; the draft model keeps a KV cache per sequence)."""

    def verify(self, state: SpecState, proposal: Proposal, target_logits: Tensor) -> Verdict:
        """Each row on its own (so its draws come from its own generator, in the same order in every loop):
        greedy / rejection sampling of its drafts or tree, or typical acceptance where configured. Under a
        grammar (state.constraints) the target's logits at each position are masked by the row's grammar
        state after the drafts before it, so the output is distributed as constrained plain sampling."""
        offered = proposal.drafted()
        tree = proposal.tree
        verdict = Verdict(tokens=[], last=[], paths=[], offered=[])
        for b, (params, gen) in enumerate(zip(state.params, state.generators)):
            typical = self.acceptance == "typical" and not params.greedy
            constraint = None if state.constraints is None else state.constraints[b]
            if tree is not None and offered[b] > 0:
                nodes = proposal.tokens[b : b + 1]  # [1, N]
                logits = target_logits[b : b + 1, : len(tree)]
                if constraint is not None:
                    logits = mask_logits(logits, tree_masks(constraint, nodes[0].tolist(), tree.parents)[None])
                if typical:
                    res = typical_accept_tree(tree, nodes, logits_to_probs(logits, params), generator=gen)
                else:
                    res = verify_tree(tree, nodes, logits, params, gen)
                path = res.path[0]
                accepted = nodes[0, path[1:]].tolist()
                verdict.offered.append(tree.max_depth)
            else:  # a chain, or a row that withdrew its tree (root only: a plain step)
                n = offered[b] if tree is None else 0
                verdict.offered.append(n)
                q = None if proposal.draft_probs is None or n == 0 else proposal.draft_probs[b : b + 1, :n]
                logits = target_logits[b : b + 1, : n + 1]
                if constraint is not None:
                    if proposal.masks is not None:  # the draft masked its own distributions on the same prefixes
                        masks = proposal.masks[b, : n + 1]
                    else:  # deterministic drafts are cut at the first one the grammar refuses (chain_masks)
                        masks, n = chain_masks(constraint, proposal.tokens[b, :n].tolist(), deterministic=q is None)
                        q = None if q is None else q[:, :n]
                    logits = mask_logits(target_logits[b : b + 1, : n + 1], masks[: n + 1][None])
                drafts = proposal.tokens[b : b + 1, :n]  # [1, n]
                if typical:
                    res = typical_accept_chain(drafts, logits_to_probs(logits, params), generator=gen)
                else:
                    res = verify_chain(drafts, logits, params, q, None, gen)
                accepted = drafts[0, : int(res.num_accepted[0])].tolist()
                path = list(range(len(accepted) + 1))
            verdict.tokens.append(accepted + [int(res.next_token[0])])
            verdict.paths.append(path)
            verdict.last.append(path[-1])
        return verdict

    def sources(self) -> dict[str, int]:
        """Counts of this speculator's proposals by where they came from, since it was built (a composite's parts:
        speculate.lookup_first); empty for a single source. Readers take differences."""
        return {}

    def describe(self) -> dict:
        return {"name": self.name, "acceptance": self.acceptance, "lossless": self.lossless}


def check_k(k: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise SpeculatorError(f"the number of speculative tokens k must be an integer >= 1, got {k!r}")
    return k
