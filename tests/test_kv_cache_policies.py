"""KV cache formats and policies through the model (runtime.kv_policy, runtime.kv_cache, runtime.paged_cache):
the paged engine and the contiguous cache give the same tokens in every format, speculation and the compiled step
run over quantized caches, quantized caches run in the compiled CPU step (sink + window ones do not), the sink +
window cache equals StreamingLLM's own recipe recomputed here token by token, and the engine holds what its block
budget predicts."""

from __future__ import annotations

import math

import pytest
import torch

from evals.quality.fidelity import cached_scorer
from evals.quality.long_context_measures import capacity, engine_holds, parse_spec, passkey_prompt
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kernels import cpu_step
from runtime.kv_cache import QuantizedKVCache
from runtime.kv_policy import KVCacheSpec, chunked_prefill
from runtime.model import AttentionMetadata, apply_rope, random_model
from runtime.paged_cache import PagedKVCache
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate
from tests.test_spec_generate import repetitive_prompts, speculators
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]
FORMATS = ["auto", "int8", "fp8_e4m3", "int4"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SLOW_FP8 = pytest.param("fp8_e4m3", marks=pytest.mark.slow)  # the same code paths as int8 but the codec


def prompts(lengths=(5, 37, 70), seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_and_contiguous_caches_give_the_same_tokens(fmt):
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec(fmt, block_size=16)  # int4: one key group per engine block
    contiguous = [generate(model, [p], GREEDY, kv_cache=kv).tokens[0] for p in prompts()]
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=64, kv_cache_dtype=fmt, max_num_seqs=4))
    paged = [o.output_ids for o in engine.generate(prompts(), GREEDY)]
    assert paged == contiguous
    assert engine.block_manager.num_used_blocks == 0
    if fmt == "int4":  # every residual slot came back (sealed at the end of each group, or when freed)
        assert sorted(engine.cache.pool.free_open) == list(range(4))
        assert (engine.cache.pool.open_of < 0).all()
    tokens = torch.tensor([prompts()[2]])  # and the format really changed what attention read (auto: it did not)
    change = (cached_scorer(model, kv=kv)(tokens) - model(tokens)).abs().max()
    assert change > 1e-3 if fmt != "auto" else change < 1e-4


@pytest.mark.parametrize("fmt", ["int8", SLOW_FP8])
def test_speculation_over_a_per_token_format_equals_plain_decoding_over_it(fmt):
    """int8 / fp8 codes depend on each token alone: drafts that are rejected and rewritten, and a tree's accepted
    path copied to consecutive slots, leave the same cache as plain decoding."""
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec(fmt, block_size=8)
    batch = repetitive_prompts(3, seed=1)
    plain = generate(model, batch, GREEDY, kv_cache=kv).tokens
    for name in ("ngram", "medusa"):  # a chain and a tree
        spec = speculators(model, 3)[name]
        assert speculative_generate(model, batch, GREEDY, spec, kv_cache=kv).tokens == plain, name
        engine = LLMEngine(model, config=EngineConfig(block_size=8, kv_cache_bytes=1 << 22, kv_cache_dtype=fmt),
                           speculator=spec)  # fmt: skip
        assert [o.output_ids for o in engine.generate(batch, GREEDY)] == plain, name


def test_speculation_over_int4_keeps_draft_groups_open_and_frees_them():
    """Drafts may be rewritten, so int4 keeps the key groups they touch in full precision (the cache's lookahead)
    and a tree's accepted keys are copied within the residual; every residual slot comes back."""
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec("int4", block_size=8)
    batch = repetitive_prompts(3, seed=1)
    for name in ("ngram", "medusa"):
        spec = speculators(model, 3)[name]
        out = speculative_generate(model, batch, GREEDY, spec, kv_cache=kv)
        assert [len(t) for t in out.tokens] == [24] * 3
        engine = LLMEngine(model, config=EngineConfig(block_size=8, kv_cache_bytes=1 << 22, kv_cache_dtype="int4"),
                           speculator=spec)  # fmt: skip
        assert [len(o.output_ids) for o in engine.generate(batch, GREEDY)] == [24] * 3
        pool = engine.cache.pool
        assert engine.block_manager.num_used_blocks == 0 and (pool.open_of < 0).all()
        assert len(pool.free_open) == 16 * 2  # max_num_seqs x (1 + ceil(lookahead / block))


