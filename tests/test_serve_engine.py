"""Serving engine vs the plain contiguous-cache generate(): greedy fp32 outputs must be identical under
paging, concurrency, prefix caching, chunked prefill, preemption and static batching."""

from __future__ import annotations

import pytest
import torch

from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata
from runtime.paged_cache import PagedAttentionMetadata, PagedKVCache
from runtime.sampling import SamplingParams
from runtime.scheduler import RequestRejectedError
from runtime.speculation import Proposal
from speculate.base import Speculator


def mixed_requests(vocab: int, n: int = 16, seed: int = 0, max_prompt: int = 60, max_new: int = 40):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for _ in range(n):
        length = int(torch.randint(1, max_prompt, (1,), generator=gen))
        prompts.append(torch.randint(2, vocab, (length,), generator=gen).tolist())
        params.append(SamplingParams(max_tokens=int(torch.randint(1, max_new, (1,), generator=gen)), ignore_eos=True))
    return prompts, params


def small(**config) -> EngineConfig:
    """Engine config with a KV pool sized for tests (the 1 GiB default is for serving)."""
    return EngineConfig(**{"kv_cache_bytes": 1 << 21, **config})


def reference(model, prompts, params):
    """The oracle: each request alone through runtime.generate with the contiguous KVCache."""
    return [generate(model, [p], sp).tokens[0] for p, sp in zip(prompts, params)]


def run_engine(model, prompts, params, **config):
    engine = LLMEngine(model, config=small(**config))
    outs = engine.generate(prompts, params)
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked after all requests finished"
    return [o.output_ids for o in outs], engine


@pytest.fixture(scope="module")
def model():
    from runtime.model import random_model
    from tests.tiny_models import TINY_CONFIGS

    return random_model(TINY_CONFIGS["llama"], seed=0)


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = mixed_requests(model.config.vocab_size)
    return prompts, params, reference(model, prompts, params)


def test_paged_cache_forward_equals_contiguous_cache(model):
    """Same sequence, same shapes: paged writes/reads give the contiguous cache's logits bit for bit
    (the "exact" class on CPU fp32: the gather only moves data, and attention sees the same shapes)."""
    cfg = model.config
    tokens = torch.randint(2, cfg.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    contiguous = KVCache(cfg, 1, 64)
    paged = PagedKVCache(cfg, num_blocks=16, block_size=4)
    table = torch.tensor([[9, 3, 14, 1, 7, 12, 5, 2, 11, 4]])  # scattered on purpose

    def paged_meta(pos: torch.Tensor) -> PagedAttentionMetadata:
        base = AttentionMetadata.causal(pos, kv_len=int(pos.max()) + 1)
        slots = table[0, pos // 4] * 4 + pos % 4
        return PagedAttentionMetadata(
            base.positions, slots, base.mask, base.kv_len, block_tables=table, context_lens=pos[:, -1] + 1
        )

    with torch.inference_mode():
        pos = torch.arange(30)[None]
        a = model(tokens[:, :30], AttentionMetadata.causal(pos, kv_len=30), contiguous)
        b = model(tokens[:, :30], paged_meta(pos), paged)
        assert torch.equal(a, b)
        for t in range(30, 37):
            pos = torch.tensor([[t]])
            a = model(tokens[:, t : t + 1], AttentionMetadata.causal(pos, kv_len=t + 1), contiguous)
            b = model(tokens[:, t : t + 1], paged_meta(pos), paged)
            assert torch.equal(a, b)


def test_one_request_at_a_time_equals_reference(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, config=small(enable_prefix_caching=False))
    for p, sp, expected in zip(prompts[:6], params[:6], ref[:6]):
        assert engine.generate([p], sp)[0].output_ids == expected


def test_sixteen_concurrent_mixed_lengths_equal_reference(model, workload):
    prompts, params, ref = workload
    outs, engine = run_engine(model, prompts, params)
    assert outs == ref
    assert engine.num_steps < sum(len(r) for r in ref)  # they really were batched


def test_chunked_prefill_equals_unchunked(model, workload):
    prompts, params, ref = workload
    chunked, engine = run_engine(model, prompts, params, max_num_batched_tokens=8, enable_prefix_caching=False)
    unchunked, _ = run_engine(model, prompts, params, chunked_prefill=False)
    assert chunked == unchunked == ref
    assert engine.num_prompt_tokens_computed == sum(len(p) for p in prompts)


def test_preemption_under_tiny_kv_budget_equals_reference(model, workload):
    prompts, params, ref = workload
    outs, engine = run_engine(model, prompts, params, num_blocks=26, block_size=4, enable_prefix_caching=False)
    assert engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert outs == ref
    outs, engine = run_engine(model, prompts, params, num_blocks=26, block_size=4, max_num_batched_tokens=8)
    assert engine.scheduler.num_preemptions > 0
    assert outs == ref


def test_static_batching_equals_reference(model, workload):
    prompts, params, ref = workload
    outs, engine = run_engine(model, prompts, params, policy="static", max_num_seqs=5)
    assert outs == ref


def test_prefix_caching_shares_blocks_and_keeps_outputs(model):
    gen = torch.Generator().manual_seed(4)
    system = torch.randint(2, 96, (45,), generator=gen).tolist()
    prompts = [system + torch.randint(2, 96, (int(n),), generator=gen).tolist() for n in (1, 3, 9, 17, 4, 30)]
    prompts.append(list(prompts[2]))  # an exact repeat
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    ref = reference(model, prompts, params)
    without, _ = run_engine(model, prompts, params, enable_prefix_caching=False, block_size=4)
    engine = LLMEngine(model, config=small(block_size=4))
    first = engine.generate(prompts[:1], params[:1])  # warm the cache with the shared prefix
    rest = engine.generate(prompts[1:], params[1:])
    with_cache = [o.output_ids for o in first + rest]
    assert with_cache == without == ref
    assert all(o.num_cached_tokens >= 44 for o in rest), [o.num_cached_tokens for o in rest]
    assert engine.block_manager.prefix_hits > 0 and engine.block_manager.num_used_blocks == 0
    # concurrent requests with a shared prefix also match (blocks registered mid-flight)
    concurrent, engine = run_engine(model, prompts, params, block_size=4, max_num_batched_tokens=16)
    assert concurrent == ref


def test_seeded_sampling_does_not_depend_on_the_batch(model, workload):
    prompts, _, _ = workload
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    alone = LLMEngine(model, config=small()).generate([prompts[3]], sampled)[0].output_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=15, ignore_eos=True) for i in range(len(prompts))]
    others[3] = sampled
    together = LLMEngine(model, config=small()).generate(prompts, others)
    assert together[3].output_ids == alone
    assert alone == generate(model, [prompts[3]], sampled).tokens[0]  # the plain generator's draws too


