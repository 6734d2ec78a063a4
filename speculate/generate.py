"""The speculative generation loop over a static batch: every step one target forward verifies each row's
proposal (a chain of drafts or a candidate tree) and each row commits its own number of tokens. The step
is the contract of ``runtime.speculation`` (propose -> cut to each row's budget -> one forward ->
``speculator.verify``), the same one the serving engine runs, with each row's own SamplingParams and
generator, so a request's sampled tokens are the same here, in the engine, alone or in any batch.

KV-cache bookkeeping: a row with L committed tokens has target KV for positions 0..L-2; its last token is
fed again as the first input of the next step. Chain drafts are written at slots L-1..L-1+k; the slots of
rejected drafts are simply overwritten by the next step's writes (which always start at the new L-1), and
attention is causal by position, so no query ever reads a stale slot. Tree nodes are written at unique
slots L-1+i with rope position L-1+depth(i); the accepted path is then moved to consecutive slots with
``KVCache.move``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from runtime.compiled import CompiledDecoder, bucket, compiled_decoder, resolve_compile
from runtime.grammar import Grammar, mask_logits, row_constraints
from runtime.kv_cache import KVCache
from runtime.kv_policy import KVCacheSpec, chunked_prefill
from runtime.layout import device_of
from runtime.model import AttentionMetadata, Transformer
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample_rows
from runtime.speculation import CandidateTree, Proposal, SpecState, draft_budget
from runtime.stopping import StopChecker
from runtime.timing import LoopClock, LoopTiming
from speculate.base import Speculator


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


def add_counts(totals, stats) -> None:
    """Accumulate one run's speculation counts (steps, row_steps, accepted, drafted and the per-depth
    accepted_at / proposed_at) into ``totals``, any object with those fields (benchmarks' per-cell totals)."""
    totals.steps += stats.steps
    totals.row_steps += stats.row_steps
    totals.accepted += stats.accepted
    totals.drafted += stats.drafted
    for j, (a, n) in enumerate(zip(stats.accepted_at, stats.proposed_at)):
        if j >= len(totals.accepted_at):
            totals.accepted_at.append(0)
            totals.proposed_at.append(0)
        totals.accepted_at[j] += a
        totals.proposed_at[j] += n


@dataclass
class SpecOutput:
    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: SpecStats
    timing: LoopTiming = field(default_factory=LoopTiming)  # TTFT, whole-step times, token arrivals (runtime.timing)
    compile: str = "off"  # what ran the chain verifications: off (eager) | inductor | cudagraphs (runtime.compiled)
    grammar_incomplete: list[bool] = field(default_factory=list)  # as GenerationOutput.grammar_incomplete
    speculator: dict = field(default_factory=dict)
    row_drafted: list[int] = field(default_factory=list)  # [B] draft positions offered to each row (stats.drafted's)
    row_accepted: list[int] = field(default_factory=list)  # [B] drafts each row accepted


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
    return AttentionMetadata(positions=positions, slots=slots, mask=mask[:, None], kv_len=kv_len,
                             starts=(lengths - 1).cpu(), local_mask=ancestors.cpu()[None])  # fmt: skip


def chain_metadata(lengths: Tensor, T: int) -> AttentionMetadata:
    if bool((lengths == lengths[0]).all()):
        return AttentionMetadata.contiguous(lengths.shape[0], int(lengths[0]) - 1, T, lengths.device)
    positions = (lengths - 1)[:, None] + torch.arange(T, device=lengths.device)[None]  # [B, T]
    meta = AttentionMetadata.causal(positions, kv_len=int(positions.max()) + 1)
    meta.starts = (lengths - 1).cpu()
    return meta


@dataclass
class SpecRows:
    """The per-row state of one speculative_generate call: committed tokens, stop checks, grammars, clocks."""

    params: list[SamplingParams]
    generators: list[torch.Generator]
    stops: list[StopChecker]
    constraints: list  # per row: a grammar's constraint or None
    seqs: list[list[int]]  # committed tokens per row, the prompt included
    keys: list[tuple]  # this call's rows, for the speculator
    lengths: Tensor  # [B] committed tokens per row, on the model's device
    out: SpecOutput
    clock: LoopClock
    on_token: Callable[[int, int], None] | None
    active: list[bool]
    token_times: list[list[float]]
    last_hidden: Tensor | None = None  # [B, H] the target's hidden state at each row's last committed token

    def live(self) -> list[int]:
        return [b for b, a in enumerate(self.active) if a]

    def commit(self, b: int, new: list[int]) -> None:
        """Append tokens to row b up to its first stop condition (one device write per row and step)."""
        out, constraint = self.out, self.constraints[b]
        kept = 0
        for tok in new:
            if constraint is not None and not constraint.accept(tok):
                raise RuntimeError(f"row {b}: committed token {tok} that its grammar does not allow")
            out.tokens[b].append(tok)
            self.seqs[b].append(tok)
            kept += 1
            if self.on_token is not None:
                self.on_token(b, tok)
            out.stats.generated += 1
            reason = self.stops[b].check(out.tokens[b])
            if reason is not None:
                out.finish_reasons[b] = reason
                self.active[b] = False
                break
        self.lengths[b] += kept

    def state(self, rows: list[int]) -> SpecState:
        """What the speculator sees of these rows."""
        constrained = any(c is not None for c in self.constraints)
        return SpecState(
            ids=[self.keys[b] for b in rows],
            token_ids=[self.seqs[b] for b in rows],
            hidden=self.last_hidden[rows],
            params=[self.params[b] for b in rows],
            generators=[self.generators[b] for b in rows],
            device=self.lengths.device,
            constraints=[self.constraints[b] for b in rows] if constrained else None,
        )

    def stamp(self) -> None:
        """The step's committed tokens are out: they arrive now (tokens of one step arrive together)."""
        now = self.clock.mark()
        for b, times in enumerate(self.token_times):
            times += [now] * (len(self.out.tokens[b]) - len(times))


def check_rows(model: Transformer, prompts: list[list[int]], params) -> tuple[list[SamplingParams], int]:
    """-> (one SamplingParams per row, the longest prompt + max_tokens); what the static loop cannot run raises."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    B = len(prompts)
    row_params = params if isinstance(params, list) else [params] * B
    if len(row_params) != B:
        raise ValueError(f"{len(row_params)} SamplingParams for {B} prompts")
    if any(sp.adjusts_logits for sp in row_params):
        raise ValueError(
            "penalties, logit_bias and min_tokens apply in plain decoding and the serving engine (runtime.engine, "
            "also with a speculator), not in the static speculative loop"
        )
    positions = model.config.max_position_embeddings
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, row_params))
    if longest > positions:
        raise ValueError(f"prompt + max_tokens = {longest} exceeds the model's {positions} positions")
    return row_params, longest


def prefill_rows(model: Transformer, cache, prompts: list[list[int]], rows: SpecRows) -> None:
    """The target's prefill of every prompt and each row's first token, drawn plainly (as in every loop)."""
    B, device = len(prompts), rows.lengths.device
    T = int(rows.lengths.max())
    tokens = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)
    if B > 1 and type(cache) is KVCache and all(p == prompts[0] for p in prompts):
        # n samples of one prompt (best-of-n, a distribution test): one prefill, each row's cache a copy of it
        hidden = chunked_prefill(model, tokens[:1], cache).expand(B, -1, -1)
        cache.copy_first_row(B, T)
    else:
        hidden = chunked_prefill(model, tokens, cache)
    rows.last_hidden = hidden[torch.arange(B, device=device), rows.lengths - 1]  # [B, H]
    logits = model.logits(rows.last_hidden)
    probs = torch.stack(
        [
            logits_to_probs(mask_logits(logits[b], None if c is None else c.mask()), sp)
            for b, (sp, c) in enumerate(zip(rows.params, rows.constraints))
        ]
    )
    for b, tok in enumerate(sample_rows(probs, rows.params, rows.generators).tolist()):
        rows.commit(b, [tok])


def speculative_step(model: Transformer, cache, speculator: Speculator, rows: SpecRows, decoder) -> None:
    """propose -> cut to each row's budget -> one target forward -> verify -> commit each row's tokens."""
    live, stats, out = rows.live(), rows.out.stats, rows.out
    state = rows.state(live)
    budgets = [draft_budget(len(out.tokens[b]), rows.params[b].max_tokens) for b in live]
    proposal = speculator.propose(state).within(budgets)
    hidden = _verify_forward(model, cache, proposal, live, rows.seqs, rows.lengths, decoder)  # [B, T, H]
    verdict = speculator.verify(state, proposal, model.logits(hidden[live]))
    stats.steps += 1
    depth = max(verdict.offered)
    for i, b in enumerate(live):
        path = verdict.paths[i]
        if path != list(range(len(path))):  # a tree's accepted nodes' k/v to consecutive slots
            base = int(rows.lengths[b]) - 1
            cache.move(b, torch.tensor(path[1:], device=rows.lengths.device) + base, base + 1)
        rows.last_hidden[b] = hidden[b, verdict.last[i]]
        stats.row_steps += 1
        _record(stats, depth, verdict.offered[i], len(verdict.tokens[i]) - 1)
        out.row_drafted[b] += verdict.offered[i]
        out.row_accepted[b] += len(verdict.tokens[i]) - 1
        rows.commit(b, verdict.tokens[i])


@torch.inference_mode()
def speculative_generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    speculator: Speculator,
    tokenizer=None,
    compile: str = "auto",
    on_token: Callable[[int, int], None] | None = None,
    grammar: Grammar | list[Grammar | None] | None = None,
    kv_cache: KVCacheSpec | None = None,
    max_steps: int | None = None,
) -> SpecOutput:
    """Generate for a batch of token-id prompts with ``speculator`` proposing and the one verifier deciding.

    params: one SamplingParams for every row, or one per row. Each row draws from its own generator seeded
    with its own params' seed (draft samples, acceptance tests, residual and bonus samples), so a row's
    tokens do not depend on its batch mates, and equal the serving engine's for the same request.
    compile: "off" | "auto" | "on" (runtime.compiled): chain verifications of up to 32 tokens through the
    compiled step; trees and longer chains run eager. on_token(row, token) streams each committed token.
    grammar (one, or one per row): the target's distribution at every position is masked by the row's grammar
    state after the committed tokens and the drafts before it (the verifier does it), so the output has the
    distribution of constrained plain sampling. kv_cache: the target cache's format and policy (runtime.kv_policy);
    its trailing draft slots stay rewritable (int4 keeps their key groups open). The clock covers the whole call
    (runtime.timing): the TTFT includes the speculator's prefill, each step its propose, verification forward,
    lm_head and verify. max_steps: stop after this many speculative steps, rows still running ending with
    finish reason "steps" (a distribution test of the first tokens reads nothing later: its max_tokens still
    sizes the first step's drafts, so a tree is proposed whole)."""
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    clock = LoopClock()
    row_params, longest = check_rows(model, prompts, params)
    B, device, cfg = len(prompts), device_of(model), model.config
    capacity = longest + speculator.max_tokens_per_step() + 1
    rows = SpecRows(
        params=row_params,
        generators=[make_generator(sp.seed, device) for sp in row_params],
        stops=[StopChecker(sp, cfg.eos_token_ids, tokenizer) for sp in row_params],
        constraints=row_constraints(grammar, row_params, cfg.vocab_size),
        seqs=[list(p) for p in prompts],
        keys=[("speculative_generate", next(_RUNS), b) for b in range(B)],
        lengths=torch.tensor([len(p) for p in prompts], device=device),
        out=SpecOutput(
            tokens=[[] for _ in range(B)],
            finish_reasons=[""] * B,
            stats=SpecStats(rows=B),
            row_drafted=[0] * B,
            row_accepted=[0] * B,
        ),
        clock=clock,
        on_token=on_token,
        active=[True] * B,
        token_times=[[] for _ in range(B)],
    )
    kv = kv_cache or KVCacheSpec()
    rows.out.compile = resolve_compile(compile, device) if kv.compilable else "off"
    decoder = compiled_decoder(model, B, capacity, rows.out.compile, kv) if rows.out.compile != "off" else None
    lookahead = speculator.max_tokens_per_step() - 1
    cache = decoder.cache if decoder is not None else kv.build(model, B, capacity, lookahead)

    prefill_rows(model, cache, prompts, rows)
    try:
        if any(rows.active):  # the speculator's own prefill (a draft model's KV) belongs to the prefill phase
            speculator.prefill(rows.state(rows.live()))
        rows.stamp()
        while any(rows.active):
            if max_steps is not None and rows.out.stats.steps >= max_steps:
                for b in rows.live():
                    rows.out.finish_reasons[b], rows.active[b] = "steps", False
                break
            speculative_step(model, cache, speculator, rows, decoder)
            rows.stamp()
    finally:
        speculator.release(rows.keys)
    out = rows.out
    out.timing = LoopTiming.from_clock(clock, rows.token_times)
    out.speculator = speculator.describe()
    out.grammar_incomplete = [c is not None and not c.complete for c in rows.constraints]
    return out


_RUNS = itertools.count()


def _verify_forward(
    model, cache: KVCache, proposal: Proposal, rows: list[int], seqs, lengths: Tensor, decoder: CompiledDecoder | None
) -> Tensor:
    """One target forward over every row of the static batch: the speculating rows feed their last committed
    token + drafts (a chain) or their tree; finished rows feed padding (their outputs are unused). A chain
    runs through the compiled step when there is one, padded to the bucket of the speculator's longest step
    (one captured graph per speculator)."""
    B = lengths.shape[0]
    device = lengths.device
    fed = proposal.fed()
    T = len(proposal.tree) if proposal.tree is not None else max(fed)
    feed = torch.zeros(B, T, dtype=torch.long, device=device)
    feed[:, 0] = torch.tensor([s[-1] for s in seqs], device=device)
    row_index = torch.tensor(rows, device=device)
    if proposal.tree is not None:
        feed[row_index] = proposal.tokens
        meta = tree_metadata(proposal.tree, lengths)
    else:
        feed[row_index, 1:] = proposal.tokens[:, : T - 1]  # drafts past a row's num_drafted: written, never read
        longest = proposal.tokens.shape[1] + 1
        if decoder is not None and bucket(longest) is not None:
            positions = (lengths - 1)[:, None] + torch.arange(T, device=device)[None]
            return decoder(feed, positions, min_tokens=longest)
        meta = chain_metadata(lengths, T)
    return model(feed, meta, cache, hidden_only=True)
