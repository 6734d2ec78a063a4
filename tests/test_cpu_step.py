"""The compiled CPU step (runtime.kernels.cpu_step) against HF transformers and the Python layers: decode steps,
chain verifications and short prefills, ragged rows, tree masks, contiguous and paged caches, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from patching import spy_on_cpu_step
from test_model import hf_twin
from tolerances import assert_bf16_logits_close

from runtime.decoding import generate
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, random_model
from runtime.sampling import SamplingParams
from tests.tiny_models import tiny_model_config

pytestmark = pytest.mark.skipif(cpu_step.extension() is None, reason="the C++ decode step could not be built here")


@torch.inference_mode()
@pytest.mark.parametrize(
    "batch,prefix,chunk",
    [(1, 40, 1), (2, 290, 1), (2, 40, 3)],  # 2 x 290 keys: the threaded attention branch; 3: chain verification
)
def test_decode_steps_match_transformers(tiny_config, tmp_path, monkeypatch, batch, prefix, chunk):
    check_decode_steps(tiny_config, tmp_path, monkeypatch, batch, prefix, chunk)


@torch.inference_mode()
@pytest.mark.parametrize("head_dim", [48, 96, 128])
def test_head_sizes_match_transformers(tmp_path, monkeypatch, head_dim):
    """The AVX-512 attention is built per head size (6 and 8 chunks of 16 lanes here; 48 takes the generic one)."""
    config = tiny_model_config(head_dim=head_dim, max_position_embeddings=512)
    check_decode_steps(config, tmp_path, monkeypatch, batch=2, prefix=40, chunk=3)


def check_decode_steps(tiny_config, tmp_path, monkeypatch, batch: int, prefix: int, chunk: int) -> None:
    ours = random_model(tiny_config, seed=3)
    hf = hf_twin(ours, tmp_path)
    steps = 6
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_config.vocab_size, (batch, prefix + steps), generator=gen)
    ref = hf(tokens).logits  # the oracle: one full causal forward
    cache = KVCache(tiny_config, batch, prefix + steps)
    ours(tokens[:, :prefix], AttentionMetadata.contiguous(batch, 0, prefix, "cpu"), cache)  # Python prefill
    taken = spy_on_cpu_step(monkeypatch)
    for i in range(prefix, prefix + steps, chunk):
        got = ours(tokens[:, i : i + chunk], AttentionMetadata.contiguous(batch, i, chunk, "cpu"), cache)
        torch.testing.assert_close(got, ref[:, i : i + chunk], atol=2e-5, rtol=1e-4)
    # every layer it implements runs compiled; q/k-norm models (Qwen3) keep the Python layers
    assert taken == [tiny_config.qk_norm is False] * (steps // chunk)


@torch.inference_mode()
def test_short_prefill_matches_transformers(tmp_path):
    from tests.tiny_models import TINY_CONFIGS

    ours = random_model(TINY_CONFIGS["llama"], seed=5)
    hf = hf_twin(ours, tmp_path)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(ours.config, 2, 16)
    got = ours(tokens, AttentionMetadata.contiguous(2, 0, 12, "cpu"), cache)  # 12 <= MAX_TOKENS: compiled
    torch.testing.assert_close(got, hf(tokens).logits, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_fast_and_python_decode_agree_token_for_token(tiny_llama, monkeypatch):
    prompts = [[5, 9, 2, 7, 7, 3, 11, 4], [8, 1, 6, 2, 9, 9, 10, 5]]  # equal lengths: one position per step
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    taken = spy_on_cpu_step(monkeypatch)
    fast = generate(tiny_llama, prompts, params)
    assert taken and all(taken)
    tiny_llama.fast_decode = False
    slow = generate(tiny_llama, prompts, params)
    assert fast.tokens == slow.tokens


@torch.inference_mode()
def test_cached_step_follows_every_weight_change(monkeypatch):
    """The step's compiled model is cached per model and re-checked in full only after a registration (a module or
    weight re-assigned) or a dropped kernel layout; a weight's storage swapped in place (``.data =``) moves its data
    pointer. After each kind of change the step gives the Python layers' logits again; with none, no walk."""
    from runtime.model import Linear
    from runtime.reference.naive_attention import naive_attention
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    model = random_model(cfg, seed=3)
    walks = []
    step_layers = model.step_layers
    monkeypatch.setattr(model, "step_layers", lambda: walks.append(1) or step_layers(), raising=False)
    tokens = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    taken = spy_on_cpu_step(monkeypatch)

    def step_logits(fast: bool) -> torch.Tensor:
        model.fast_decode = fast
        cache = KVCache(cfg, 1, 8)
        model(tokens[:, :5], AttentionMetadata.contiguous(1, 0, 5, "cpu"), cache)
        return model(tokens[:, 5:], AttentionMetadata.contiguous(1, 5, 1, "cpu"), cache)

    def check() -> torch.Tensor:
        fast = step_logits(True)
        torch.testing.assert_close(fast, step_logits(False), atol=2e-5, rtol=1e-4)
        return fast

    before = check()
    built, count = cpu_step.step_model(model), len(walks)
    check()
    assert cpu_step.step_model(model) is built and len(walks) == count  # nothing changed: not walked, not rebuilt
    torch.nn.Linear(2, 2)  # a registration anywhere: one full check, the same StepModel kept
    assert cpu_step.step_model(model) is built and len(walks) == count + 1
    gen, H = torch.Generator().manual_seed(9), cfg.hidden_size
    o_proj, norm = model.layers[0].self_attn.o_proj.weight, model.layers[1].post_attention_layernorm.weight
    changes = [
        lambda: setattr(o_proj, "data", torch.randn(H, H, generator=gen)),  # storage swapped in place
        lambda: setattr(norm, "data", torch.rand(H, generator=gen) + 0.5),
        lambda: setattr(model.layers[1].mlp, "down_proj", Linear(cfg.intermediate_size, H, bias=False)),
    ]
    for change in changes:
        change()
        after = check()
        assert not torch.equal(after, before)
        before = after
    with naive_attention(model):  # attention classes swapped in place: nothing registers, the step must not run
        assert cpu_step.step_model(model) is None
        torch.testing.assert_close(step_logits(True), before, atol=2e-5, rtol=1e-4)
    assert cpu_step.step_model(model) is not None
    # prefill + step: compiled when fast, else the Python layers (and under naive attention)
    assert taken == [True, True, False, False] * 5 + [False, False]


