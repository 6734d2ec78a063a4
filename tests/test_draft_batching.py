"""A draft model's rows share one forward where the backend's step is row-independent (the CPU step): the drafts and
their q are the same bits as each row's own forward, and the batched call really is one call (the engine's draft
cost at C concurrent requests is one pass, not C). Where the backend is not row-independent (the plain layers),
each row keeps its own forward."""

from __future__ import annotations

import pytest
import torch

from runtime.backends import PLAIN, use_backend
from runtime.kernels import cpu_step
from runtime.model import random_model
from runtime.sampling import SamplingParams
from runtime.speculation import SpecState
from speculate.draft import DraftModelSpeculator
from tests.tiny_models import tiny_model_config

pytestmark = pytest.mark.skipif(not cpu_step.available(), reason="the C++ decode step could not be built here")
CFG = tiny_model_config(max_position_embeddings=512)


def propose(spec: DraftModelSpeculator, prompts: list[list[int]], seed: int = 7):
    params = [SamplingParams(temperature=0.8, seed=seed + b) for b in range(len(prompts))]
    gens = [torch.Generator().manual_seed(seed + b) for b in range(len(prompts))]
    state = SpecState(ids=list(range(len(prompts))), token_ids=prompts, hidden=None, params=params, generators=gens)
    with torch.no_grad():  # as in every decoding loop
        return spec.propose(state)


def count_forwards(model) -> list[int]:
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(args[0].shape[0]), with_kwargs=True)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_draft_rows_equal_each_row_alone(dtype):
    target = random_model(CFG, seed=0).set_dtype(dtype)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 2, 14)]  # ragged: different cache lengths per row
    alone = []
    for b, p in enumerate(prompts):
        spec = DraftModelSpeculator(target, random_model(CFG, seed=1).set_dtype(dtype), k=3)
        alone.append(propose(spec, [p], seed=7 + b))
    draft = random_model(CFG, seed=1).set_dtype(dtype)
    calls = count_forwards(draft)
    batched = propose(DraftModelSpeculator(target, draft, k=3), prompts)
    for b, one in enumerate(alone):
        assert torch.equal(batched.tokens[b], one.tokens[0])
        assert torch.equal(batched.draft_probs[b], one.draft_probs[0])  # q: the same bits, not just the same draws
    assert calls and all(rows == len(prompts) for rows in calls)  # every draft forward took all rows at once


def test_plain_layers_keep_one_forward_per_row():
    target = random_model(CFG, seed=0)
    draft = random_model(CFG, seed=1)
    calls = count_forwards(draft)
    with use_backend(PLAIN):
        propose(DraftModelSpeculator(target, draft, k=2), [[3, 4, 5], [6, 7]])
    assert calls and all(rows == 1 for rows in calls)
