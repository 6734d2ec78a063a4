"""evals.speculation.bench_engine_spec on a tiny random pair: every request's greedy tokens equal its tokens decoded
alone, in a plain batch and with a draft, and the record's figures are consistent."""

from __future__ import annotations

import pytest
import torch

from evals.speculation import bench_engine_spec as bench
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.draft import DraftModelSpeculator, quantized_draft
from tests.tiny_models import tiny_model_config


def test_requests_decode_alike_alone_batched_and_speculated():
    cfg = tiny_model_config(vocab_size=96, eos_token_ids=[1])
    model = random_model(cfg, seed=3).set_dtype(torch.bfloat16)
    spec = DraftModelSpeculator(model, quantized_draft(model, 8), k=3, min_confidence=0.05)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (5 + i,), generator=gen).tolist() for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [bench.run_batch(model, None, [p], params)[0][0] for p in prompts]
    level = bench.measure_level(model, None, prompts, params, spec, alone, rounds=2, log=lambda m: None)
    assert level["plain_equals_alone"] and level["draft_equals_alone"]
    assert level["concurrency"] == 4 and level["output_tokens_per_round"] == 4 * 12
    assert level["ratio"] == pytest.approx(level["draft_tok_per_s"] / level["plain_tok_per_s"])
    assert 0 <= level["acceptance"] <= 1
    wrong = [a[:-1] + [(a[-1] + 1) % 96] for a in alone]  # a reference that differs in one token per request
    level = bench.measure_level(model, None, prompts, params, spec, wrong, rounds=1, log=lambda m: None)
    assert not level["plain_equals_alone"] and not level["draft_equals_alone"]