@torch.inference_mode()
def test_ineligible_steps_fall_back(tiny_llama):
    x = torch.zeros(1, 1, tiny_llama.config.hidden_size)
    meta = AttentionMetadata.contiguous(1, 3, 1, "cpu")
    cache = KVCache(tiny_llama.config, 1, 8)
    assert cpu_step.decode(tiny_llama, x, meta, cache) is not None
    assert cpu_step.decode(tiny_llama, x.bfloat16(), meta, cache) is None  # fp32 only
    # metadata that does not say where each row's tokens go (starts) keeps the Python layers
    assert cpu_step.decode(tiny_llama, x, AttentionMetadata.causal(torch.tensor([[3]]), kv_len=4), cache) is None
    with pytest.raises(RuntimeError, match="row 0 runs past the KV cache"):
        cpu_step.decode(tiny_llama, x, AttentionMetadata.contiguous(1, 8, 1, "cpu"), cache)


@torch.inference_mode()
def test_bf16_mixed_steps_stay_within_bf16_noise(monkeypatch):
    """bf16 layers (fp32 residual): the compiled step differs from the Python bf16 layers by less than
    those differ from fp32 (its reductions run in another order, each rounding step is the same)."""
    from tests.tiny_models import TINY_CONFIGS

    cfg, prefix, steps = TINY_CONFIGS["llama"], 70, 6  # a prefix over MAX_TOKENS: prefilled by Python
    fp32 = random_model(cfg, seed=4)
    bf16 = random_model(cfg, seed=4).set_dtype(torch.bfloat16, mixed=True)
    tokens = torch.randint(0, cfg.vocab_size, (1, prefix + steps), generator=torch.Generator().manual_seed(1))
    ref = fp32(tokens)
    caches = {fast: KVCache(cfg, 1, prefix + steps, torch.bfloat16) for fast in (True, False)}
    taken = spy_on_cpu_step(monkeypatch)
    for fast, cache in caches.items():
        bf16.fast_decode = fast
        bf16(tokens[:, :prefix], AttentionMetadata.contiguous(1, 0, prefix, "cpu"), cache)
    fast_vs_python, python_vs_fp32 = 0.0, 0.0
    for i in range(prefix, prefix + steps):
        meta = AttentionMetadata.contiguous(1, i, 1, "cpu")
        bf16.fast_decode = True
        fast = bf16(tokens[:, i : i + 1], meta, caches[True])[:, 0]
        bf16.fast_decode = False
        python = bf16(tokens[:, i : i + 1], meta, caches[False])[:, 0]
        fast_vs_python = max(fast_vs_python, float((fast - python).abs().max()))
        python_vs_fp32 = max(python_vs_fp32, float((python - ref[:, i]).abs().max()))
    assert taken == [True, False] * steps  # bf16 (mixed) steps take it unless the model turns it off
    assert fast_vs_python < python_vs_fp32, (fast_vs_python, python_vs_fp32)