@pytest.mark.parametrize("fmt", ["int8", SLOW_FP8])
def test_compiled_static_cache_matches_the_eager_quantized_cache(fmt):
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec(fmt, block_size=16)
    for p in prompts((37,)):  # "eager": dynamo traces the static step (fullgraph) without compiling kernels
        compiled = generate(model, [p], GREEDY, kv_cache=kv, compile="eager")
        assert compiled.compile == "eager"
        assert compiled.tokens == generate(model, [p], GREEDY, kv_cache=kv, compile="off").tokens


def test_int4_and_sink_window_run_eager():
    model = random_model(CFG, seed=0)
    for kv in (KVCacheSpec("int4"), KVCacheSpec(policy="sink-window", sinks=2, window=16)):
        assert generate(model, prompts()[:1], GREEDY, kv_cache=kv, compile="eager").compile == "off"


@torch.inference_mode()
def test_quantized_caches_run_in_the_compiled_cpu_step_and_sink_window_does_not():
    """int8 / fp8 / int4 caches are read in place by the step (tests/test_cpu_step_kv_quant.py checks its results);
    the sink + window cache evicts and re-rotates: the Python layers run it."""
    model = random_model(CFG, seed=0)
    x = model.embed_tokens(torch.tensor([[3]]))
    for fmt in ("int8", "fp8_e4m3", "int4"):
        cache = QuantizedKVCache(CFG, 1, 32, kv_dtype=fmt, block_size=8)
        ran = cpu_step.decode(model, x, AttentionMetadata.contiguous(1, 0, 1, "cpu"), cache) is not None
        assert ran == cpu_step.available()
    window = KVCacheSpec(policy="sink-window", sinks=2, window=16).build(model, 1, 32)
    assert cpu_step.decode(model, x, AttentionMetadata.contiguous(1, 0, 1, "cpu"), window) is None


