"""Quantized KV caches (int8, fp8_e4m3, int4 KIVI; runtime.kv_quant) inside the compiled CPU step: the step writes
each new token's codes as kv_quant's writer does and attends over the codes in place, for the contiguous
QuantizedKVCache and the paged pool, in decode steps, chain verifications and candidate trees.

Every comparison starts from the same cache: the reference runs on a deep copy taken just before the step's call.
Tolerances (max |logit difference| against PLAIN, the Python layers with F.linear and kv_quant.chunked_attention):
- fp32, 5e-5. Both paths dequantize to the same fp32 keys and values (code * scale (+ min), bit for bit) and differ
  only in summation order (the step's kernels and packed softmax vs F.linear and the chunked online softmax):
  measured 4e-6..9e-6 here, as with a full-precision cache (4e-6..8e-6 for the same forwards). An order-level
  difference in a new key can still move one of its codes across a rounding boundary in a later layer; 5x covers it.
- bf16 (mixed), 0.125: every activation is rounded to bf16 (2^-8 relative) from fp32 sums taken in another order,
  so activations differ by a bf16 ulp now and then and codes flip more often: measured 0.016..0.07 here, against
  0.04..0.055 for the same forwards over a full-precision bf16 cache.
- int8 in fp32, 2e-2: both paths score the keys against the query rounded to 16 bits (kv_quant.round_query), and
  a query element that sits within fp32 order noise of a grid boundary moves one grid step (2^-15 of the query's
  largest) in one path only: the logits move by up to ~5e-4 here, and such a move in layer 0's output can push a
  key written in layer 1 across an int8 code boundary (5.8e-3 measured, avx2 tree). Where the inputs of the
  attention are the same bits, the integer scores equal the reference to summation noise:
  test_int8_scores_are_the_query_grids (one layer, 1e-5).
Written codes: the first layer's k/v are the same bits in the step and in the Python layers run through the same
kernels (backend CPU_STEP, fast_decode off), so every stored entry of layer 0 (codes, scales, int4 mins, the int4
residual and its map) must be equal exactly, including int4 groups sealed by the write. Against PLAIN (whose F.linear
sums in another order) and in deeper layers codes may differ where a value sits within rounding noise of a code
boundary: counted, bounded by MAX_FLIPS of the entries written (fp32: each by one step at most). The writer alone,
row by row with ties that round-half-to-even decides, equals kv_quant's bit for bit (test_writer_rounds_as_kv_quant)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from patching import kv_pieces, spy_on_cpu_step

from runtime import kv_quant
from runtime.backends import CPU_STEP, PLAIN, use_backend
from runtime.kernels import cpu_step
from runtime.kv_cache import QuantizedKVCache
from runtime.kv_quant import quantize_asym4, quantize_fp8, quantize_int8, unpack_int4
from runtime.model import AttentionMetadata, decode_meta, random_model
from runtime.paged_cache import PagedKVCache, paged_metadata
from runtime.speculation import CandidateTree
from speculate.generate import chain_metadata, tree_metadata
from tests.tiny_models import tiny_model_config

pytestmark = pytest.mark.skipif(cpu_step.extension() is None, reason="the C++ decode step could not be built here")

FORMATS = ["int8", "fp8_e4m3", "int4"]
CFG = tiny_model_config(
    hidden_size=256, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
    max_position_embeddings=1024,
)  # fmt: skip
BS = 16  # block size = int4 key group
LENGTHS = [31, 46]  # committed tokens per row: ragged; row 1's next writes complete a key group
TREE = CandidateTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
CHAIN = 5
TABLES = [[3, 1, 6, 8, 10], [2, 7, 4, 5, 9]]  # paged: blocks out of order
TOL = {torch.float32: 5e-5, torch.bfloat16: 0.125}
INT8_FP32_TOL = 2e-2  # the query's 16-bit grid turns order noise into a grid step now and then (docstring)
FAMILIES = [f for f in ("avx2", "avx512", "avx512bf16") if cpu_step.available() and cpu_step.isa_supported(f)]
MAX_FLIPS = {torch.float32: 0.01, torch.bfloat16: 0.05}  # codes that differ from PLAIN's, of the entries written
# ... by at most this many code steps (bf16: not bounded; a key that moves by a bf16 ulp near zero crosses many of
# e4m3's fine subnormal steps, and a sign flip there is two codes far apart)
MAX_STEPS = {torch.float32: 1, torch.bfloat16: None}


def build_model(dtype: torch.dtype):
    model = random_model(CFG, seed=11)
    return model.set_dtype(torch.bfloat16, mixed=True) if dtype == torch.bfloat16 else model


# ---- the forwards each scenario makes: (tokens [B, T], metadata) for a contiguous or a paged cache ----------------


def contiguous_forward(kind: str, lengths: list[int], gen):
    B, lens = len(lengths), torch.tensor(lengths)
    if kind == "decode":  # one new token per row at index length (rows at different positions)
        return torch.randint(0, CFG.vocab_size, (B, 1), generator=gen), decode_meta(lens)
    if kind == "chain":  # k + 1 tokens from the last committed one (a verification rewrites it)
        return torch.randint(0, CFG.vocab_size, (B, CHAIN), generator=gen), chain_metadata(lens, CHAIN)
    return torch.randint(0, CFG.vocab_size, (B, len(TREE)), generator=gen), tree_metadata(TREE, lens)


def paged_forward(kind: str, lengths: list[int], gen):
    n = {"decode": 1, "chain": CHAIN, "tree": len(TREE)}[kind]
    first = [L if kind == "decode" else L - 1 for L in lengths]
    index = [list(range(f, f + n)) for f in first]
    depth = TREE.depth if kind == "tree" else list(range(n))
    pos = [[f + d for d in depth] for f in first]
    masks = [TREE.ancestor_mask()] * len(lengths) if kind == "tree" else None
    meta = paged_metadata(pos, index, TABLES, BS, "cpu", masks)
    return torch.randint(0, CFG.vocab_size, (len(lengths), n), generator=gen), meta


def prefilled_cache(model, layout: str, fmt: str, kind: str, dtype):
    """A cache written by the Python layers (the same start for both paths): contiguous, max(LENGTHS) tokens in
    every row (a shorter row's next write lands inside its stale tail, as a ragged batch's does); paged, LENGTHS."""
    lookahead = 0 if kind == "decode" else len(TREE)
    gen = torch.Generator().manual_seed(5)
    n = max(LENGTHS)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), n), generator=gen)
    if layout == "contiguous":
        cache = QuantizedKVCache(CFG, 2, 80, dtype, kv_dtype=fmt, block_size=BS, lookahead=lookahead)
        meta = AttentionMetadata.contiguous(2, 0, n, "cpu")
    else:
        cache = PagedKVCache(
            CFG, 12, BS, dtype, decode_kernel="torch", kv_cache_dtype=fmt, max_num_seqs=2, lookahead=lookahead
        )
        meta = paged_metadata([list(range(L)) for L in LENGTHS], [list(range(L)) for L in LENGTHS], TABLES, BS, "cpu")
    with use_backend(PLAIN), torch.no_grad():
        model(tokens, meta, cache)
    return cache


def pool_entries(pool) -> dict[str, torch.Tensor]:
    """The pool's stored tensors (codes as bytes), and int4's residual map."""
    names = ["k", "v", "k_scale", "v_scale"] + (
        ["k_min", "v_min", "k_open", "open_of"] if pool.kv_dtype == "int4" else []
    )
    return {n: getattr(pool, n).view(torch.uint8) if n in ("k", "v") else getattr(pool, n) for n in names}


def code_steps(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes (bytes) as integers whose neighbours are the format's neighbouring values: int8 as is, int4 unpacked,
    e4m3 as sign * (exponent, mantissa) bits (monotone in the value)."""
    if fmt == "int4":
        return unpack_int4(codes).int()
    if fmt == "int8":
        return codes.view(torch.int8).int()
    codes = codes.view(torch.uint8)
    magnitude = (codes & 0x7F).int()
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def code_flips(got: torch.Tensor, want: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(codes that differ, the largest difference in code steps) between two code tensors (bytes)."""
    diff = (code_steps(got, fmt) - code_steps(want, fmt)).abs()
    return int((diff > 0).sum()), int(diff.max())


def step_and_reference(model, cache, tokens, meta, reference_backend=PLAIN, fast_reference=True):
    """Logits of the step on `cache` and of the reference on a copy of it taken first; -> (step, ref, ref cache)."""
    ref_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        got = model(tokens, meta, cache)
        model.fast_decode = fast_reference
        try:
            with use_backend(reference_backend):
                want = model(tokens, copy.deepcopy(meta), ref_cache)
        finally:
            model.fast_decode = True
    return got.float(), want.float(), ref_cache


# ---- the step's writer, row by row, against kv_quant's ---------------------------------------------------------


def rows_with_ties() -> torch.Tensor:
    """Random rows over 9 decades, a zero row, and rows whose scale is exactly 1 (amax 127 / 448 / 15) holding
    values halfway between codes: round-half-to-even decides them."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 64, generator=gen) * torch.logspace(-6, 3, 600)[:, None]
    x[0] = 0
    ties = torch.zeros(3, 64)
    ties[0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -3.5])  # int8, scale 1
    ties[1, :8] = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 17.0, 19.0, 0.0])  # fp8, scale 1
    ties[2, :6] = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 14.5])  # int4, min 0, scale 1
    return torch.cat([x, ties])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writer_rounds_as_kv_quant(dtype):
    x = rows_with_ties().to(dtype)
    ext = cpu_step.extension()
    codes, scale, _ = ext.quantize_kv_rows(x, cpu_step.KV_FORMATS["int8"])
    want_codes, want_scale = quantize_int8(x)
    assert torch.equal(codes.view(torch.int8), want_codes) and torch.equal(scale, want_scale)
    codes, scale, _ = ext.quantize_kv_rows(x, cpu_step.KV_FORMATS["fp8_e4m3"])
    want_codes, want_scale = quantize_fp8(x)
    assert torch.equal(codes, want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)
    codes, scale, low = ext.quantize_kv_rows(x, cpu_step.KV_FORMATS["int4"])
    want_packed, want_scale, want_low = quantize_asym4(x, dim=-1)
    assert torch.equal(codes, unpack_int4(want_packed))
    assert torch.equal(scale, want_scale) and torch.equal(low, want_low)


