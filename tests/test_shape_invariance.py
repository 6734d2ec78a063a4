"""Shape-invariant verification (issue 37): the target's logits for a position are the same bits whether a step
computes it alone (a 1-token decode step), as row j of a (k+1)-token chain verification, as a node of a candidate
tree, or beside other sequences (a batch with other cache lengths, more rows than one kernel call takes), for every
CPU kernel family this machine runs and every weight format the compiled CPU step runs (fp32, bf16, int8, int4,
fp8). Then greedy speculative decoding equals plain greedy decoding token for token, in bf16 and int4 too.

The end-to-end checks use a model built to have near-ties everywhere (every lm_head row has a twin a hair away), so
any difference in the last bits of a hidden state flips a greedy token: before the fix (attention's softmax summed
in a length-dependent order, the final norm and the lm_head switching implementations above 64 rows) they fail."""

from __future__ import annotations

import copy

import pytest
import torch
from patching import kernel_family, kv_pieces

from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, random_model
from runtime.speculation import CandidateTree
from tests.tiny_models import TINY_CONFIGS, tiny_model_config

ext = cpu_step.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ decode step could not be built here")
FAMILIES = [f for f in ("avx2", "avx512", "avx512bf16", "amx") if ext is not None and cpu_step.isa_supported(f)]
FAMILIES += ["amx-dense"] if "amx" in FAMILIES else []  # amx: the default policy (every layer); -dense: dense ones
# int4-fp32: int4 codes, fp32 activations; w8a8 / w4a8: int8 / int4 codes, int8 activations (per token, dynamic)
FORMATS = ["fp32", "bf16", "int8", "int4", "fp8", "int4-fp32", "w8a8", "w4a8"]
K = 4  # drafts per step: chains of K + 1 rows


@pytest.fixture(params=FAMILIES)
def family(request):
    with kernel_family(request.param):
        yield request.param


def build(fmt: str, cfg, seed: int = 0, std: float = 0.1, head_dtype: torch.dtype | None = None):
    """A random model in a weight format: dense fp32, bf16 (mixed: fp32 residual), or its decoder linears
    quantized (RTN int8 per channel / int4 g32 with act-order on qkv / fp8 e4m3) in the CPU step's layout."""
    model = random_model(cfg, seed=seed, std=std)
    if fmt == "fp32":
        return model
    compute = torch.float32 if fmt.endswith("-fp32") else torch.bfloat16
    if compute == torch.bfloat16:
        model.set_dtype(torch.bfloat16, head_dtype=head_dtype)
    if fmt == "bf16":
        return model
    from formats_helpers import rtn_quantize

    from quantize.fplinear import FPLinear, quantize_fp8
    from quantize.qlinear import QuantLinear, set_module
    from runtime.layout import decoder_linear_names

    for name in decoder_linear_names(cfg.num_layers):
        w = model.get_submodule(name).weight.detach().float()
        if fmt == "fp8":
            layer = FPLinear(quantize_fp8(w, block=32 if "down" in name else 0), compute_dtype=compute)
        else:
            bits = 8 if fmt in ("int8", "w8a8") else 4
            qw = rtn_quantize(w, bits, -1 if bits == 8 else 32, act_order="qkv" in name)
            layer = QuantLinear(qw, act_quant=fmt.startswith("w"), compute_dtype=compute, path="cpu")
        set_module(model, name, layer)
    return model


def near_tie_head(model, eps: float = 1e-6) -> None:
    """Give every odd lm_head row the even row before it plus eps-relative noise: every greedy choice is then a
    near-tie, decided by the last bits of the hidden state (the head must be fp32: a 16-bit head rounds ties away)."""
    with torch.no_grad():
        w = model.lm_head.weight
        assert w.dtype == torch.float32
        noise = torch.randn(w[1::2].shape, generator=torch.Generator().manual_seed(9))
        w[1::2] = w[0::2] + eps * w.abs().mean() * noise


# ---- one position's logits, computed every way ------------------------------------------------------------------