@torch.inference_mode()
def test_prefill_rms_norm_matches_functional():
    x = torch.randn(3, 70, 96, generator=torch.Generator().manual_seed(6)) * 3
    weight = torch.rand(96, generator=torch.Generator().manual_seed(7)) + 0.5
    got = cpu_step.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (96,), weight, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_silu_is_one_function_in_every_family(dtype):
    """The step's SiLU(gate) * up (the MLP's activation): the AVX2 and AVX-512 loops give the same bits (the same
    operations lane by lane; widths with a scalar tail too), and each is the Python layers' F.silu(gate) * up up to
    the exponential's last bits (torch's exp is another polynomial): within one rounding of the dtype."""
    from patching import kernel_family

    ext = cpu_step.extension()
    if ext is None:
        pytest.skip("the CPU step cannot be built here")
    gen = torch.Generator().manual_seed(11)
    for n in (1536, 45, 16):
        gate_up = (torch.randn(3, 2 * n, generator=gen) * 4).to(dtype)
        outs = []
        for family in [f for f in ("avx2", "avx512") if cpu_step.isa_supported(f)]:
            with kernel_family(family):
                outs.append(ext.silu_mul_rows(gate_up))
        assert all(torch.equal(o, outs[0]) for o in outs), n
        gate, up = gate_up.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
        torch.testing.assert_close(outs[0].float(), want.float(), atol=1e-6, rtol=2 * ulp)