# ---- whole steps: logits and the codes they write ---------------------------------------------------------------

SCENARIOS = [
    (fmt, layout, kind) for fmt in FORMATS for layout in ("contiguous", "paged") for kind in ("decode", "chain", "tree")
]


def tolerance(fmt: str, dtype: torch.dtype) -> float:
    return INT8_FP32_TOL if fmt == "int8" and dtype == torch.float32 else TOL[dtype]


def scenario(fmt, layout, kind, dtype):
    model = build_model(dtype)
    cache = prefilled_cache(model, layout, fmt, kind, dtype)
    forward = contiguous_forward if layout == "contiguous" else paged_forward
    tokens, meta = forward(kind, LENGTHS, torch.Generator().manual_seed(9))
    return model, cache, tokens, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,layout,kind", SCENARIOS)
def test_step_matches_the_python_reference(fmt, layout, kind, dtype, monkeypatch):
    """The step runs (it used to decline every quantized cache) and gives PLAIN's logits within TOL; the codes it
    writes differ from PLAIN's in at most MAX_FLIPS of the entries, by one step."""
    model, cache, tokens, meta = scenario(fmt, layout, kind, dtype)
    taken = spy_on_cpu_step(monkeypatch)
    got, want, ref_cache = step_and_reference(model, cache, tokens, meta)
    assert taken == [True]  # the step ran (the reference, PLAIN, never reaches it)
    err = float((got - want).abs().max())
    assert err <= tolerance(fmt, dtype), err
    for name in ("k", "v"):
        flips, worst = code_flips(getattr(cache.pool, name), getattr(ref_cache.pool, name), fmt)
        written = tokens.numel() * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim
        assert flips <= MAX_FLIPS[dtype] * written, (name, flips, written)
        assert MAX_STEPS[dtype] is None or worst <= MAX_STEPS[dtype], (name, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,layout,kind", SCENARIOS)
def test_step_writes_the_python_writers_codes(fmt, layout, kind, dtype):
    """Against the Python layers through the same kernels: the first layer's k/v are the same bits, so every stored
    entry of layer 0 (codes, scales, int4 mins, residual and its map) is equal exactly."""
    model, cache, tokens, meta = scenario(fmt, layout, kind, dtype)
    got, want, ref_cache = step_and_reference(model, cache, tokens, meta, CPU_STEP, fast_reference=False)
    for name, tensor in pool_entries(cache.pool).items():
        ref = pool_entries(ref_cache.pool)[name]
        if name == "open_of":
            assert torch.equal(tensor, ref)
        else:
            assert torch.equal(tensor[0], ref[0]), name
    assert float((got - want).abs().max()) <= tolerance(fmt, dtype)


@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_head_sizes_match_the_python_reference(fmt, head_dim, monkeypatch):
    """The AVX-512 quantized attention is built per head size (8 chunks of 16 lanes for 128; 48 takes the generic
    attention): a paged chain verification gives PLAIN's logits within TOL."""
    monkeypatch.setitem(globals(), "CFG", dataclasses.replace(CFG, head_dim=head_dim))
    test_step_matches_the_python_reference(fmt, "paged", "chain", torch.float32, monkeypatch)


# ---- the step's shape invariance holds over quantized caches too ----------------------------------------------


@pytest.fixture(params=FAMILIES)
def family(request):
    """The step's attention in each kernel family this CPU runs (AVX2's and AVX-512's are separate functions)."""
    cpu_step.extension().set_isa(request.param)
    yield request.param
    cpu_step.extension().set_isa("amx")  # back to the best this CPU has


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_family_matches_the_python_reference(fmt, family):
    model, cache, tokens, meta = scenario(fmt, "paged", "tree", torch.float32)
    got, want, _ = step_and_reference(model, cache, tokens, meta)
    assert float((got - want).abs().max()) <= tolerance(fmt, torch.float32)


@pytest.mark.parametrize("kind", ["decode", "chain", "tree"])
def test_int8_scores_are_the_query_grids(kind, family, monkeypatch):
    """int8 keys are scored against the query on its 16-bit grid (kv_quant.round_query; the AVX-512 family as
    integer dot products of the grid's integers and the codes). With one layer whose query, keys and values are the
    same bits in both paths (the Python layers through the step's kernels), the logits agree to summation noise
    (1e-5; measured 1.8e-6..5e-6), and a reference that scores the unrounded query is told apart (control)."""
    monkeypatch.setitem(globals(), "CFG", dataclasses.replace(CFG, num_layers=1))
    errors = {}
    for grid in (True, False):
        if not grid:
            monkeypatch.setattr(kv_quant, "round_query", lambda q: q.float())
        model, cache, tokens, meta = scenario("int8", "paged", kind, torch.float32)
        got, want, _ = step_and_reference(model, cache, tokens, meta, CPU_STEP, fast_reference=False)
        errors[grid] = float((got - want).abs().max())
    assert errors[True] <= 1e-5, errors
    assert errors[False] > 1e-5, errors


@pytest.fixture(params=[None, 12], ids=["one-piece", "pieces-of-12"])
def piece(request):
    """The quantized attention's long-context split: off at these lengths (1024 keys a piece) or every 12 keys
    (not a multiple of the block size, so key ranges start inside a block and a chain's pieces cross its new keys)."""
    with kv_pieces(request.param or 1024):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,layout,kind", SCENARIOS)
def test_pieces_match_the_python_reference(fmt, layout, kind, dtype, family):
    """Contexts split into pieces (each query's visible keys softmaxed and summed 12 at a time on the cores, then
    merged by their maxima and sums) give PLAIN's logits within TOL, in each kernel family; in fp32 not the unsplit
    bits (the split ran; bf16 rounding can absorb the merge's last-bit differences)."""
    model, cache, tokens, meta = scenario(fmt, layout, kind, dtype)
    with torch.inference_mode():
        whole = model(tokens, copy.deepcopy(meta), copy.deepcopy(cache)).float()
    with kv_pieces(12):
        got, want, _ = step_and_reference(model, cache, tokens, meta)
    assert float((got - want).abs().max()) <= tolerance(fmt, dtype)
    assert dtype == torch.bfloat16 or not torch.equal(got, whole)


@pytest.mark.parametrize("fmt", FORMATS)
def test_positions_are_shape_invariant(fmt, family, piece):
    """A position's logits are the same bits alone (B = 1) or beside another row, and as one token of a chain or
    as its own decode step (int4: the chain seals a key group the queries before it still read in full precision)."""
    model = build_model(torch.bfloat16)
    cache = prefilled_cache(model, "contiguous", fmt, "decode", torch.bfloat16)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(0, CFG.vocab_size, (2, CHAIN), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        alone = model(tokens[:1, :1], decode_meta(lengths[:1]), copy.deepcopy(cache))
        chain = model(tokens, chain_metadata(lengths + 1, CHAIN), copy.deepcopy(cache))  # indices L..L+4
        steps = [model(tokens[:, t : t + 1], decode_meta(lengths + t), cache) for t in range(CHAIN)]
    assert torch.equal(alone[0], steps[0][0])
    assert torch.equal(chain, torch.cat(steps, dim=1))


@pytest.mark.parametrize("fmt", FORMATS + ["auto"])
def test_paged_engine_with_speculation_matches_the_python_layers(fmt, piece, monkeypatch):
    """The serving engine over a quantized pool (ragged rows, n-gram chains rewriting draft slots, int4 groups
    sealed and reopened) and over a full-precision one ("auto"): the step runs its decode and verification steps,
    greedy tokens equal the Python layers' (with contexts split in pieces too: the AVX-512 attention of either pool)."""
    from runtime.engine import EngineConfig, LLMEngine
    from runtime.sampling import SamplingParams
    from speculate.ngram import NgramSpeculator
    from tests.tiny_models import TINY_CONFIGS

    model = random_model(TINY_CONFIGS["llama"], seed=0)  # head_dim 16, GQA 4 / 2
    prompts = [[5, 9, 2, 7] * 3, [8, 1, 6, 2, 9], [3, 3, 8, 1, 2, 6, 1, 4] * 2]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    taken = spy_on_cpu_step(monkeypatch)
    results = {}
    for fast in (True, False):
        model.fast_decode = fast
        config = EngineConfig(num_blocks=64, block_size=4, kv_cache_dtype=fmt)
        engine = LLMEngine(model, config=config, speculator=NgramSpeculator(k=3))
        results[fast] = [o.output_ids for o in engine.generate(prompts, params)]
    model.fast_decode = True
    assert results[True] == results[False]
    assert sum(taken) >= 10