def prefill(model, tokens: list[int], capacity: int) -> KVCache:
    cache = KVCache(model.config, 1, capacity, model.compute_dtype)
    model(torch.tensor([tokens]), AttentionMetadata.contiguous(1, 0, len(tokens), "cpu"), cache, hidden_only=True)
    return cache


def copy_cache(cache: KVCache) -> KVCache:
    out = copy.copy(cache)
    out.k, out.v = cache.k.clone(), cache.v.clone()
    return out


def decode_steps(model, cache, start: int, cont: list[int]) -> torch.Tensor:
    """(a) one token per step: the plain decoding reference, logits [len(cont), V]."""
    out = []
    for j, tok in enumerate(cont):
        meta = AttentionMetadata.contiguous(1, start + j, 1, "cpu")
        out.append(model.logits(model(torch.tensor([[tok]]), meta, cache, hidden_only=True))[0, 0])
    return torch.stack(out)


def chain_step(model, cache, start: int, cont: list[int]) -> torch.Tensor:
    """(b) every token of cont in one (k+1)-row verification step."""
    meta = AttentionMetadata.contiguous(1, start, len(cont), "cpu")
    return model.logits(model(torch.tensor([cont]), meta, cache, hidden_only=True))[0]


def tree_step(model, cache, start: int, cont: list[int], width: int) -> torch.Tensor:
    """(c) cont as the first branch of a candidate tree with `width - 1` random siblings at every depth (they sit
    between the chain's nodes, masked out of their attention), in one tree verification step."""
    from speculate.generate import tree_metadata

    chain = [(0,) * d for d in range(1, len(cont))]
    siblings = [(0,) * (d - 1) + (r,) for d in range(1, len(cont)) for r in range(1, width)]
    tree = CandidateTree.from_choices(chain + siblings + [(1, 0)])
    index = {c: i for i, c in enumerate(tree.choices)}
    nodes = torch.randint(0, model.config.vocab_size, (1, len(tree)), generator=torch.Generator().manual_seed(1))
    for d, tok in enumerate(cont):
        nodes[0, index[(0,) * d]] = tok
    logits = model.logits(model(nodes, tree_metadata(tree, torch.tensor([start + 1])), cache, hidden_only=True))[0]
    return logits[[index[(0,) * d] for d in range(len(cont))]]


def batch_steps(model, rows: list[list[int]], conts: list[list[int]], capacity: int, row: int, chain: bool):
    """(d) the row among other sequences (each prefilled alone, other cache lengths): one step per token for all
    rows (ragged decode) or one chain verification of every row's continuation. Logits of `row`."""
    cache = KVCache(model.config, len(rows), capacity, model.compute_dtype)
    for b, tokens in enumerate(rows):
        alone = prefill(model, tokens, capacity)
        cache.k[:, b], cache.v[:, b] = alone.k[:, 0], alone.v[:, 0]
    lengths = torch.tensor([len(r) for r in rows])
    T = len(conts[0])
    steps = [(0, T)] if chain else [(j, 1) for j in range(T)]
    out = []
    for j, n in steps:
        positions = lengths[:, None] + j + torch.arange(n)[None]
        meta = AttentionMetadata.causal(positions, kv_len=int(positions.max()) + 1)
        meta.starts = lengths + j
        tokens = torch.tensor([c[j : j + n] for c in conts])
        out.append(model.logits(model(tokens, meta, cache, hidden_only=True))[row])
    return torch.cat(out)


def assert_same_bits(ref: torch.Tensor, got: torch.Tensor, what: str) -> None:
    diff = float((ref - got).abs().max())
    assert torch.equal(ref, got), f"{what}: the logits differ (max |diff| {diff:.3g})"