def test_stream_yields_tokens_and_cancel_frees_blocks(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, config=small(block_size=4))
    streamed = [t for out in engine.stream(prompts[1], params[1]) for t in out.new_token_ids]
    assert streamed == ref[1]
    # interleaved streams, one closed early (cancelled), and an aborted background request
    background = engine.add_request(prompts[2], SamplingParams(max_tokens=30, ignore_eos=True))
    a = engine.stream(prompts[4], params[4])
    b = engine.stream(prompts[5], SamplingParams(max_tokens=30, ignore_eos=True))
    first_b = next(b)
    got_a = []
    for out in a:
        got_a += out.new_token_ids
    assert got_a == ref[4]
    b.close()  # cancels request b
    assert first_b.request_id not in engine.seqs
    assert engine.abort_request(background)
    assert not engine.has_unfinished()
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_used_blocks == 0


def test_stop_conditions_match_generate(model, workload):
    prompts, _, _ = workload
    free = generate(model, [prompts[0]], SamplingParams(max_tokens=20, ignore_eos=True)).tokens[0]
    params = SamplingParams(max_tokens=20, stop_token_ids=[free[6]])
    expected = generate(model, [prompts[0]], params)
    out = LLMEngine(model, config=small()).generate([prompts[0]], params)[0]
    assert out.output_ids == expected.tokens[0] and out.finish_reason == expected.finish_reasons[0] == "stop"


