"""The serving engine: requests in, tokens out, one scheduler step at a time over a paged KV cache.

Each step the scheduler picks sequences and token counts; the engine runs the model's one forward over
them (decode rows as one [B, 1] batch, prefill chunks as one right-padded [B, T] batch) writing and
reading the KV through block tables, draws the next token for every row that reached its end with that
row's own SamplingParams and generator (a request's tokens do not depend on its batch), and retires rows
that hit a stop condition. ``add_request`` / ``abort_request`` may be called between steps.

Speculative decoding plugs into the decode path through the one contract of ``runtime.speculation``
(every speculator in speculate/ implements it): the decoding sequences' SpecState (request ids, tokens,
the target's last hidden state, each request's params and generator) -> a proposal (chain drafts or a
candidate tree) -> one forward over each sequence's last token plus its drafts (a tree: nodes at
consecutive slots, rope position by depth, an ancestor mask over the paged cache) -> the speculator's
verify (the one verifier, per sequence) -> the accepted tokens. Rejected positions' KV is simply
overwritten later; a tree's accepted path is first copied to consecutive slots. Finished and aborted
requests are released from the speculator (its per-sequence state, e.g. a draft model's KV).

An exception raised for one request (its logit processing, sampling, stop check, or a forward that fails
only with it in the batch) finishes that request alone with finish_reason "error" and the message in
RequestOutput.error; the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime import timing
from runtime.grammar import Grammar, mask_logits, row_constraints
from runtime.layout import device_of
from runtime.model import Transformer
from runtime.paged_cache import BlockManager, PagedKVCache, paged_metadata
from runtime.sampling import (
    SamplingParams,
    TokenLogprob,
    logits_to_probs,
    make_generator,
    process_logits,
    sample_rows,
    token_logprobs,
)
from runtime.scheduler import (
    RequestRejectedError,
    ScheduledWork,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from runtime.speculation import Proposal, SpecState, Speculator, draft_budget
from runtime.stopping import StopChecker

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "RequestRejectedError", "Speculator"]

log = logging.getLogger("qspec.engine")
LATENCY_METRICS = ("ttft", "tpot", "e2e")  # per finished request, as runtime.timing defines them


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # memory budget for the KV pool (ignored when num_blocks is set)
    num_blocks: int | None = None  # exact pool size, scratch block included
    enable_prefix_caching: bool = True
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    policy: str = "continuous"  # "continuous" | "static"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # decode attention: "auto" = the Triton paged kernel on CUDA, gather + SDPA on CPU; "triton" | "torch" force one
    decode_kernel: str = "auto"
    # KV storage (runtime.kv_quant): auto (the compute dtype) | int8 | fp8_e4m3 | int4; quantized = approximate
    kv_cache_dtype: str = "auto"
    # speculation only while at most this many requests are in the engine (running, prefilling or waiting; None:
    # always). Above it the step is plain batched decoding: B x (k + 1) verification rows are compute-bound on a
    # CPU long before they fill a GPU, so a large batch gains more from batching than from drafts (vLLM's
    # speculative_disable_by_batch_size). Requests being prefilled count, so a batch that is filling up does not
    # pay the draft's prompt prefill for one speculative step. Lossless either way; a seeded sampled request's
    # exact draws then depend on how many others were in the engine beside it.
    spec_max_batch: int | None = None

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.chunked_prefill,
            policy=self.policy,
            max_model_len=min(self.max_model_len or model_max_len, model_max_len),
        )


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced by this step
    output_ids: list[int]  # all tokens produced so far
    finished: bool
    finish_reason: str | None  # "eos" | "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter time of each output token
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first is None)
    error: str | None = None  # what failed, when finish_reason == "error"
    constrained: bool = False  # generated under a grammar
    grammar_incomplete: bool = False  # finished under a grammar before its text was complete (e.g. max_tokens)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.logprobs or [])

    @property
    def ttft_s(self) -> float | None:
        """Arrival -> first token (runtime.timing's definition)."""
        return timing.ttft(self.arrival_time, self.token_times)

    @property
    def tpot_s(self) -> float | None:
        return timing.tpot(self.token_times)


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        config: EngineConfig | None = None,
        speculator: Speculator | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        self.speculator = speculator
        cfg = model.config
        self.device = device_of(model)
        kv_dtype = model.compute_dtype  # the dtype k/v come out in
        lookahead = speculator.max_tokens_per_step() - 1 if speculator is not None else 0
        kv = (config.kv_cache_dtype, config.max_num_seqs, lookahead)  # quantized storage, int4's residual size
        num_blocks = config.num_blocks or (
            PagedKVCache.blocks_for_budget(cfg, config.kv_cache_bytes, config.block_size, kv_dtype, *kv) + 1
        )
        self.cache = PagedKVCache(cfg, num_blocks, config.block_size, kv_dtype, self.device, config.decode_kernel, *kv)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager.on_free = self.cache.block_freed  # int4: a freed block's open keys are sealed
        sched_config = config.scheduler_config(cfg.max_position_embeddings)
        if speculator is not None:  # room for every speculative step's drafts, reserved with the decode slot
            sched_config.num_lookahead_slots = lookahead
        self.scheduler = Scheduler(sched_config, self.block_manager)
        self.eos_ids = list(cfg.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._streams: dict[str, deque[RequestOutput]] = {}
        self._ids = itertools.count()
        # counters for /metrics
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_plain_steps = 0  # steps that decoded plainly above spec_max_batch
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0
        self._token_events: deque[tuple[float, int]] = deque()  # (time, tokens) for a sliding tokens/s
        self.latency_sums = dict.fromkeys(LATENCY_METRICS, 0.0)  # seconds summed over finished requests
        self.latency_counts = dict.fromkeys(LATENCY_METRICS, 0)

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: list[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        grammar: Grammar | None = None,
    ) -> str:
        """Queue a request; raises RequestRejectedError when it can never fit. grammar: every token it gets
        is drawn under the grammar's mask (runtime.grammar), also under speculation."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs the engine's tokenizer")
            prompt = self.tokenizer(prompt, add_special_tokens=False).input_ids
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt), len(prompt), params)
        seq.generator = make_generator(params.seed, self.device)
        seq.stop_checker = StopChecker(params, self.eos_ids, self.tokenizer)
        seq.constraint = row_constraints(grammar, [params], vocab)[0]
        self.scheduler.check_admissible(len(prompt), params.max_tokens)  # before any work for it
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = self._prompt_logprobs(prompt, params.prompt_logprobs)
        self.scheduler.add(seq)  # admission control raises here
        self.seqs[request_id] = seq
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request (waiting or running): its blocks go back to the pool now."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._release(seq)
        self.num_aborted += 1
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.append(self._output(seq, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward per row kind, sample, retire. Returns the requests that changed."""
        sched = self.scheduler.schedule()
        if not sched.work:
            return []
        self.num_steps += 1
        decodes = [w for w in sched.work if w.num_tokens == 1 and w.samples]
        prefills = [w for w in sched.work if not (w.num_tokens == 1 and w.samples)]
        outputs: list[RequestOutput | None] = []
        plain_steps: set[str] = set()  # requests with output decoded plainly this step
        if self.speculator is not None:  # a request's first token is drawn plainly, as in every loop
            limit, queue = self.config.spec_max_batch, self.scheduler
            crowded = limit is not None and len(queue.running) + len(queue.waiting) > limit
            continuing = [w.seq for w in decodes if w.seq.output_ids]
            # with a limit, a request with one token left (nothing to draft) takes a plain step, not a proposal
            # whose draft would prefill a request it never drafted for (after steps above the limit: seconds on a
            # CPU). Without one every continuing request verifies, so its seeded draws match the static loop's.
            speculating = [
                s
                for s in continuing
                if not crowded and (limit is None or draft_budget(len(s.output_ids), s.params.max_tokens) > 0)
            ]
            plain_steps = {s.request_id for s in continuing} - {s.request_id for s in speculating}
            self.num_plain_steps += crowded and bool(continuing)
            decodes = [w for w in decodes if not w.seq.output_ids or w.seq.request_id in plain_steps]
            if speculating:
                outputs += self._speculative_decode(speculating)
        sampling: list[tuple[Sequence, Tensor]] = []  # (sequence, hidden state its next token comes from)
        for group in (decodes, prefills):
            if not group:
                continue
            for part, hidden in self._isolated(lambda g: [(g, self._forward(g))], group, outputs):  # [B, T, H]
                for b, w in enumerate(part):
                    plain = w.num_tokens == 1 and w.seq.request_id in plain_steps
                    start = w.seq.num_computed_tokens
                    self.num_prompt_tokens_computed += max(
                        0, min(w.seq.num_prompt_tokens, start + w.num_tokens) - start
                    )
                    computed = w.num_tokens
                    if w.samples and self.speculator is not None and w.seq.output_ids and not plain:
                        # a preempted sequence recomputed: its last token stays the next speculative step's
                        # first input, as if it had never been preempted (its draws do not depend on memory)
                        w.seq.last_hidden = hidden[b, w.num_tokens - 2].clone()
                        computed -= 1
                    elif w.samples:  # (before num_computed_tokens moves on)
                        sampling.append((w.seq, hidden[b, w.num_tokens - 1]))
                    w.seq.num_computed_tokens += computed
                    self.block_manager.register_full_blocks(w.seq, w.seq.token_ids, w.seq.num_computed_tokens)
        if sampling:
            logits = self.model.logits(torch.stack([h for _, h in sampling]))  # [N, V]
            for i, (seq, h) in enumerate(sampling):
                if self.speculator is not None:  # Medusa reads it next step (a copy: not the whole batch's)
                    seq.last_hidden = h.clone()
                outputs.append(self._guarded(seq, self._sample_and_append, seq, logits[i]))
        return [o for o in outputs if o is not None]

    def _forward(self, group: list[ScheduledWork]) -> Tensor:
        """One model forward over the group's scheduled tokens. Returns hidden states [B, T, H]."""
        rows_tokens, rows_index = [], []
        for w in group:
            start = w.seq.num_computed_tokens
            rows_tokens.append(w.seq.token_ids[start : start + w.num_tokens])
            rows_index.append(list(range(start, start + w.num_tokens)))
        return self._run([w.seq for w in group], rows_tokens, rows_index, rows_index)

    def _run(self, seqs, rows_tokens, rows_pos, rows_index, local_masks=None) -> Tensor:
        """One forward over per-row new tokens at the given rope positions and sequence indices (slots
        through each row's block table), right-padded to the longest row. Returns hidden states [B, T, H]."""
        bs = self.block_manager.block_size
        meta = paged_metadata(rows_pos, rows_index, [s.block_table for s in seqs], bs, self.device, local_masks)
        T = meta.positions.shape[1]
        tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows_tokens], dtype=torch.int64, device=self.device)
        return self.model(tokens, meta, self.cache, hidden_only=True)

    def _sample_and_append(self, seq: Sequence, logits: Tensor) -> RequestOutput | None:
        """[V] raw logits of seq's next token -> the drawn token appended (with its log-prob if asked)."""
        p = seq.params
        adjusted = process_logits(
            logits, p, seq.token_ids[: seq.num_prompt_tokens], seq.output_ids, self._stop_ids(seq)
        )
        adjusted = mask_logits(adjusted, None if seq.constraint is None else seq.constraint.mask())
        tok = int(sample_rows(logits_to_probs(adjusted, p)[None], [p], [seq.generator])[0])
        lps = token_logprobs(logits[None], [tok], p.logprobs) if p.logprobs is not None else None
        return self._append_tokens(seq, [tok], lps)

    @staticmethod
    def _stop_ids(seq: Sequence) -> list[int]:
        return sorted(seq.stop_checker.stop_ids) if seq.params.min_tokens else []

    # ---- per-request isolation ---------------------------------------------------------------------

    def _isolated(self, fn, rows: list, outputs: list) -> list:
        """fn(rows) -> list; when it raises, run each row alone so only the rows that fail by themselves
        fail (fn must leave no per-row state changed when it raises: it runs again)."""
        try:
            return fn(rows)
        except Exception as err:
            if len(rows) == 1:
                seq = rows[0].seq if isinstance(rows[0], ScheduledWork) else rows[0]
                outputs.append(self._fail(seq, err))
                return []
        return [r for row in rows for r in self._isolated(fn, [row], outputs)]

    def _guarded(self, seq: Sequence, fn, *args) -> RequestOutput | None:
        try:
            return fn(*args)
        except Exception as err:
            return self._fail(seq, err)

    def _fail(self, seq: Sequence, err: Exception) -> RequestOutput | None:
        """Finish seq alone with reason "error" (its blocks go back to the pool); the engine serves on."""
        log.error("request %s failed: %s: %s", seq.request_id, type(err).__name__, err, exc_info=err)
        if seq.status is SequenceStatus.FINISHED:
            return None
        seq.error = f"{type(err).__name__}: {err}"
        self.scheduler.finish(seq, "error")
        self._release(seq)
        self.seqs.pop(seq.request_id, None)
        self.num_failed += 1
        out = self._output(seq, [])
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.append(out)
        return out

    def _prompt_logprobs(self, prompt: list[int], top_n: int, chunk: int = 256) -> list[TokenLogprob | None]:
        """Each prompt token's log-prob given the tokens before it (one cache-free forward: the prefix
        cache would skip positions), logits in chunks so [T, V] never materializes at once."""
        hidden = self.model(torch.tensor([prompt], device=self.device), hidden_only=True)[0]  # [T, H]
        out: list[TokenLogprob | None] = [None]
        for i in range(0, len(prompt) - 1, chunk):
            j = min(i + chunk, len(prompt) - 1)
            out += token_logprobs(self.model.logits(hidden[i:j]), prompt[i + 1 : j + 1], top_n)
        return out

    # ---- speculative decoding ----------------------------------------------------------------------

    def _speculative_decode(self, seqs: list[Sequence]) -> list[RequestOutput | None]:
        """Propose (chain or tree) per sequence, score each sequence's last token + drafts in one forward,
        keep what the speculator's verifier accepts. Up to the forward a failure is retried row by row;
        after it each row is verified on its own, so an exception fails only its own request."""
        outputs: list[RequestOutput | None] = []
        for part, state, proposal, hidden, raw in self._isolated(self._propose_and_score, seqs, outputs):
            for b, seq in enumerate(part):
                outputs.append(self._guarded(seq, self._verify_and_append, seq, state, proposal, hidden, raw[b], b))
        return outputs

    def _propose_and_score(self, seqs: list[Sequence]) -> list[tuple]:
        """-> [(seqs, SpecState, Proposal, hidden [B, T, H] of the verification forward, each row's logits
        [fed, V])]. Every row's fed positions go through the head in one call: it reads the head's weights once
        per step, not once per request (the head's kernels are row-invariant, so a row's logits are the same bits
        alone or beside the others)."""
        spec = self.speculator
        hidden = [s.last_hidden for s in seqs]
        state = SpecState(
            ids=[s.request_id for s in seqs],
            token_ids=[s.token_ids for s in seqs],
            hidden=torch.stack(hidden) if all(h is not None for h in hidden) else None,
            params=[s.params for s in seqs],
            generators=[s.generator for s in seqs],
            device=self.device,
            constraints=[s.constraint for s in seqs] if any(s.constraint is not None for s in seqs) else None,
        )
        budgets = [draft_budget(len(s.output_ids), s.params.max_tokens) for s in seqs]
        proposal = spec.propose(state).within(budgets)
        for b, (seq, fed) in enumerate(zip(seqs, proposal.fed())):  # KV room for the drafts, or none this step
            if not self.block_manager.can_allocate(seq, seq.num_tokens - 1 + fed):
                budgets[b], fed = 0, 1
            self.block_manager.allocate(seq, seq.num_tokens - 1 + fed)
        proposal = proposal.within(budgets)
        tree, drafted = proposal.tree, proposal.drafted()
        ancestors = None if tree is None else tree.ancestor_mask()
        rows_tokens, rows_pos, rows_index, local = [], [], [], []
        for b, (seq, fed) in enumerate(zip(seqs, proposal.fed())):
            start = seq.num_computed_tokens  # the last committed token's index
            index = list(range(start, start + fed))
            if tree is not None and drafted[b] > 0:
                rows_tokens.append(proposal.tokens[b].tolist())  # node 0 is the last committed token
                rows_pos.append([start + d for d in tree.depth])
                local.append(ancestors)
            else:
                rows_tokens.append(seq.token_ids[start:] + proposal.tokens[b, : fed - 1].tolist())
                rows_pos.append(index)
                local.append(None)
            rows_index.append(index)
        hidden = self._run(seqs, rows_tokens, rows_pos, rows_index, local)
        fed = proposal.fed()
        raw = self.model.logits(torch.cat([hidden[b, :n] for b, n in enumerate(fed)])).split(fed)
        return [(seqs, state, proposal, hidden, raw)]

    def _verify_and_append(
        self, seq: Sequence, state: SpecState, proposal: Proposal, hidden: Tensor, raw: Tensor, b: int
    ) -> RequestOutput | None:
        """Row b of a speculative step: its logits (with the request's adjustments at each fed position,
        seeing the drafts before it as generated tokens, so penalties stay exact) -> the speculator's
        verify on this row alone -> the accepted tokens appended, and a tree's accepted KV made consecutive."""
        p = seq.params
        fed = proposal.fed()[b]  # raw: [fed, V] the model's own logits (reported as logprobs)
        row_tokens = proposal.tokens[b].tolist()
        if proposal.tree is not None and proposal.drafted()[b] > 0:
            tree = proposal.tree
            paths = [[] for _ in range(fed)]  # the drafted tokens from the root to each node (root excluded)
            for i in range(1, fed):
                paths[i] = paths[tree.parents[i]] + [row_tokens[i]]
        else:
            paths = [row_tokens[:j] for j in range(fed)]
        prompt, stop_ids = seq.token_ids[: seq.num_prompt_tokens], self._stop_ids(seq)
        logits = torch.stack(
            [process_logits(raw[j], p, prompt, seq.output_ids + paths[j], stop_ids) for j in range(fed)]
        )
        verdict = self.speculator.verify(state.row(b), proposal.row(b), logits[None])
        toks, path = verdict.tokens[0], verdict.paths[0]
        start = seq.num_computed_tokens
        if path != list(range(len(path))):  # a tree's accepted nodes: their KV to consecutive slots
            bs = self.block_manager.block_size
            slot = [seq.block_table[i // bs] * bs + i % bs for i in range(start, start + fed)]
            src = torch.tensor([slot[i] for i in path[1:]], device=self.device)
            dst = torch.tensor(slot[1 : len(path)], device=self.device)
            self.cache.copy_slots(src, dst)
        seq.last_hidden = hidden[b, verdict.last[0]].clone()
        self.num_spec_proposed += verdict.offered[0]
        self.num_spec_accepted += len(toks) - 1
        seq.num_computed_tokens += len(toks)  # the last token + accepted drafts now have valid KV
        self.block_manager.register_full_blocks(seq, seq.token_ids + toks, seq.num_computed_tokens)
        lps = token_logprobs(raw[path], toks, p.logprobs) if p.logprobs is not None else None
        return self._append_tokens(seq, toks, lps)

    def _release(self, seq: Sequence) -> None:
        seq.last_hidden = None
        if self.speculator is not None:
            self.speculator.release([seq.request_id])

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput | None:
        if seq.status is not SequenceStatus.RUNNING:
            return None
        now = time.perf_counter()
        new = []
        reason = None
        for i, tok in enumerate(tokens):
            if seq.constraint is not None and not seq.constraint.accept(tok):
                raise RuntimeError(f"{seq.request_id}: token {tok} is not allowed by its grammar")
            seq.token_ids.append(tok)
            seq.token_times.append(now)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            new.append(tok)
            reason = seq.stop_checker.check(seq.output_ids)
            if reason is not None:
                break
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.num_generated_tokens += len(new)
        self._token_events.append((now, len(new)))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._release(seq)
            self.seqs.pop(seq.request_id, None)
            self.num_finished += 1
            self._count_latency(seq, now)
        out = self._output(seq, new)
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.append(out)
        return out

    def _count_latency(self, seq: Sequence, end: float) -> None:
        """A finished request's TTFT, TPOT and end-to-end latency into the /metrics sums (runtime.timing)."""
        values = {
            "ttft": timing.ttft(seq.arrival_time, seq.token_times),
            "tpot": timing.tpot(seq.token_times, end),
            "e2e": end - seq.arrival_time,
        }
        for name, value in values.items():
            if value is not None:
                self.latency_sums[name] += value
                self.latency_counts[name] += 1

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            output_ids=list(seq.output_ids),
            finished=seq.status is SequenceStatus.FINISHED,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            token_times=list(seq.token_times),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
            constrained=seq.constraint is not None,
            grammar_incomplete=seq.status is SequenceStatus.FINISHED
            and seq.constraint is not None
            and not seq.constraint.complete,
        )

    # ---- conveniences ------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]] | list[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        row_params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, row_params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(
        self, prompt: list[int] | str, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they come, stepping the engine (other requests advance too,
        and other streams may be interleaved). Closing the iterator early cancels the request."""
        rid = self.add_request(prompt, params, request_id)
        queue = self._streams[rid] = deque()
        try:
            while True:
                while not queue:
                    self.step()
                out = queue.popleft()
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            self.abort_request(rid)  # no-op once finished

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        while self._token_events and self._token_events[0][0] < now - window_s:
            self._token_events.popleft()
        if not self._token_events:
            return 0.0
        span = max(now - self._token_events[0][0], 1e-3)
        return sum(n for _, n in self._token_events) / span

    def metrics(self) -> dict:
        bm = self.block_manager
        return {
            "requests_waiting": len(self.scheduler.waiting),
            "requests_running": len(self.scheduler.running),
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_cached_free": len(bm.cached_free),
            "prefix_cache_queries_tokens": bm.prefix_queries,
            "prefix_cache_hits_tokens": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "requests_finished_total": self.num_finished,
            "requests_aborted_total": self.num_aborted,
            "requests_failed_total": self.num_failed,
            "preemptions_total": self.scheduler.num_preemptions,
            "steps_total": self.num_steps,
            "generation_tokens_total": self.num_generated_tokens,
            "prompt_tokens_computed_total": self.num_prompt_tokens_computed,
            "generation_tokens_per_second": self.tokens_per_second(),
            "spec_tokens_proposed_total": self.num_spec_proposed,
            "spec_tokens_accepted_total": self.num_spec_accepted,
            "spec_plain_steps_total": self.num_plain_steps,
            "paged_decode_kernel_launches_total": self.cache.kernel_launches,
            **{f"request_{n}_seconds_sum": self.latency_sums[n] for n in LATENCY_METRICS},
            **{f"request_{n}_seconds_count": self.latency_counts[n] for n in LATENCY_METRICS},
        }
