"""Honest clocks: every loop's TTFT plus the sum of its step times is the call's wall time (each step is timed
whole: forward, lm_head, sampling, stopping, syncs), and the latency figures follow vLLM's definitions."""

from __future__ import annotations

import time

import pytest
import torch

from evals.serving.metrics import RequestRecord
from evals.speculation.cost_model import FixedDrafts
from runtime import timing
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from tests.tiny_models import tiny_model_config

CONFIG = tiny_model_config(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                           max_position_embeddings=1024)  # fmt: skip
TOKENS = 96


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=11)


def prompts(n: int, length: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # a repeating pattern, so n-gram drafts are accepted now and then (steps commit several tokens)
    return [(torch.randint(2, CONFIG.vocab_size, (8,), generator=gen).tolist() * length)[:length] for _ in range(n)]


def wall(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def assert_covers(t: timing.LoopTiming, wall_s: float, steps: int) -> None:
    """TTFT + sum of whole-step times within 3 % of the call's wall time, one step time per step."""
    assert len(t.step_times_s) == steps - 1
    covered = t.ttft_s + sum(t.step_times_s)
    assert abs(covered - wall_s) <= 0.03 * wall_s, (covered, wall_s)


def test_vllm_definitions_from_token_times():
    times = [1.0, 1.5, 1.5, 2.5]  # a step that committed two tokens: they arrive together
    assert timing.ttft(0.25, times) == 0.75
    assert timing.tpot(times) == pytest.approx((2.5 - 1.0) / 3)
    assert timing.tpot(times, end=4.0, tokens=4) == pytest.approx((4.0 - 1.0) / 3)
    assert timing.tpot([1.0]) is None and timing.ttft(0.0, []) is None
    assert timing.itls(times) == [0.5, 0.0, 1.0]
    rec = RequestRecord(send_time=0.25, token_times=times, end_time=4.0, output_tokens=4)
    assert (rec.ttft, rec.tpot, rec.itls) == (timing.ttft(0.25, times), 1.0, timing.itls(times))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("use_cache", [True, False])
def test_plain_loop_clock_covers_the_call(model, batch, use_cache):
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.7, seed=1)
    rows = prompts(batch)
    generate(model, rows, SamplingParams(max_tokens=2))  # warm up
    out, wall_s = wall(lambda: generate(model, rows, params, use_cache=use_cache))
    assert_covers(out.timing, wall_s, TOKENS)
    assert [len(t) for t in out.timing.token_times] == [TOKENS] * batch
    assert out.timing.tpot_s == pytest.approx(sum(out.timing.step_times_s) / (TOKENS - 1))
    assert out.timing.tokens_per_s == pytest.approx(batch * TOKENS / out.timing.wall_s)


def test_plain_loop_clock_includes_the_lm_head_and_sampling(model):
    """Every step time holds the lm_head's time (here 2 ms more per call), and the profiled phases (forward,
    lm_head, sampling) lie inside the call; the old clock timed the forward alone, so a slow head showed in no
    figure."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    slow = 0.002

    class SlowHead(torch.nn.Module):  # an lm_head that takes 2 ms more per call
        def __init__(self, head):
            super().__init__()
            self.head, self.compute_dtype = head, head.weight.dtype

        def forward(self, x):
            time.sleep(slow)
            return self.head(x)

    base = generate(model, prompts(1), params)
    real = model.lm_head
    model.lm_head = SlowHead(real)
    try:
        out = generate(model, prompts(1), params, profile=True)
    finally:
        model.lm_head = real
    assert out.tokens == base.tokens
    assert min(out.timing.step_times_s) >= slow and out.timing.ttft_s >= slow
    phases = out.timing.phase_s
    assert set(phases) == {"forward", "lm_head", "sampling"}
    assert phases["lm_head"] >= 32 * slow
    assert sum(phases.values()) <= out.timing.wall_s


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_loop_clock_covers_the_call(model, tree):
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    spec = FixedDrafts(3, CONFIG.vocab_size, tree=tree) if tree else NgramSpeculator(k=4)
    rows = prompts(2)
    speculative_generate(model, rows, SamplingParams(max_tokens=4), spec, compile="off")  # warm up
    out, wall_s = wall(lambda: speculative_generate(model, rows, params, spec, compile="off"))
    assert_covers(out.timing, wall_s, out.stats.steps + 1)
    times = out.timing.token_times
    assert [len(t) for t in times] == [TOKENS] * 2
    if not tree:  # n-gram drafts were accepted: some steps committed several tokens, which arrive together
        assert out.stats.accepted > 0 and any(b == a for t in times for a, b in zip(t, t[1:]))


@pytest.mark.parametrize("speculate", [False, True])
def test_engine_clock_covers_the_call(model, speculate):
    engine = LLMEngine(
        model, config=EngineConfig(num_blocks=256), speculator=NgramSpeculator(k=4) if speculate else None
    )
    row = prompts(1)[0]
    engine.generate([row], SamplingParams(max_tokens=4))  # warm up
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    (out,), wall_s = wall(lambda: engine.generate([row], params))
    covered = out.ttft_s + sum(timing.itls(out.token_times))
    assert len(out.token_times) == TOKENS
    assert abs(covered - wall_s) <= 0.03 * wall_s, (covered, wall_s)
    m = engine.metrics()
    assert m["request_ttft_seconds_count"] == 2 and m["request_tpot_seconds_count"] == 2
    e2e_last = out.token_times[-1] - out.arrival_time
    assert m["request_e2e_seconds_sum"] >= e2e_last