@torch.inference_mode()
def test_ragged_rows_match_the_python_layers(tiny_llama, monkeypatch):
    """Prompts of different lengths: every decode step has rows at different positions (one call, per-row
    cache indices), greedy tokens equal to the Python layers'."""
    prompts = [[5, 9, 2], [8, 1, 6, 2, 9, 9, 10, 5, 4, 4, 7], [3, 3, 8, 1, 2, 6]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    taken = spy_on_cpu_step(monkeypatch)
    fast = generate(tiny_llama, prompts, params)
    assert taken and all(taken)
    tiny_llama.fast_decode = False
    try:
        assert generate(tiny_llama, prompts, params).tokens == fast.tokens
    finally:
        tiny_llama.fast_decode = True


BF16_FAMILIES = [f for f in ("avx512", "avx512bf16", "amx") if cpu_step.available() and cpu_step.isa_supported(f)]


@torch.inference_mode()
@pytest.mark.parametrize("family", BF16_FAMILIES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bf16_attention_matches_the_python_layers(family, head_dim, monkeypatch):
    """bf16 caches at the head sizes the AMX attention takes (whole tiles of 32 channels; queries and probabilities
    rounded to bf16, as a bf16 SDPA holds them) and the AVX-512 families' fp32 attention: decode steps, a chain
    verification and a candidate tree over a 37-token prefix (key blocks of 16 and 32 end inside the new tokens),
    against the Python layers' bf16 SDPA over the same cache, within bf16 noise."""
    from patching import kernel_family

    from runtime.speculation import CandidateTree
    from speculate.generate import tree_metadata

    cfg = tiny_model_config(head_dim=head_dim, num_heads=4, num_kv_heads=2, hidden_size=128)
    model = random_model(cfg, seed=6).set_dtype(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, cfg.vocab_size, (1, 37), generator=gen)
    decode = torch.randint(0, cfg.vocab_size, (1, 3), generator=gen)
    chain = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen)
    tree = CandidateTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    nodes = torch.randint(0, cfg.vocab_size, (1, len(tree)), generator=gen)
    outs = {}
    taken = spy_on_cpu_step(monkeypatch)
    with kernel_family(family):
        for fast in (True, False):
            cache = KVCache(cfg, 1, 64, torch.bfloat16)
            model.fast_decode = False  # the same prefix KV for both
            model(prefix, AttentionMetadata.contiguous(1, 0, 37, "cpu"), cache)
            model.fast_decode = fast
            steps = [AttentionMetadata.contiguous(1, 37 + j, 1, "cpu") for j in range(3)]
            got = [model(decode[:, j : j + 1], meta, cache) for j, meta in enumerate(steps)]
            got.append(model(chain, AttentionMetadata.contiguous(1, 40, 5, "cpu"), cache))
            got.append(model(nodes, tree_metadata(tree, torch.tensor([45])), cache))
            outs[fast] = torch.cat([g[0].float() for g in got])
    model.fast_decode = True
    assert taken == [False, True, True, True, True, True] + [False] * 6
    assert_bf16_logits_close(outs[True], outs[False])


@torch.inference_mode()
def test_bf16_attention_reads_pages_as_it_reads_a_contiguous_cache(monkeypatch):
    """The AMX attention loads 16 keys at one stride in place and stages the blocks that cross a page or end the
    context: paged pools of 4-token pages (every block staged) and of 16- and 32-token pages give the same greedy
    tokens over prompts of several lengths, with and without speculative chains."""
    from runtime.engine import EngineConfig, LLMEngine
    from speculate.ngram import NgramSpeculator

    cfg = tiny_model_config(head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=128)
    model = random_model(cfg, seed=6).set_dtype(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    prompts[2][20:] = prompts[2][:20]  # a repeat: the n-gram drafts get accepted
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    taken = spy_on_cpu_step(monkeypatch)
    for speculator in (None, NgramSpeculator(k=3)):
        outputs = []
        for block_size in (4, 16, 32):
            engine = LLMEngine(model, config=EngineConfig(num_blocks=48, block_size=block_size), speculator=speculator)
            outputs.append([o.output_ids for o in engine.generate(prompts, params)])
        assert outputs[0] == outputs[1] == outputs[2]
    assert any(taken)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verification_matches_the_python_layers(tiny_config, dtype, monkeypatch):
    """A branching candidate tree over rows of different lengths: node i at slot L-1+i, position L-1+depth(i),
    attending to its ancestors only (the tree's local mask), in one step call."""
    from runtime.speculation import CandidateTree
    from speculate.generate import tree_metadata

    model = random_model(tiny_config, seed=8)
    if dtype == torch.bfloat16:
        model.set_dtype(torch.bfloat16)
    tree = CandidateTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    lengths = torch.tensor([9, 14])
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, tiny_config.vocab_size, (2, 13), generator=gen)
    nodes = torch.randint(0, tiny_config.vocab_size, (2, len(tree)), generator=gen)
    outs = {}
    taken = spy_on_cpu_step(monkeypatch)
    for fast in (True, False):
        model.fast_decode = fast
        cache = KVCache(tiny_config, 2, 32, dtype)
        model.fast_decode = False  # the same prefix KV for both (Python prefill, ragged)
        model(prefix, AttentionMetadata.contiguous(2, 0, 13, "cpu"), cache)
        model.fast_decode = fast
        outs[fast] = model(nodes, tree_metadata(tree, lengths), cache).float()
    if dtype == torch.float32:
        torch.testing.assert_close(outs[True], outs[False], atol=2e-5, rtol=1e-4)
    else:
        assert_bf16_logits_close(outs[True], outs[False])
    assert taken == [False, tiny_config.qk_norm is False, False, False]  # (prefixes: Python layers)


@torch.inference_mode()
@pytest.mark.parametrize("speculate", [False, True])
def test_paged_engine_matches_the_python_layers(tiny_llama, monkeypatch, speculate):
    """The serving engine's paged pool (block tables, ragged rows, speculative chains) through the step: greedy
    tokens equal to the Python layers' over the same pool."""
    from runtime.engine import EngineConfig, LLMEngine
    from speculate.ngram import NgramSpeculator

    prompts = [[5, 9, 2, 7] * 3, [8, 1, 6, 2, 9], [3, 3, 8, 1, 2, 6, 1, 4] * 2]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = {}
    taken = spy_on_cpu_step(monkeypatch)
    for fast in (True, False):
        tiny_llama.fast_decode = fast
        engine = LLMEngine(tiny_llama, config=EngineConfig(num_blocks=64, block_size=4),
                           speculator=NgramSpeculator(k=3) if speculate else None)  # fmt: skip
        results[fast] = [o.output_ids for o in engine.generate(prompts, params)]
    tiny_llama.fast_decode = True
    assert results[True] == results[False]
    assert any(taken)


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_layers_run_in_the_step(kind, arch, monkeypatch):
    """Quantized linears in the kernels' own layout (QuantLinear / FPLinear "cpu" path) run inside the step and
    give the logits of the same layers run one by one (Python layers, same kernels); qwen2: with q/k/v biases (the
    step's AMX layers add them before rounding their bf16 outputs, the Python layers after the fp32 call)."""
    from dataclasses import replace

    from formats_helpers import rtn_quantize

    from quantize.fplinear import FPLinear, quantize_fp8
    from quantize.qlinear import QuantLinear, set_module
    from runtime.layout import decoder_linear_names
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS[arch]
    model = random_model(cfg, seed=2).set_dtype(torch.bfloat16)
    base = random_model(cfg, seed=2)
    for name in decoder_linear_names(cfg.num_layers):
        w, bias = base.get_submodule(name).weight.detach(), base.get_submodule(name).bias
        if bias is not None:  # 10x random_model's: a bias dropped or added twice shows in the logits
            bias = torch.randn(bias.shape, generator=torch.Generator().manual_seed(len(name)))
        if kind == "fp8":
            fw = quantize_fp8(w, block=32 if "down" in name else 0, bias=bias)
            layer = FPLinear(fw, compute_dtype=torch.bfloat16)
        else:
            qw = rtn_quantize(w, 4 if kind == "int4" else 8, 32 if kind == "int4" else -1, act_order="qkv" in name)
            layer = QuantLinear(replace(qw, bias=bias), compute_dtype=torch.bfloat16)
        set_module(model, name, layer)
    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, FPLinear))]
    assert (arch == "qwen2") == any(m.bias is not None for m in layers)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))
    taken = spy_on_cpu_step(monkeypatch)
    outs = {}
    for fast in (True, False):
        model.fast_decode = fast
        cache = KVCache(cfg, 2, 16, torch.bfloat16)
        model(tokens[:, :8], AttentionMetadata.contiguous(2, 0, 8, "cpu"), cache)
        outs[fast] = model(tokens[:, 8:], AttentionMetadata.contiguous(2, 8, 2, "cpu"), cache)
    assert taken[:2] == [True, True]  # the prefill and the 2-token step both ran compiled
    assert all(m.path == "cpu" for m in layers)
    assert_bf16_logits_close(outs[True], outs[False])