@torch.inference_mode()
@pytest.mark.parametrize("fmt", FORMATS)
def test_position_logits_do_not_depend_on_the_step_shape(family, fmt):
    cfg = TINY_CONFIGS["llama"]
    model = build(fmt, cfg, seed=2)
    gen = torch.Generator().manual_seed(5)
    V = cfg.vocab_size
    # a prefix of 13: the chain's key counts (14..18) cross the attention's 8- and 16-lane blocks
    tokens = torch.randint(2, V, (13 + K + 1,), generator=gen).tolist()
    prefix, cont = tokens[:13], tokens[13:]
    capacity = 13 + 80
    base = prefill(model, prefix, capacity)
    ref = decode_steps(model, copy_cache(base), 13, cont)
    assert_same_bits(ref, chain_step(model, copy_cache(base), 13, cont), "chain")
    assert_same_bits(ref, tree_step(model, copy_cache(base), 13, cont, width=2), "tree")
    assert_same_bits(ref, tree_step(model, copy_cache(base), 13, cont, width=17), "tree of 70 nodes")
    others = [torch.randint(2, V, (n,), generator=gen).tolist() for n in (20, 6)]
    other_conts = [torch.randint(2, V, (K + 1,), generator=gen).tolist() for _ in others]
    rows, conts = [others[0], prefix, others[1]], [other_conts[0], cont, other_conts[1]]
    assert_same_bits(ref, batch_steps(model, rows, conts, capacity, 1, chain=False), "batch of decode steps")
    assert_same_bits(ref, batch_steps(model, rows, conts, capacity, 1, chain=True), "batch of chains")
    # 14 rows x 5 tokens: 70 rows in one step, more than one kernel call (MAX_ROWS) or one head call takes
    many = [torch.randint(2, V, (9 + i,), generator=gen).tolist() for i in range(13)]
    many_conts = [torch.randint(2, V, (K + 1,), generator=gen).tolist() for _ in many]
    rows, conts = many[:6] + [prefix] + many[6:], many_conts[:6] + [cont] + many_conts[6:]
    assert_same_bits(ref, batch_steps(model, rows, conts, capacity, 6, chain=True), "batch of 70 rows")


@pytest.fixture
def pieces_of_6():
    """The attention's long-context split (key ranges of g_kv_piece keys, each query's pieces merged) every 6 keys:
    the prefix of 13 and the chain's 14..18 keys cross piece boundaries inside the new tokens."""
    with kv_pieces(6):
        yield


@torch.inference_mode()
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_position_logits_are_shape_invariant_with_pieces(family, fmt, pieces_of_6):
    """A full-precision cache split into pieces (AVX-512; AVX2's attention takes the whole context): still the same
    bits in every step shape."""
    test_position_logits_do_not_depend_on_the_step_shape(family, fmt)


