"""Which sequences run in the next step, and how many of their tokens: the serving scheduler.

Continuous batching (the default) admits waiting requests and retires finished ones at every step; the
static mode admits a batch only when the previous batch has fully finished (the comparison baseline).
Each step has a token budget: running sequences go first, decodes before prompts still being prefilled
(a decode costs one token; a prompt costs the rest of its tokens, cut to the remaining budget when
chunked prefill is on, so a long prompt cannot stall everyone's decode), then waiting requests are
admitted in arrival order while budget, batch slots and KV blocks last. When a running sequence needs a
block and none is free, the most recently admitted running sequence not yet scheduled is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed from its prompt and the
tokens it has generated so far.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from runtime.paged_cache import BlockManager
from runtime.sampling import SamplingParams


class RequestRejectedError(ValueError):
    """A request that can never be served with this engine's limits (reported to the client)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    stop_checker: object | None = None
    constraint: object | None = None  # runtime.grammar.TokenConstraint when the request has a grammar
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # [H] the target's hidden state behind the last token (speculation)
    logprobs: list = field(default_factory=list)  # runtime.sampling.TokenLogprob per output token, if asked
    prompt_logprobs: list | None = None
    error: str | None = None  # why it finished with reason "error"

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16  # sequences in one step
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    chunked_prefill: bool = True
    policy: str = "continuous"  # "continuous" | "static"
    max_model_len: int = 2048
    # KV slots reserved past a decoding sequence's next token: a speculative step writes its drafts (or tree)
    # there, so drafts never lack room (which would make a request's draws depend on memory pressure)
    num_lookahead_slots: int = 0

    def __post_init__(self):
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # without chunking a whole prompt must fit one step's budget
            self.max_num_batched_tokens = self.max_model_len


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int  # tokens of seq computed this step, from seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence's known tokens (a next token is drawn)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order (the last is preempted first)
        self.num_preemptions = 0

    # ---- admission control -------------------------------------------------------------------------

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise RequestRejectedError("the prompt has no tokens")
        if total > self.config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"maximum context length of {self.config.max_model_len} tokens"
            )
        lookahead = self.config.num_lookahead_slots
        if self.blocks.blocks_for(total + lookahead) > self.blocks.num_usable_blocks:
            extra = f" + {lookahead} speculative slots" if lookahead else ""
            raise RequestRejectedError(
                f"prompt + max_tokens = {total} tokens{extra} needs {self.blocks.blocks_for(total + lookahead)} "
                f"KV blocks of {self.blocks.block_size} tokens; the pool has only {self.blocks.num_usable_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_prompt_tokens, seq.params.max_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        work: list[ScheduledWork] = []
        preempted: list[Sequence] = []

        # 1. running sequences: decodes first (a long prompt's chunks must not starve them), then prompts
        # still being prefilled, each group oldest first; make room by preempting the newest unscheduled
        scheduled: set[int] = set()
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        for seq in decoding + [s for s in self.running if s.num_uncomputed > 1]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = seq.num_uncomputed
            if self.config.chunked_prefill:
                n = min(n, budget)
            elif n > budget:
                continue
            slots = self._slots(seq, seq.num_computed_tokens, n)
            while not self.blocks.can_allocate(seq, slots):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)  # seq at the latest
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:  # it preempted itself
                continue
            self.blocks.allocate(seq, slots)
            work.append(ScheduledWork(seq, n))
            scheduled.add(id(seq))
            budget -= n

        # 2. admissions (none in a step that had to preempt: memory is tight)
        # a static batch is admitted whole (up to max_num_seqs) even when its prompts exceed one budget
        static = self.config.policy == "static"
        if not preempted and (not static or not self.running):
            while self.waiting and (budget > 0 or static) and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                match = self.blocks.match_prefix(seq.token_ids)
                cached = match.num_blocks * self.blocks.block_size
                n = seq.num_tokens - cached
                if self.config.chunked_prefill:
                    n = min(n, budget)
                elif n > budget:
                    break
                if not self.blocks.can_allocate(seq, self._slots(seq, cached, n), match):
                    break
                self.waiting.popleft()
                first_admission = seq.num_preemptions == 0
                seq.num_computed_tokens = self.blocks.take_prefix(seq, match, seq.num_tokens, count=first_admission)
                if first_admission:
                    seq.num_cached_tokens = seq.num_computed_tokens
                self.blocks.allocate(seq, self._slots(seq, cached, n))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if n > 0:
                    work.append(ScheduledWork(seq, n))
                budget -= n
        return SchedulerOutput(work, preempted)

    def _slots(self, seq: Sequence, start: int, n: int) -> int:
        """KV slots seq needs after computing n tokens from start: a decode step (its one last token) also
        gets the lookahead slots its speculative step writes."""
        decode = n == 1 and start + n == seq.num_tokens
        return start + n + (self.config.num_lookahead_slots if decode else 0)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq (finished or cancelled, running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