def test_admission_control_rejects_what_can_never_fit(model):
    engine = LLMEngine(model, config=small(num_blocks=5, block_size=4, max_model_len=64))
    with pytest.raises(RequestRejectedError, match="exceeds the maximum context length of 64"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        engine.add_request([3] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match="token ids"):
        engine.add_request([3, 96], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    engine.add_request([3] * 8, SamplingParams(max_tokens=8, ignore_eos=True))  # exactly 4 blocks: fits
    assert len(engine.generate([[4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_ids) == 3


class OracleDrafts(Speculator):
    """A test speculator: drafts from a known continuation with every third token wrong (verified by the
    base class, i.e. the one verifier, greedily here)."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int, k: int):
        self.continuations, self.vocab, self.k = continuations, vocab, k  # prompt -> its greedy output
        self.released: list = []

    def max_tokens_per_step(self) -> int:
        return self.k + 1

    def propose(self, state):
        tokens = torch.zeros(len(state.ids), self.k, dtype=torch.long)
        num = torch.zeros(len(state.ids), dtype=torch.long)
        for b, seq in enumerate(state.token_ids):
            prompt, cont = next((p, c) for p, c in self.continuations.items() if tuple(seq[: len(p)]) == p)
            done = len(seq) - len(prompt)
            draft = [(t + 1) % self.vocab if (done + j) % 3 == 2 else t for j, t in enumerate(cont[done:][: self.k])]
            tokens[b, : len(draft)] = torch.tensor(draft, dtype=torch.long)
            num[b] = len(draft)
        return Proposal(tokens=tokens, num_drafted=num)

    def release(self, ids):
        self.released += ids


def oracle_engine(model, workload, n: int):
    """(prompts, params, greedy references, OracleDrafts, engine) for n of the workload's requests whose prompt
    lengths are unique (OracleDrafts finds a row's continuation by its prompt)."""
    prompts, params, ref = workload
    lengths = [len(p) for p in prompts]
    keep = [i for i in range(len(prompts)) if lengths.count(lengths[i]) == 1][:n]
    prompts, params, ref = [prompts[i] for i in keep], [params[i] for i in keep], [ref[i] for i in keep]
    spec = OracleDrafts({tuple(p): r for p, r in zip(prompts, ref)}, model.config.vocab_size, k=3)
    return prompts, params, ref, spec, LLMEngine(model, config=small(block_size=4), speculator=spec)


def test_speculative_hook_keeps_greedy_outputs(model, workload):
    prompts, params, ref, spec, engine = oracle_engine(model, workload, 8)
    outs = [o.output_ids for o in engine.generate(prompts, params)]
    assert outs == ref
    assert engine.num_spec_accepted > 0 and engine.num_spec_accepted < engine.num_spec_proposed
    assert engine.block_manager.num_used_blocks == 0
    assert sorted(spec.released) == sorted(f"req-{i}" for i in range(len(prompts)))  # every request released


def test_speculative_step_scores_every_row_in_one_head_call(model, workload, monkeypatch):
    """The verification logits of all rows come from one head call per step (the head's weights read once, not
    once per request), with the outputs of each request alone."""
    prompts, params, ref, _, engine = oracle_engine(model, workload, 6)
    head_rows, real = [], model.logits
    monkeypatch.setattr(model, "logits", lambda h: head_rows.append(h.numel() // h.shape[-1]) or real(h))
    verify_rows = []
    real_verify = engine._verify_and_append
    monkeypatch.setattr(engine, "_verify_and_append", lambda *a: verify_rows.append(a[4].shape[0]) or real_verify(*a))
    outs = [o.output_ids for o in engine.generate(prompts, params)]
    assert outs == ref
    assert verify_rows and max(head_rows) > max(verify_rows)  # some head call scored several requests' rows
    assert len(head_rows) <= 2 * engine.num_steps  # one verification call and one plain-sampling call per step


def test_ngram_speculation_in_the_engine_keeps_greedy_outputs(model):
    """The engine step with the shared contract and verifier: sequences of one batch accept different
    numbers of drafts, and greedy outputs equal the plain reference."""
    from speculate.ngram import NgramSpeculator

    gen = torch.Generator().manual_seed(3)
    prompts = []
    for n in (5, 9, 14, 20, 7, 11):  # repeated spans so prompt lookup finds matches
        span = torch.randint(2, model.config.vocab_size, (n,), generator=gen).tolist()
        prompts.append(span + span[: n // 2] + span)
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    ref = reference(model, prompts, params)
    engine = LLMEngine(model, config=small(block_size=4), speculator=NgramSpeculator(k=4))
    assert [o.output_ids for o in engine.generate(prompts, params)] == ref
    assert 0 < engine.num_spec_accepted < engine.num_spec_proposed
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.integration
def test_default_model_concurrent_chat_equals_generate(default_model):
    from runtime.decoding import encode_prompt

    model, tokenizer, _ = default_model
    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain."]
    prompts = [encode_prompt(tokenizer, q, chat=True) for q in questions]
    params = SamplingParams(max_tokens=12)
    ref = [generate(model, [p], params, tokenizer=tokenizer).tokens[0] for p in prompts]
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=24, kv_cache_bytes=1 << 26))
    assert [o.output_ids for o in engine.generate(prompts, params)] == ref