@torch.inference_mode()
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_pieces_merge_to_the_whole_attention(family, fmt):
    """Decoding over a full-precision cache split every 6 keys gives the unsplit logits within summation-order noise
    (fp32: 1e-5 of the logits' scale; bf16: a bf16 ulp of the activations moves a logit by ~0.02 here), and on
    AVX-512 not the same bits in fp32 (the split ran)."""
    cfg = TINY_CONFIGS["llama"]
    model = build(fmt, cfg, seed=2)
    tokens = torch.randint(2, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    base = prefill(model, tokens[:25], 40)
    whole = decode_steps(model, copy_cache(base), 25, tokens[25:])
    with kv_pieces(6):
        split = decode_steps(model, copy_cache(base), 25, tokens[25:])
    scale = float(whole.abs().max())
    assert float((split - whole).abs().max()) <= (1e-5 if fmt == "fp32" else 0.05) * scale
    if fmt == "fp32" and family != "avx2":
        assert not torch.equal(split, whole)


@torch.inference_mode()
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_rope_final_norm_and_head_are_row_invariant(head_dtype):
    """The Python parts of a step (rope tables, the final norm, the lm_head) give a row the same bits in a call of
    1 row as in a call of 100 (more than the kernels' MAX_ROWS)."""
    cfg = tiny_model_config(head_dim=64, num_heads=2, num_kv_heads=1, hidden_size=128, rope_theta=1e6)
    model = random_model(cfg, seed=1)
    if head_dtype == torch.bfloat16:
        model.set_dtype(torch.bfloat16)
    positions = torch.arange(3, 103)[None]
    cos, sin = model.rope(positions, model.compute_dtype)
    for i in (0, 37, 99):
        one_cos, one_sin = model.rope(positions[:, i : i + 1], model.compute_dtype)
        assert torch.equal(one_cos[0, 0], cos[0, i]) and torch.equal(one_sin[0, 0], sin[0, i])
    x = torch.randn(100, cfg.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
    normed = model.norm(x)
    logits = model.logits(normed)
    for i in (0, 64, 99):
        assert torch.equal(model.norm(x[i : i + 1])[0], normed[i])
        assert torch.equal(model.logits(normed[i : i + 1])[0], logits[i])
        assert torch.equal(model.logits(normed[i : i + 5])[0], logits[i])


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_rope_rows_are_model_rope(dtype):
    """The step reads rope rows from a table of model.rope over blocks of positions: each row is model.rope's own
    value for that position, bit for bit, before and after the table grows past its first block."""
    cfg = tiny_model_config(head_dim=64, num_heads=2, num_kv_heads=1, hidden_size=128, rope_theta=1e6)
    model = random_model(cfg, seed=1)
    if dtype == torch.bfloat16:
        model.set_dtype(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for top in (40, 3000):  # the second call grows the table past ROPE_TABLE_BLOCK
        positions = torch.randint(0, top, (3, 4), generator=gen)
        meta = AttentionMetadata.causal(positions, kv_len=top)
        cos, sin = cpu_step.step_rope(model, meta, 12)
        want_cos, want_sin = model.rope(positions, model.compute_dtype)
        assert torch.equal(cos, want_cos.reshape(12, -1)) and torch.equal(sin, want_sin[:, :, 0, 1].reshape(12, -1))
    assert cpu_step._ROPE_TABLES[model][model.compute_dtype][0].shape[0] >= 3000


def test_amx_row_policy():
    """AMX's default policy is row-invariant ("exact": every layer it fits, quantized ones too, at every row count);
    "dense" (dense bf16 layers only), "approximate" (from AMX_MIN_ROWS rows only) and "off" are asked for by name."""
    assert ext.amx_mode() == "exact"
    try:
        for mode in ("dense", "approximate", "off", "exact"):
            ext.set_amx(mode)
            assert ext.amx_mode() == mode
        with pytest.raises(RuntimeError, match="AMX row policy"):
            ext.set_amx("fast")
    finally:
        ext.set_amx("exact")


@pytest.mark.skipif(ext is None or not cpu_step.isa_supported("amx"), reason="no AMX on this CPU")
def test_amx_policies_choose_their_kernels():
    """Each policy runs the kernels it names (the tiles sum in another order, so the bits tell): dense bf16 layers on
    tiles at every row count under dense and exact, quantized ones under exact only, both from AMX_MIN_ROWS rows
    under approximate, neither under off."""
    from formats_helpers import rtn_quantize

    from quantize.qlinear import QuantLinear

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    handles = {
        "dense": cpu_step.dense_handle(w.bfloat16()),
        "int4": cpu_step.weight_handle(
            QuantLinear(rtn_quantize(w, 4, 32), compute_dtype=torch.bfloat16, path="cpu"), torch.bfloat16
        ),
    }
    x = torch.randn(ext.AMX_MIN_ROWS, 256, generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("off", "dense", "exact", "approximate"):
        with cpu_step.amx_policy(mode):
            out[mode] = {kind: (ext.linear(h, x[:1])[0], ext.linear(h, x)[0]) for kind, h in handles.items()}

    def on_tiles(mode, kind):  # (1-row call, AMX_MIN_ROWS-row call): whether the row's bits left the vector kernels'
        return tuple(not torch.equal(a, b) for a, b in zip(out[mode][kind], out["off"][kind]))

    got = {mode: {kind: on_tiles(mode, kind) for kind in handles} for mode in ("dense", "exact", "approximate")}
    assert got == {
        "dense": {"dense": (True, True), "int4": (False, False)},
        "exact": {"dense": (True, True), "int4": (True, True)},
        "approximate": {"dense": (False, True), "int4": (False, True)},
    }


# ---- end to end: greedy speculation == plain greedy ---------------------------------------------------------------


def near_tie_model(fmt: str):
    cfg = tiny_model_config(vocab_size=256, hidden_size=128, intermediate_size=256, head_dim=32,
                            max_position_embeddings=512)  # fmt: skip
    model = build(fmt, cfg, seed=1, std=0.05, head_dtype=torch.float32)
    near_tie_head(model)
    return model


def prompts(vocab: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (int(length),), generator=gen).tolist() for length in torch.randint(5, 30, (n,))]


@torch.inference_mode()
@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp32"])
def test_greedy_speculation_equals_plain_greedy(fmt):
    """A draft model (the target's own copy, so drafts are long and accepted often) with k=4, one prompt at a time
    and a static batch of 16 (80 rows per verification), against plain greedy decoding, token for token."""
    from runtime.decoding import generate
    from runtime.sampling import SamplingParams
    from speculate.draft import DraftModelSpeculator
    from speculate.generate import speculative_generate

    model = near_tie_model(fmt)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    batch = prompts(model.config.vocab_size, 16)
    for prompt in batch[:3]:
        plain = generate(model, [prompt], params).tokens
        spec = speculative_generate(model, [prompt], params, DraftModelSpeculator(model, copy.deepcopy(model), k=K))
        assert spec.tokens == plain
        assert spec.stats.accepted > 0
    plain = generate(model, batch, params).tokens
    spec = speculative_generate(model, batch, params, DraftModelSpeculator(model, copy.deepcopy(model), k=K)).tokens
    assert [b for b in range(len(batch)) if spec[b] != plain[b]] == []


@torch.inference_mode()
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_engine_speculation_equals_plain_greedy(fmt):
    """The serving engine (paged pool, requests batched together) with and without a k=4 speculator."""
    from runtime.engine import EngineConfig, LLMEngine
    from runtime.sampling import SamplingParams
    from speculate.draft import DraftModelSpeculator

    model = near_tie_model(fmt)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batch = prompts(model.config.vocab_size, 6)
    outs = {}
    for speculate in (False, True):
        speculator = DraftModelSpeculator(model, copy.deepcopy(model), k=K) if speculate else None
        engine = LLMEngine(model, config=EngineConfig(num_blocks=128, block_size=8), speculator=speculator)
        outs[speculate] = [o.output_ids for o in engine.generate(batch, params)]
    assert outs[True] == outs[False]


@pytest.mark.integration
@torch.inference_mode()
def test_default_model_bf16_position_logits(default_model):
    """SmolLM2-135M in bf16 (mixed), on this machine's best family: chain, tree and batch logits of a position are a
    decode step's, bit for bit."""
    model = copy.deepcopy(default_model[0]).set_dtype(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    tokens = torch.randint(2, V, (29 + K + 1,), generator=gen).tolist()
    prefix, cont = tokens[:29], tokens[29:]
    capacity = 29 + 48
    base = prefill(model, prefix, capacity)
    ref = decode_steps(model, copy_cache(base), 29, cont)
    assert_same_bits(ref, chain_step(model, copy_cache(base), 29, cont), "chain")
    assert_same_bits(ref, tree_step(model, copy_cache(base), 29, cont, width=3), "tree")
    others = [torch.randint(2, V, (n,), generator=gen).tolist() for n in (36, 11)]
    other_conts = [torch.randint(2, V, (K + 1,), generator=gen).tolist() for _ in others]
    rows, conts = [others[0], prefix, others[1]], [other_conts[0], cont, other_conts[1]]
    assert_same_bits(ref, batch_steps(model, rows, conts, capacity, 1, chain=True), "batch of chains")
