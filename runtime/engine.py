"""The serving engine: requests in, tokens out, one scheduler step at a time over a paged KV cache.

Each step the scheduler picks sequences and token counts; the engine runs the model's one forward over
them (decode rows as one [B, 1] batch, prefill chunks as one right-padded [B, T] batch) writing and
reading the KV through block tables, draws the next token for every row that reached its end with that
row's own SamplingParams and generator (a request's tokens do not depend on its batch), and retires rows
that hit a stop condition. ``add_request`` / ``abort_request`` may be called between steps.

Speculative decoding plugs into the decode path (``Speculator``): propose k tokens per sequence, one
forward over the last token plus the k drafts, verify against the target probabilities, keep the
accepted tokens. The rejected positions' KV is simply overwritten later, as with the contiguous cache.

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
from typing import Protocol

import torch
from torch import Tensor

from runtime.generate import StopChecker
from runtime.model import Transformer
from runtime.paged_cache import SCRATCH_BLOCK, BlockManager, PagedAttentionMetadata, PagedKVCache
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

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "RequestRejectedError", "Speculator"]

log = logging.getLogger("qspec.engine")


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
    finish_reason: str | None  # "eos" | "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter time of each output token
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first is None)
    error: str | None = None  # what failed, when finish_reason == "error"

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.logprobs or [])


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
        self.num_failed = 0
        self._token_events: deque[tuple[float, int]] = deque()  # (time, tokens) for a sliding tokens/s

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(
        self, prompt: list[int] | str, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; raises RequestRejectedError when it can never fit."""
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
            outputs += self._isolated(self._speculative_decode, [w.seq for w in decodes], outputs)
            decodes = []
        sampling: list[tuple[Sequence, Tensor]] = []  # (sequence, hidden state its next token comes from)
        for group in (decodes, prefills):
            if not group:
                continue
            for part, hidden in self._isolated(lambda g: [(g, self._forward(g))], group, outputs):  # [B, T, H]
                for b, w in enumerate(part):
                    start = w.seq.num_computed_tokens
                    self.num_prompt_tokens_computed += max(
                        0, min(w.seq.num_prompt_tokens, start + w.num_tokens) - start
                    )
                    if w.samples:  # (before num_computed_tokens moves on)
                        sampling.append((w.seq, hidden[b, w.num_tokens - 1]))
                    w.seq.num_computed_tokens += w.num_tokens
                    self.block_manager.register_full_blocks(w.seq, w.seq.token_ids, w.seq.num_computed_tokens)
        if sampling:
            logits = self.model.logits(torch.stack([h for _, h in sampling]))  # [N, V]
            for i, (seq, _) in enumerate(sampling):
                outputs.append(self._guarded(seq, self._sample_and_append, seq, logits[i]))
        return [o for o in outputs if o is not None]

    def _sample_and_append(self, seq: Sequence, logits: Tensor) -> RequestOutput | None:
        """[V] raw logits of seq's next token -> the drawn token appended (with its log-prob if asked)."""
        p = seq.params
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        adjusted = process_logits(logits, p, prompt, seq.output_ids, self._stop_ids(seq))
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
        for seq, d in zip(seqs, drafts):  # room for the drafts' KV, or no drafts for this row
            if not self.block_manager.can_allocate(seq, seq.num_tokens + len(d)):
                d.clear()
            self.block_manager.allocate(seq, seq.num_tokens + len(d))
        work = [ScheduledWork(s, 1) for s in seqs]
        hidden = self._forward(work, extra=drafts)  # [B, 1 + max k, H]
        # from here on per row: an exception fails its own request only
        rows = zip(seqs, drafts, hidden)
        return [self._guarded(s, self._verify_and_append, s, d, h) for s, d, h in rows]

    def _verify_and_append(self, seq: Sequence, draft: list[int], hidden: Tensor) -> RequestOutput | None:
        """hidden [1 + max k, H] over seq's last token + its drafts -> the verified tokens appended. Position
        j's probabilities see the drafts before it as generated tokens, so penalties stay exact."""
        p, k = seq.params, len(draft)
        logits = self.model.logits(hidden[: k + 1])  # [k+1, V]
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        stop_ids = self._stop_ids(seq)
        probs = torch.stack(
            [logits_to_probs(process_logits(logits[j], p, prompt, seq.output_ids + draft[:j], stop_ids), p)
             for j in range(k + 1)]
        )  # fmt: skip
        toks = self.speculator.verify([seq], [draft], probs[None])[0]
        self.num_spec_proposed += k
        self.num_spec_accepted += len(toks) - 1
        seq.num_computed_tokens += len(toks)  # the last token + accepted drafts now have valid KV
        self.block_manager.register_full_blocks(seq, seq.token_ids + toks, seq.num_computed_tokens)
        lps = token_logprobs(logits[: len(toks)], toks, p.logprobs) if p.logprobs is not None else None
        return self._append_tokens(seq, toks, lps)

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput | None:
        if seq.status is not SequenceStatus.RUNNING:
            return None
        now = time.perf_counter()
        new = []
        reason = None
        for i, tok in enumerate(tokens):
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
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            error=seq.error,
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
            "paged_decode_kernel_launches_total": self.cache.kernel_launches,
        }