def streaming_reference(model, tokens: list[int], sinks: int, window: int) -> torch.Tensor:
    """StreamingLLM's recipe (Xiao et al. 2024, sec. 3.2), token by token: every layer caches keys before rope;
    the cache keeps the first `sinks` tokens and the last `window` (the current one included); at each step rope is
    applied to the cached keys at their positions in the cache, 0..n-1, and to the query at n-1; plain softmax
    attention. -> logits [T, V]."""
    cfg = model.config
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    caches = [([], []) for _ in model.layers]
    out = []
    with torch.inference_mode():
        for tok in tokens:
            x = model.embed_tokens(torch.tensor([[tok]]))
            for layer, (keys, values) in zip(model.layers, caches):
                attn = layer.self_attn
                q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
                keys.append(k.view(Hkv, D))
                values.append(v.view(Hkv, D))
                if len(keys) > sinks + window:  # evict the oldest token that is not a sink
                    del keys[sinks], values[sinks]
                n = len(keys)
                cos, sin = model.rope(torch.arange(n)[None], torch.float32)
                K = apply_rope(torch.stack(keys)[None], cos, sin)[0].repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
                Q = apply_rope(q.view(1, 1, H, D), cos[:, -1:], sin[:, -1:])[0, 0]  # [H, D] at position n-1
                V = torch.stack(values).repeat_interleave(H // Hkv, dim=1)
                probs = (torch.einsum("hd,nhd->hn", Q, K) / math.sqrt(D)).softmax(-1)
                x = x + attn.o_proj(torch.einsum("hn,nhd->hd", probs, V).reshape(1, 1, H * D))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append(model.logits(model.norm(x))[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("sinks,window", [(2, 10), (0, 12)])
def test_sink_window_equals_streaming_llm_recomputed_over_the_kept_tokens(sinks, window):
    model = random_model(CFG, seed=0)
    tokens = prompts((32,), seed=3)[0]
    ref = streaming_reference(model, tokens, sinks, window)
    for chunk in (1, 8):  # token by token, and chunks (the ring holds the window of the chunk's first query)
        cache = KVCacheSpec(policy="sink-window", sinks=sinks, window=window).build(model, 1, len(tokens))
        with torch.inference_mode():
            got = model.logits(chunked_prefill(model, torch.tensor([tokens]), cache, chunk=chunk))[0]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    full = model(torch.tensor([tokens]))[0]
    assert not torch.allclose(ref, full, atol=1e-3)  # eviction changed the model's outputs


def test_speculation_over_a_sink_window_cache_equals_plain_decoding_over_it():
    """Drafts written past the window and rejected, and a tree's path copied within the ring, leave the cache plain
    decoding would have: same tokens (a window of 12 evicts most of each 40-token row)."""
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec(policy="sink-window", sinks=2, window=12)
    batch = repetitive_prompts(3, seed=1)
    plain = generate(model, batch, GREEDY, kv_cache=kv).tokens
    assert plain != generate(model, batch, GREEDY).tokens
    for name in ("ngram", "medusa"):
        assert speculative_generate(model, batch, GREEDY, speculators(model, 3)[name], kv_cache=kv).tokens == plain


def test_sink_window_memory_is_flat_and_a_large_window_is_full_attention():
    model = random_model(CFG, seed=0)
    kv = KVCacheSpec(policy="sink-window", sinks=4, window=64)
    assert kv.build(model, 1, 100).nbytes() == kv.build(model, 1, 10_000).nbytes()
    tokens = torch.tensor(prompts((60,))[0])[None]
    with torch.inference_mode():
        got = model.logits(chunked_prefill(model, tokens, kv.build(model, 1, 60)))
    torch.testing.assert_close(got, model(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_engine_holds_what_its_block_budget_predicts(fmt):
    model = random_model(CFG, seed=0)
    per_block = PagedKVCache.bytes_per_block(CFG, 8, torch.float32, fmt)
    # codes + scales by hand: int8 one fp16 scale per token and head; int4 nibbles, per-token value scale + min,
    # per-channel key scale + min per block
    by_hand = {"auto": 8 * 2 * 16 * 4, "int8": 8 * 2 * (16 + 2), "int4": 8 * 16 + 8 * 4 + 16 * 4}[fmt]
    assert per_block == CFG.num_layers * CFG.num_kv_heads * by_hand
    cap = capacity(CFG, torch.float32, fmt, 48 << 10, 40, 8)
    assert cap.concurrent_sequences >= 2
    fits = engine_holds(model, cap, 30, cap.concurrent_sequences)
    assert fits["peak_running"] == cap.concurrent_sequences and fits["preemptions"] == 0
    over = engine_holds(model, cap, 30, cap.concurrent_sequences + 1)
    assert over["peak_running"] <= cap.concurrent_sequences or over["preemptions"] > 0


def test_kv_specs_and_cli_names():
    assert parse_spec("int4") == KVCacheSpec("int4")
    assert parse_spec("sink-window") == KVCacheSpec(policy="sink-window", sinks=4, window=1020)
    assert parse_spec("int8+sink-window:2+30") == KVCacheSpec("int8", "sink-window", 2, 30)
    assert not KVCacheSpec().approximate and KVCacheSpec("int8").approximate
    assert "approximate" in KVCacheSpec(policy="sink-window").label()
    with pytest.raises(ValueError, match="kv cache dtype must be one of"):
        KVCacheSpec("int3")
    with pytest.raises(ValueError, match="sink-window with int4"):
        KVCacheSpec("int4", "sink-window")
    with pytest.raises(ValueError, match="sink-window sizes"):
        parse_spec("sink-window:4")


def test_passkey_prompt_plants_the_key_at_the_depth(default_model):
    _, tokenizer, _ = default_model
    filler = list(range(1000, 3000))
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tokenizer, filler, 512, depth, "48213")
        assert len(ids) == 512
        text = tokenizer.decode(ids)
        assert text.count("48213") == 2 and text.endswith("48213 is the pass key.\n\nThe pass key is") == (depth == 1)
        assert text.endswith("\nThe pass key is")
        needle = tokenizer("\nThe pass key is", add_special_tokens=False).input_ids
        first = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
        assert abs(first - depth * (512 - 40)) < 40
