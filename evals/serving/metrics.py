"""Latency statistics shared by the serving benchmarks: TTFT, TPOT, ITL, E2E, throughput, goodput.

Every request is described by when it was sent, when each output token (or streamed chunk) arrived and
when it ended. TTFT, TPOT and ITL are runtime.timing's functions (one definition for every loop and benchmark,
as in vLLM's and SGLang's serving benchmarks):
- TTFT: first token time - send time.
- TPOT: (end time - first token time) / (output tokens - 1), i.e. (E2E - TTFT) / (n - 1) as
  ``vllm bench serve`` computes it: the first token is excluded, it is prefill; requests with one output
  token have no TPOT. Output tokens come from the server's usage counts, or where a server sends none from
  tokenizing the generated text (as vLLM's benchmark does).
- ITL: gaps between consecutive token arrivals (one value per gap, pooled over requests).
- E2E: end time - send time.
- Goodput: completed requests per second that meet every given SLO.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from runtime import timing

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """mean, P50, P90, P99 and count of a sample."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    out["n"] = len(values)
    return out


@dataclass
class RequestRecord:
    send_time: float
    token_times: list[float] = field(default_factory=list)  # arrival of each output token or chunk
    end_time: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0  # from the server's usage when available (a chunk may carry several tokens)
    ok: bool = True
    error: str | None = None
    generated_text: str = ""  # what was streamed (counts the tokens when the server sends no usage)

    @property
    def ttft(self) -> float | None:
        return timing.ttft(self.send_time, self.token_times) if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok:
            return None
        end = self.end_time if math.isfinite(self.end_time) else None
        return timing.tpot(self.token_times, end, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        return timing.itls(self.token_times) if self.ok else []

    @property
    def e2e(self) -> float | None:
        return self.end_time - self.send_time if self.ok else None


@dataclass
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_s, r.ttft), (self.tpot_s, r.tpot), (self.e2e_s, r.e2e))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict:
    """Aggregate a run: latency distributions (seconds), throughputs (per second), goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": distribution([x for r in ok for x in r.itls]),
        "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
    }
    if slo is not None and any(v is not None for v in (slo.ttft_s, slo.tpot_s, slo.e2e_s)):
        good = sum(slo.met_by(r) for r in records)
        summary["slo"] = asdict(slo)
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(records) if records else math.nan
    return summary


def format_summary(summary: dict) -> str:
    """A plain-text table: one row per latency metric in milliseconds, then throughputs."""
    lines = [f"{'metric':<10}{'mean':>10}{'P50':>10}{'P90':>10}{'P99':>10}{'n':>7}   (ms)"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = summary[key]
        vals = "".join(f"{d[k] * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{label:<10}{vals}{d['n']:>7}")
    lines.append(
        f"requests {summary['completed']}/{summary['requests']} ok in {summary['duration_s']:.1f} s: "
        f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s"
    )
    if "goodput" in summary:
        lines.append(
            f"goodput {summary['goodput']:.2f} req/s ({summary['slo_attainment']:.0%} within SLO {summary['slo']})"
        )
    return "\n".join(lines)
