"""One definition of each latency figure, the one ``vllm bench serve`` uses, for every loop and benchmark.

- TTFT: request start -> the first output token is available to the caller (on the host, stop-checked).
- TPOT: (end - first token) / (output tokens - 1); a request with one output token has none.
- ITL: the gap between consecutive token arrivals; tokens committed by one speculative step arrive together.
- Throughput: output tokens / wall time of the call.

Loops clock whole steps: a ``LoopClock`` is started when the call starts and ``mark()``ed once per step after
the step's tokens are sampled, synced to the host, stop-checked and handed to the caller. Every second of the
call lies in the TTFT or in one step (forward, lm_head, sampling, stopping, syncs, callbacks), so TTFT + the
sum of step times is the call's wall time, which tests assert for every loop.

``PhaseTimer`` splits steps into named phases (forward, lm_head, sampling) for benchmarks that ask where the
time goes; it synchronizes CUDA at each boundary, so loops only use it when asked to profile.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def ttft(start: float, token_times: list[float]) -> float | None:
    return token_times[0] - start if token_times else None


def tpot(token_times: list[float], end: float | None = None, tokens: int | None = None) -> float | None:
    """(end - first token) / (tokens - 1); end defaults to the last token's arrival, tokens to len(token_times)
    (a server whose chunks carry several tokens passes its own count)."""
    n = len(token_times) if tokens is None else tokens
    if n < 2 or not token_times:
        return None
    return ((token_times[-1] if end is None else end) - token_times[0]) / (n - 1)


def itls(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


@dataclass
class LoopClock:
    """Start at the call's start; mark() after each step's tokens are handed out (the first mark is the TTFT)."""

    start: float = field(default_factory=time.perf_counter)
    marks: list[float] = field(default_factory=list)

    def mark(self) -> float:
        now = time.perf_counter()
        self.marks.append(now)
        return now

    @property
    def ttft_s(self) -> float:
        return self.marks[0] - self.start if self.marks else 0.0

    @property
    def step_times_s(self) -> list[float]:
        """Wall time of each step after the first token's: consecutive marks' differences."""
        return itls(self.marks)


@dataclass
class LoopTiming:
    """What a generation loop reports: the call's clock and each row's token arrival times."""

    start_s: float = 0.0  # perf_counter at the call's start
    end_s: float = 0.0  # perf_counter when the call finished
    ttft_s: float = 0.0  # start -> the first step's tokens (prefill + first sample)
    step_times_s: list[float] = field(default_factory=list)  # wall time of each later step, whole
    token_times: list[list[float]] = field(default_factory=list)  # [B] arrival time of each output token
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per phase, when the loop was profiled

    @classmethod
    def from_clock(cls, clock: LoopClock, token_times: list[list[float]]) -> LoopTiming:
        return cls(clock.start, time.perf_counter(), clock.ttft_s, clock.step_times_s, token_times)

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float:
        """Mean over rows of each row's TPOT (rows with one token have none); 0.0 when no row has one."""
        values = [v for v in (tpot(t) for t in self.token_times) if v is not None]
        return sum(values) / len(values) if values else 0.0

    @property
    def decode_s(self) -> float:
        """First token -> last token of the call (the decode phase)."""
        return sum(self.step_times_s)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_times)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / wall time of the call (TTFT included)."""
        return self.output_tokens / max(self.wall_s, 1e-12)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each row's first / decode seconds: the rate TPOT describes, for a whole batch."""
        return (self.output_tokens - len(self.token_times)) / max(self.decode_s, 1e-12)

    def summary(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "wall_s": self.wall_s,
            "decode_s": self.decode_s,
            "steps": len(self.step_times_s) + 1,
            "output_tokens": self.output_tokens,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            **({"phase_s": dict(self.phase_s)} if self.phase_s else {}),
        }


class PhaseTimer:
    """Seconds per named phase: ``with timer("lm_head"): ...``. Disabled (no clock, no sync) unless enabled."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - t


def timing_line(timing: LoopTiming) -> str:
    """One line for a CLI: tokens, TTFT, TPOT and both rates, from the whole-step clock."""
    return (
        f"{timing.output_tokens} tokens, TTFT {timing.ttft_s * 1e3:.1f} ms, TPOT {timing.tpot_s * 1e3:.1f} ms, "
        f"{timing.tokens_per_s:.1f} tok/s over the whole call ({timing.decode_tokens_per_s:.1f} tok/s after the "
        f"first token)"
    )
