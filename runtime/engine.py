"""The serving engine: requests in, tokens out, one scheduler step at a time over a paged KV cache.

Each step the scheduler picks sequences and token counts; the engine runs the model's one forward over
them (decode rows as one [B, 1] batch, prefill chunks as one right-padded [B, T] batch) writing and
reading the KV through block tables, draws the next token for every row that reached its end with that
row's own SamplingParams and generator (a request's tokens do not depend on its batch), and retires rows
that hit a stop condition. ``add_request`` / ``abort_request`` may be called between steps.

Speculative decoding plugs into the decode path (``Speculator``): propose k tokens per sequence, one
forward over the last token plus the k drafts, verify against the target probabilities, keep the
accepted tokens. The rejected positions' KV is simply overwritten later, as with the contiguous cache.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from runtime.generate import StopChecker
from runtime.grammar import Grammar, chain_masks, row_masks
from runtime.model import Transformer
from runtime.paged_cache import SCRATCH_BLOCK, BlockManager, PagedAttentionMetadata, PagedKVCache
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample_rows
from runtime.scheduler import (
    RequestRejectedError,
    ScheduledWork,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "RequestRejectedError", "Speculator"]


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
    num_speculative_tokens: int = 4  # k, when a speculator is attached
    # decode attention: "auto" = the Triton paged kernel on CUDA, gather + SDPA on CPU; "triton" | "torch" force one
    decode_kernel: str = "auto"

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
    finish_reason: str | None  # "eos" | "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter time of each output token
    grammar_incomplete: bool = False  # finished under a grammar before its text was complete (e.g. max_tokens)


class Speculator(Protocol):
    """What the engine needs from speculative decoding (implementations live in speculate/)."""

    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """Up to k draft tokens per sequence, continuing seq.token_ids."""
        ...

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], target_probs: Tensor) -> list[list[int]]:
        """target_probs [B, k+1, V] (row b's position j scores the token after drafts[b][:j]) -> the
        tokens to append per sequence: the accepted drafts plus one corrected or bonus token."""
        ...


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
        param = model.norm.weight  # not embed_tokens: a quantized one dequantizes its whole table for .weight
        self.device = param.device
        kv_dtype = model.layers[0].input_layernorm.weight.dtype  # the compute dtype k/v come out in
        num_blocks = config.num_blocks or (
            PagedKVCache.blocks_for_budget(cfg, config.kv_cache_bytes, config.block_size, kv_dtype) + 1
        )
        self.cache = PagedKVCache(cfg, num_blocks, config.block_size, kv_dtype, self.device, config.decode_kernel)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(cfg.max_position_embeddings), self.block_manager)
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
        self.num_finished = 0
        self.num_aborted = 0
        self._token_events: deque[tuple[float, int]] = deque()  # (time, tokens) for a sliding tokens/s

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: list[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        grammar: Grammar | None = None,
    ) -> str:
        """Queue a request; raises RequestRejectedError when it can never fit. grammar: every token it gets
        is sampled under the grammar's mask (runtime.grammar)."""
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
        if grammar is not None:
            if grammar.vocab_size != vocab:
                raise ValueError(f"the grammar was compiled for {grammar.vocab_size} tokens, the model has {vocab}")
            if params.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a grammar: the grammar ends the output with EOS")
            seq.constraint = grammar.matcher()
        self.scheduler.add(seq)  # admission control raises here
        self.seqs[request_id] = seq
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request (waiting or running): its blocks go back to the pool now."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
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
        if self.speculator is not None and decodes:
            outputs += self._speculative_decode([w.seq for w in decodes])
            decodes = []
        sampling: list[tuple[Sequence, Tensor]] = []  # (sequence, hidden state its next token comes from)
        for group in (decodes, prefills):
            if not group:
                continue
            hidden = self._forward(group)  # [B, T, H]
            for b, w in enumerate(group):
                start = w.seq.num_computed_tokens
                self.num_prompt_tokens_computed += max(0, min(w.seq.num_prompt_tokens, start + w.num_tokens) - start)
                if w.samples:  # (before num_computed_tokens moves on)
                    sampling.append((w.seq, hidden[b, w.num_tokens - 1]))
                w.seq.num_computed_tokens += w.num_tokens
                self.block_manager.register_full_blocks(w.seq, w.seq.token_ids, w.seq.num_computed_tokens)
        if sampling:
            seqs = [s for s, _ in sampling]
            logits = self.model.logits(torch.stack([h for _, h in sampling]))  # [N, V]
            masks = row_masks([s.constraint for s in seqs], logits.shape[-1], self.device)
            probs = torch.stack(
                [logits_to_probs(logits[i], s.params, None if masks is None else masks[i]) for i, s in enumerate(seqs)]
            )
            tokens = sample_rows(probs, [s.params for s in seqs], [s.generator for s in seqs]).tolist()
            for seq, tok in zip(seqs, tokens):
                outputs.append(self._append_tokens(seq, [tok]))
        return [o for o in outputs if o is not None]

    def _forward(self, group: list[ScheduledWork], extra: list[list[int]] | None = None) -> Tensor:
        """One model forward over the group's scheduled tokens (plus optional draft tokens per row,
        appended after them), right-padded to the longest row. Returns hidden states [B, T, H]."""
        bs = self.block_manager.block_size
        rows_tokens, rows_pos, rows_slots, tables = [], [], [], []
        for b, w in enumerate(group):
            seq, start = w.seq, w.seq.num_computed_tokens
            toks = seq.token_ids[start : start + w.num_tokens] + (extra[b] if extra else [])
            pos = list(range(start, start + len(toks)))
            rows_tokens.append(toks)
            rows_pos.append(pos)
            rows_slots.append([seq.block_table[p // bs] * bs + p % bs for p in pos])
            tables.append(seq.block_table)
        T = max(len(t) for t in rows_tokens)
        kv_len = max(p[-1] for p in rows_pos) + 1
        nb = -(-kv_len // bs)
        pad = SCRATCH_BLOCK * bs  # padding tokens write the scratch block, at position 0

        def padded(rows: list[list[int]], width: int, value: int, dtype=torch.int64) -> Tensor:
            rows = [r[:width] + [value] * (width - len(r[:width])) for r in rows]
            return torch.tensor(rows, dtype=dtype, device=self.device)

        tokens = padded(rows_tokens, T, 0)
        positions = padded(rows_pos, T, 0)  # a pad query at position 0 sees key 0 only: finite, unused
        slots = padded(rows_slots, T, pad)
        block_tables = padded(tables, nb, SCRATCH_BLOCK, torch.int32)  # int32: what the decode kernel reads
        key_pos = torch.arange(kv_len, device=self.device)
        meta = PagedAttentionMetadata(
            positions=positions,
            slots=slots,
            mask=key_pos[None, None, None, :] <= positions[:, None, :, None],  # [B, 1, T, kv_len]
            kv_len=kv_len,
            block_tables=block_tables,
            context_lens=torch.tensor([p[-1] + 1 for p in rows_pos], dtype=torch.int32, device=self.device),
        )
        return self.model(tokens, meta, self.cache, hidden_only=True)

    def _speculative_decode(self, seqs: list[Sequence]) -> list[RequestOutput | None]:
        """Propose k drafts per sequence, score last token + drafts in one forward, keep what verifies."""
        k = self.config.num_speculative_tokens
        drafts = [
            list(d)[: max(0, min(k, s.max_total_tokens - s.num_tokens - 1))]
            for s, d in zip(seqs, self.speculator.propose(seqs, k))
        ]
        # under a grammar: the target's masks after each prefix of the drafts; n-gram drafts are deterministic,
        # so each is cut at the first token the grammar refuses (lossless, see runtime.grammar.chain_masks)
        V = self.model.config.vocab_size
        masks = [None] * len(seqs)
        for i, (seq, d) in enumerate(zip(seqs, drafts)):
            if seq.constraint is not None:
                masks[i], usable = chain_masks(seq.constraint, d, deterministic=True)
                del d[usable:]
        for seq, d in zip(seqs, drafts):  # room for the drafts' KV, or no drafts for this row
            if not self.block_manager.can_allocate(seq, seq.num_tokens + len(d)):
                d.clear()
            self.block_manager.allocate(seq, seq.num_tokens + len(d))
        work = [ScheduledWork(s, 1) for s in seqs]
        hidden = self._forward(work, extra=drafts)  # [B, 1 + max k, H]
        T = hidden.shape[1]
        full = torch.ones(T, V, dtype=torch.bool)
        probs = torch.stack(
            [
                logits_to_probs(
                    self.model.logits(hidden[b]),
                    s.params,
                    None if m is None else torch.cat([m[: len(drafts[b]) + 1], full[len(drafts[b]) + 1 :]]),
                )
                for b, (s, m) in enumerate(zip(seqs, masks))
            ]
        )  # [B, 1 + max k, V]
        accepted = self.speculator.verify(seqs, drafts, probs)
        outputs = []
        for seq, d, toks in zip(seqs, drafts, accepted):
            self.num_spec_proposed += len(d)
            self.num_spec_accepted += len(toks) - 1
            seq.num_computed_tokens += len(toks)  # the last token + accepted drafts now have valid KV
            self.block_manager.register_full_blocks(seq, seq.token_ids + toks, seq.num_computed_tokens)
            outputs.append(self._append_tokens(seq, toks))
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int]) -> RequestOutput | None:
        if seq.status is not SequenceStatus.RUNNING:
            return None
        now = time.perf_counter()
        new = []
        reason = None
        for tok in tokens:
            if seq.constraint is not None and not seq.constraint.accept(tok):
                raise RuntimeError(f"{seq.request_id}: token {tok} is not allowed by its grammar")
            seq.token_ids.append(tok)
            seq.token_times.append(now)
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
            self.seqs.pop(seq.request_id, None)
            self.num_finished += 1
        out = self._output(seq, new)
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.append(out)
        return out

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
            "preemptions_total": self.scheduler.num_preemptions,
            "steps_total": self.num_steps,
            "generation_tokens_total": self.num_generated_tokens,
            "prompt_tokens_computed_total": self.num_prompt_tokens_computed,
            "generation_tokens_per_second": self.tokens_per_second(),
            "spec_tokens_proposed_total": self.num_spec_proposed,
            "spec_tokens_accepted_total": self.num_spec_accepted,
            "paged_decode_kernel_launches_total": self.cache.kernel_launches,
        }
