"""The speculative generation loop, batched: every step one target forward verifies each row's proposal
(a chain of drafts or a candidate tree) and each row commits its own number of tokens.

KV-cache bookkeeping: a row with L committed tokens has target KV for positions 0..L-2; its last token is
fed again as the first input of the next step. Chain drafts are written at slots L-1..L-1+k; the slots of
rejected drafts are simply overwritten by the next step's writes (which always start at the new L-1), and
attention is causal by position, so no query ever reads a stale slot. Tree nodes are written at unique
slots L-1+i with rope position L-1+depth(i); the accepted path is then moved to consecutive slots with
``KVCache.move``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from runtime.generate import StopChecker, prefill_meta, row_constraints
from runtime.grammar import Grammar, chain_masks, row_masks
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, Transformer
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample
from speculate.base import Proposal, SpecState, Speculator
from speculate.verify import (
    CandidateTree,
    ChainResult,
    TreeResult,
    typical_accept_chain,
    typical_accept_tree,
    verify_chain,
    verify_tree,
)


@dataclass
class SpecStats:
    steps: int = 0  # target forwards in the decode loop (one per step, shared by the batch)
    row_steps: int = 0  # sum over rows of the steps each row was active in
    drafted: int = 0  # draft positions offered (chain: drafts; tree: depth of the tree) over active rows
    accepted: int = 0  # drafted tokens accepted
    generated: int = 0  # tokens committed (all rows, the prefill's first token included)
    rows: int = 0
    proposed_at: list[int] = field(default_factory=list)  # [depth] rows offering a draft at depth j
    accepted_at: list[int] = field(default_factory=list)  # [depth] rows accepting a draft at depth j

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft j accepted | draft j offered); chain position or tree depth j (conditional on reaching j-1
        is not applied: this is the unconditional rate of accepting at least j+1 drafts)."""
        return [a / max(p, 1) for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def mean_accepted_per_step(self) -> float:
        return self.accepted / max(self.row_steps, 1)

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens committed per target forward per row in the decode loop (accepted drafts + 1)."""
        return (self.generated - self.rows) / max(self.row_steps, 1)

    @property
    def target_forwards_per_token(self) -> float:
        """(prefill + decode forwards) per committed token, per row."""
        return (self.row_steps + self.rows) / max(self.generated, 1)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "mean_accepted_per_step": self.mean_accepted_per_step,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "target_forwards_per_token": self.target_forwards_per_token,
        }

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (
            f"acceptance {self.acceptance_rate:.3f} (per position: {per_pos}), "
            f"{self.mean_accepted_per_step:.2f} accepted + 1 per step = {self.mean_tokens_per_step:.2f} tokens/step, "
            f"{self.target_forwards_per_token:.3f} target forwards per token ({self.steps} steps)"
        )


@dataclass
class SpecOutput:
    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: SpecStats
    ttft_s: float = 0.0
    decode_s: float = 0.0  # wall time of the speculative loop (after the first token)
    speculator: dict = field(default_factory=dict)
    grammar_incomplete: list[bool] = field(default_factory=list)  # as GenerationOutput.grammar_incomplete


def _record(stats: SpecStats, depth: int, offered: int, accepted: int) -> None:
    while len(stats.proposed_at) < depth:
        stats.proposed_at.append(0)
        stats.accepted_at.append(0)
    for j in range(offered):
        stats.proposed_at[j] += 1
        stats.accepted_at[j] += int(accepted > j)
    stats.drafted += offered
    stats.accepted += accepted


def tree_metadata(tree: CandidateTree, lengths: Tensor) -> AttentionMetadata:
    """Tree forward: node i at rope position L-1+depth(i), cache slot L-1+i; it attends to the row's
    committed prefix (slots < L-1) and to its ancestors and itself."""
    device = lengths.device
    N = len(tree)
    base = (lengths - 1)[:, None]  # [B, 1]
    positions = base + torch.tensor(tree.depth, device=device)[None]  # [B, N]
    slots = base + torch.arange(N, device=device)[None]  # [B, N]
    kv_len = int(slots.max()) + 1
    rel = torch.arange(kv_len, device=device)[None, :] - base  # [B, S]: key slot relative to the root
    in_tree = (rel >= 0) & (rel < N)
    ancestors = tree.ancestor_mask(device)  # [N, N]
    tree_part = ancestors[:, rel.clamp(0, N - 1)].permute(1, 0, 2) & in_tree[:, None, :]  # [B, N, S]
    mask = (rel < 0)[:, None, :] | tree_part
    return AttentionMetadata(positions=positions, slots=slots, mask=mask[:, None], kv_len=kv_len)


def chain_metadata(lengths: Tensor, T: int) -> AttentionMetadata:
    if bool((lengths == lengths[0]).all()):
        return AttentionMetadata.contiguous(lengths.shape[0], int(lengths[0]) - 1, T, lengths.device)
    positions = (lengths - 1)[:, None] + torch.arange(T, device=lengths.device)[None]  # [B, T]
    return AttentionMetadata.causal(positions, kv_len=int(positions.max()) + 1)


@torch.inference_mode()
def speculative_generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    speculator: Speculator,
    tokenizer=None,
    grammar: Grammar | list[Grammar | None] | None = None,
) -> SpecOutput:
    """Generate for a batch of token-id prompts with ``speculator`` proposing and the one verifier deciding.

    One SamplingParams for the batch; one seeded generator drives every draw of the batch (draft samples,
    acceptance tests, residual and bonus samples). grammar (one, or one per row): the target's distribution
    at every position is masked by the row's grammar state after the committed tokens and the drafts before
    it, so the output has the distribution of constrained plain sampling."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    B = len(prompts)
    device = model.norm.weight.device  # not embed_tokens: a quantized one dequantizes its whole table for .weight
    dtype = model.layers[0].input_layernorm.weight.dtype
    cfg = model.config
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    headroom = speculator.max_tokens_per_step() + 1
    capacity = int(lengths.max()) + params.max_tokens + headroom
    if int(lengths.max()) + params.max_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt + max_tokens = {int(lengths.max()) + params.max_tokens} exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    generator = make_generator(params.seed, device)
    stops = [StopChecker(params, cfg.eos_token_ids, tokenizer) for _ in range(B)]
    constraints = row_constraints(grammar, B, cfg.vocab_size, [params] * B)
    tokens = torch.zeros(B, capacity, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    cache = KVCache(cfg, B, capacity, dtype, device)
    out = SpecOutput(tokens=[[] for _ in range(B)], finish_reasons=[""] * B, stats=SpecStats(rows=B))
    stats = out.stats
    active = torch.ones(B, dtype=torch.bool, device=device)
    rows = torch.arange(B, device=device)

    def commit(b: int, new: list[int]) -> None:
        """Append tokens to row b up to its first stop condition."""
        start = int(lengths[b])
        for i, tok in enumerate(new):
            out.tokens[b].append(tok)
            if constraints[b] is not None and not constraints[b].accept(tok):
                raise RuntimeError(f"row {b}: committed token {tok} that its grammar does not allow")
            tokens[b, start + i] = tok
            lengths[b] += 1
            stats.generated += 1
            reason = stops[b].check(out.tokens[b])
            if reason is not None:
                out.finish_reasons[b] = reason
                active[b] = False
                return

    t0 = time.perf_counter()
    T = int(lengths.max())
    hidden = model(tokens[:, :T], prefill_meta(B, T, device), cache, hidden_only=True)
    last_hidden = hidden[rows, lengths - 1]  # [B, H]
    probs = logits_to_probs(model.logits(last_hidden), params, row_masks(constraints, cfg.vocab_size, device))
    first = probs.argmax(-1) if params.greedy else sample(probs, generator)
    for b in range(B):
        commit(b, [int(first[b])])
    out.ttft_s = time.perf_counter() - t0
    state = SpecState(tokens, lengths, last_hidden, active, params, generator)
    state.constraints = None if all(c is None for c in constraints) else constraints
    speculator.start(state)

    t1 = time.perf_counter()
    while bool(active.any()):
        proposal: Proposal = speculator.propose(state)
        if proposal.tree is None:
            accepted, next_token, last_hidden = _chain_step(model, cache, state, proposal, speculator.acceptance)
            offered = proposal.num_drafted if proposal.num_drafted is not None else None
            k = proposal.tokens.shape[1]
            offered = [k] * B if offered is None else offered.tolist()
            drafts = proposal.tokens.tolist()
            new_rows = [drafts[b][: accepted[b]] for b in range(B)]
        else:
            result, last_hidden = _tree_step(model, cache, state, proposal, speculator.acceptance)
            next_token = result.next_token
            accepted = [len(p) - 1 for p in result.path]
            offered = [proposal.tree.max_depth] * B
            node_tokens = proposal.tokens.tolist()
            new_rows = [[node_tokens[b][i] for i in result.path[b][1:]] for b in range(B)]
        stats.steps += 1
        next_list = next_token.tolist()
        for b in range(B):
            if not bool(active[b]):
                continue
            stats.row_steps += 1
            _record(stats, max(offered), offered[b], accepted[b])
            commit(b, new_rows[b] + [next_list[b]])
        state.hidden = last_hidden
    out.decode_s = time.perf_counter() - t1
    out.speculator = speculator.describe()
    out.grammar_incomplete = [c is not None and not c.complete for c in constraints]
    return out


def _chain_target_masks(state: SpecState, drafts: Tensor, num: Tensor | None, deterministic: bool):
    """Grammar masks [B, w+1, V] for the target after each prefix of each row's drafts, and the drafts each
    row keeps [B] (deterministic drafts are cut at the first one the grammar rejects; see chain_masks)."""
    B, w = drafts.shape
    V = next(c for c in state.constraints if c is not None).grammar.vocab_size
    masks = torch.ones(B, w + 1, V, dtype=torch.bool)
    counts = [w] * B if num is None else num.tolist()
    rows = drafts.tolist()
    for b, c in enumerate(state.constraints):
        if c is None or not bool(state.active[b]):
            continue
        m, counts[b] = chain_masks(c, rows[b][: counts[b]], deterministic)
        masks[b, : m.shape[0]] = m
    return masks.to(drafts.device), torch.tensor(counts, device=drafts.device)


def _tree_target_masks(state: SpecState, tree: CandidateTree, node_tokens: Tensor) -> Tensor:
    """Grammar masks [B, N, V] after each tree node's path (all-True below a node the grammar rejects: the
    target gives that node probability 0, so nothing under it is ever accepted)."""
    B, N = node_tokens.shape
    V = next(c for c in state.constraints if c is not None).grammar.vocab_size
    masks = torch.ones(B, N, V, dtype=torch.bool)
    toks = node_tokens.tolist()
    paths = []
    for i in range(N):
        path, node = [], i
        while node != 0:
            path.append(node)
            node = tree.parents[node]
        paths.append(path[::-1])
    for b, c in enumerate(state.constraints):
        if c is None or not bool(state.active[b]):
            continue
        for i, path in enumerate(paths):
            advanced = 0
            for node in path:
                if not c.accept(toks[b][node]):
                    break
                advanced += 1
            if advanced == len(path):
                masks[b, i] = c.mask()
            c.rollback(advanced)
    return masks.to(node_tokens.device)


def _chain_step(model, cache, state: SpecState, proposal: Proposal, acceptance: str):
    B = state.tokens.shape[0]
    rows = torch.arange(B, device=state.tokens.device)
    num = proposal.num_drafted
    k = proposal.tokens.shape[1]
    width = k if num is None else int((num * state.active).max())
    drafts = proposal.tokens[:, :width]
    q = None if proposal.draft_probs is None else proposal.draft_probs[:, :width]
    num = None if num is None else num.clamp(max=width) * state.active
    masks = None
    if state.constraints is not None:
        if proposal.masks is not None:  # the draft masked its own distributions along the same prefixes
            masks = proposal.masks[:, : width + 1]
        else:
            masks, num = _chain_target_masks(state, drafts, num, deterministic=q is None)
            num = num * state.active
    feed = torch.cat([state.tokens[rows, state.lengths - 1][:, None], drafts], 1)  # [B, width + 1]
    hidden = model(feed, chain_metadata(state.lengths, width + 1), cache, hidden_only=True)
    logits = model.logits(hidden)  # [B, width + 1, V]
    if acceptance == "typical" and not state.params.greedy:
        res: ChainResult = typical_accept_chain(
            drafts, logits_to_probs(logits, state.params, masks), num_drafted=num, generator=state.generator
        )
    else:
        res = verify_chain(drafts, logits, state.params, q, num, state.generator, mask=masks)
    n = res.num_accepted
    return n.tolist(), res.next_token, hidden[rows, n]


def _tree_step(model, cache: KVCache, state: SpecState, proposal: Proposal, acceptance: str):
    tree = proposal.tree
    B = state.tokens.shape[0]
    hidden = model(proposal.tokens, tree_metadata(tree, state.lengths), cache, hidden_only=True)  # [B, N, H]
    logits = model.logits(hidden)
    masks = None if state.constraints is None else _tree_target_masks(state, tree, proposal.tokens)
    if acceptance == "typical" and not state.params.greedy:
        res: TreeResult = typical_accept_tree(
            tree, proposal.tokens, logits_to_probs(logits, state.params, masks), generator=state.generator
        )
    else:
        res = verify_tree(tree, proposal.tokens, logits, state.params, state.generator, mask=masks)
    for b in range(B):
        path = res.path[b]
        if len(path) > 1:  # accepted nodes' k/v to consecutive slots after the root
            base = int(state.lengths[b]) - 1
            cache.move(b, torch.tensor(path[1:], device=cache.k.device) + base, base + 1)
    last = torch.tensor([p[-1] for p in res.path], device=hidden.device)
    return res, hidden[torch.arange(B, device=hidden.device), last]
