"""vLLM-style request parameters in the serving engine, each against an independent oracle: penalties,
logit_bias and min_tokens against a plain cache-free greedy loop written from their definitions; logprobs
against transformers' log-softmax; speculation keeps both exact; one request's exception fails it alone;
long stop strings stop generation; tiny temperatures are greedy; the server's incremental detokenizer
equals a full decode; a slow reader's mailbox holds one output, not all of them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import runtime.engine as engine_module
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.loader import load_tokenizer, resolve, save_checkpoint
from runtime.model import random_model
from runtime.sampling import SamplingParams, logits_to_probs, process_logits
from runtime.stopping import StopChecker
from speculate.ngram import NgramSpeculator
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def small(**config) -> EngineConfig:
    return EngineConfig(**{"kv_cache_bytes": 1 << 21, "block_size": 4, **config})


def prompts_with_repeats(n: int = 4, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in (6, 9, 13, 4, 11, 7)[:n]:
        span = torch.randint(2, CFG.vocab_size, (length,), generator=gen).tolist()
        out.append(span + span[: length // 2] + span)  # repeats: penalties and prompt lookup both matter
    return out


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], p: SamplingParams, stop_ids: list[int]) -> list[int]:
    """The oracle: a cache-free forward per token, every adjustment applied in float64 Python from its
    definition (vLLM's): min_tokens bans stop ids, then logit_bias, then the repetition penalty over
    prompt + output, then presence / frequency penalties over the output; argmax."""
    out: list[int] = []
    while len(out) < p.max_tokens:
        logits = model(torch.tensor([prompt + out]))[0, -1].double().tolist()
        if len(out) < p.min_tokens:
            for t in stop_ids:
                logits[t] = float("-inf")
        for t, b in p.logit_bias.items():
            logits[t] += b
        for t in set(prompt + out):
            logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
        for t in set(out):
            logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        tok = max(range(len(logits)), key=logits.__getitem__)
        out.append(tok)
        if tok in stop_ids and len(out) >= p.min_tokens:
            break
    return out


PENALIZED = [
    SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=0.7, presence_penalty=-0.3),
    SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=0.6, logit_bias={3: 4.0, 7: -100.0}),
    SamplingParams(max_tokens=20, ignore_eos=True, min_tokens=6, stop_token_ids=[11, 12, 13, 14, 15]),
]


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram-speculation"])
def test_penalties_bias_min_tokens_equal_the_reference(model, speculate):
    """Greedy outputs under every adjustment equal the from-definition oracle, with and without engine
    speculation (penalties see each draft position's own history, so they stay exact)."""
    prompts = prompts_with_repeats()
    spec = NgramSpeculator(k=4) if speculate else None
    for params in PENALIZED:
        engine = LLMEngine(model, config=small(), speculator=spec)
        stop_ids = sorted(set(params.stop_token_ids))
        outs = engine.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            assert out.output_ids == reference_greedy(model, prompt, params, stop_ids), params
        assert engine.block_manager.num_used_blocks == 0
        if speculate:
            assert engine.num_spec_proposed > 0
    plain = LLMEngine(model, config=small()).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert any(o.output_ids != reference_greedy(model, p, PENALIZED[1], []) for o, p in zip(plain, prompts)), (
        "the penalty changes nothing on this workload: the test would not see it ignored"
    )


def test_min_tokens_bans_eos_and_stop_ids_then_allows_them(model):
    """With the model's EOS forced by logit_bias, min_tokens alone decides the length."""
    p = SamplingParams(max_tokens=12, min_tokens=5, logit_bias={CFG.eos_token_ids[0]: 100.0})
    out = LLMEngine(model, config=small()).generate([[5, 6, 7]], p)[0]
    assert len(out.output_ids) == 6 and out.output_ids[-1] == CFG.eos_token_ids[0] and out.finish_reason == "eos"
    assert CFG.eos_token_ids[0] not in out.output_ids[:5]


def test_logprobs_equal_transformers_log_softmax(model, tmp_path):
    """Greedy logprobs (and top-5 and echo's prompt logprobs) are the model's own log-softmax, from an
    independent forward in transformers; engine speculation reports the same target numbers."""
    from transformers import AutoModelForCausalLM

    save_checkpoint(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = prompts_with_repeats(3)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=2, repetition_penalty=1.3)
    for spec in (None, NgramSpeculator(k=4)):
        engine = LLMEngine(model, config=small(), speculator=spec)
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            seq = prompt + out.output_ids
            with torch.inference_mode():
                ref = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)  # [T, V]
            assert len(out.logprobs) == len(out.output_ids)
            for j, lp in enumerate(out.logprobs):
                pos = len(prompt) + j - 1
                assert lp.token == seq[pos + 1]
                assert abs(lp.logprob - ref[pos, lp.token].item()) < 1e-4
                top_v, top_i = ref[pos].topk(5)
                assert [i for i, _ in lp.top] == top_i.tolist()
                assert max(abs(v - w) for (_, v), w in zip(lp.top, top_v.tolist())) < 1e-4
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for pos in range(1, len(prompt)):
                assert abs(out.prompt_logprobs[pos].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            assert abs(out.cumulative_logprob - sum(lp.logprob for lp in out.logprobs)) < 1e-9


def test_tiny_temperatures_sample_greedily(model):
    """1e-40 used to overflow logits / T to inf, softmax to NaN and multinomial to raise."""
    logits = torch.tensor([3.0, -2.0, 2.9999, 0.0])
    for t in (1e-40, 1e-30, 1e-8, 5e-6):
        p = SamplingParams(temperature=t)
        assert p.greedy and torch.equal(logits_to_probs(logits, p), torch.tensor([1.0, 0, 0, 0]))
    assert not SamplingParams(temperature=1e-5).greedy
    assert torch.isfinite(logits_to_probs(logits * 1e3, SamplingParams(temperature=1e-5))).all()
    prompts = prompts_with_repeats(2)
    greedy = [o.output_ids for o in LLMEngine(model, config=small()).generate(prompts, SamplingParams(max_tokens=8))]
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, seed=1)
    assert [o.output_ids for o in LLMEngine(model, config=small()).generate(prompts, tiny)] == greedy


@pytest.mark.parametrize("where", ["sampler", "forward"])
def test_an_exception_for_one_request_fails_it_alone(model, monkeypatch, where):
    """A planted fault for one request (in its logit processing, or in any forward that contains it)
    finishes that request with reason "error"; the others in its batch match the reference, no KV block
    leaks, and the engine keeps serving."""
    prompts = prompts_with_repeats(4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    ref = [generate(model, [p], sp).tokens[0] for p, sp in zip(prompts, params)]
    bad = [9, 9, 9, 9, 9]
    if where == "sampler":
        real = engine_module.process_logits

        def planted(logits, p, prompt_ids, output_ids, stop_ids):
            if prompt_ids == bad and len(output_ids) >= 2:
                raise RuntimeError("planted fault")
            return real(logits, p, prompt_ids, output_ids, stop_ids)

        monkeypatch.setattr(engine_module, "process_logits", planted)
    else:
        engine_cls_forward = LLMEngine._forward

        def planted(self, group):
            if any(w.seq.token_ids[: len(bad)] == bad and w.seq.num_tokens > len(bad) + 1 for w in group):
                raise RuntimeError("planted fault")
            return engine_cls_forward(self, group)

        monkeypatch.setattr(LLMEngine, "_forward", planted)
    engine = LLMEngine(model, config=small())
    outs = engine.generate(prompts[:2] + [bad] + prompts[2:], params[:2] + [params[0]] + params[2:])
    failed = outs.pop(2)
    assert failed.finished and failed.finish_reason == "error" and "planted fault" in failed.error
    assert [o.output_ids for o in outs] == ref
    assert engine.num_failed == 1 and engine.block_manager.num_used_blocks == 0
    assert [o.output_ids for o in engine.generate(prompts[:1], params[:1])] == ref[:1]  # still serving


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(resolve("smollm2-135m")))


def test_stop_string_longer_than_sixteen_tokens_stops_generation(model, tokenizer):
    """The stop check decodes a tail long enough for the longest stop string (it used to decode only
    the last 16 tokens, so a long stop string cut the text but never stopped the engine)."""
    text = " ".join(f"w{i}" for i in range(200))
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    stop = tokenizer.decode(tokens[20:60])  # ~40 tokens long
    p = SamplingParams(max_tokens=500, stop=[stop])
    checker = StopChecker(p, [], tokenizer)
    hits = [n for n in range(1, len(tokens) + 1) if checker.check(tokens[:n]) == "stop"]
    assert hits and hits[0] == 60, hits[:3]
    # the window grows only as far as the stop string needs: the cost does not depend on the length
    calls = []
    real_decode = tokenizer.decode
    checker.tokenizer = type("Counting", (), {"decode": lambda self, ids: calls.append(len(ids)) or real_decode(ids)})()
    checker.check(tokens[:59])
    assert max(calls) <= 128


def test_incremental_detokenizer_equals_a_full_decode(tokenizer):
    from runtime.server import TextAssembler

    text = "Zürich — naïve café 東京 🙂🙂 emoji, spaces  and\nnewlines. " * 3
    ids = tokenizer(text, add_special_tokens=False).input_ids
    gen = torch.Generator().manual_seed(0)
    for _trial in range(3):
        asm, pieces, n = TextAssembler(tokenizer, []), [], 0
        while n < len(ids):  # outputs arrive in chunks of 1-4 tokens
            n = min(len(ids), n + int(torch.randint(1, 5, (1,), generator=gen)))
            pieces.append(asm.delta(ids[:n], final=n == len(ids)))
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in p for p in pieces)
    asm = TextAssembler(tokenizer, ["東京", "zzz"])
    out = "".join(asm.delta(ids[:n], final=False) for n in range(1, len(ids)))
    assert out == text[: text.index("東京")] and asm.stopped


def test_slow_reader_mailbox_holds_only_the_newest_output(model):
    """The engine thread delivers every step's output; a reader that never reads finds one item per
    choice (all tokens so far), not one per step: memory stays O(tokens)."""
    from runtime.server import EngineThread

    async def run():
        thread = EngineThread(LLMEngine(model, config=small()))
        thread.start()
        try:
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            mailbox = await thread.add(["a", "b"], [5, 6, 7], [params, params])
            deadline = time.time() + 60
            while len(mailbox.latest) < 2 or not all(o.finished for o in mailbox.latest.values()):
                assert time.time() < deadline
                await asyncio.sleep(0.05)
            items = await mailbox.get()
            assert sorted(items) == [0, 1] and all(len(o.output_ids) == 60 for o in items.values())
            assert thread.engine.num_steps >= 60  # sixty deliveries per choice were coalesced into one
        finally:
            thread.stop()

    asyncio.run(run())


def test_process_logits_is_a_no_op_without_adjustments():
    logits = torch.randn(10)
    assert process_logits(logits, SamplingParams(), [1, 2], [3], [1]) is logits
