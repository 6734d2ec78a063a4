"""The quantized prefill path (runtime.kernels.cpu_step.prefill_linear): a quantized layer given many rows
dequantizes its weight block by block in C++ and multiplies with torch's GEMM (on AMX, bf16 activations: panels of
it on the tiles).

- The dequantization equals the layer's own Python dequantization ((codes - zeros) * scales in fp32, act-order
  columns in input order, e4m3 codes times their scales), rounded to bf16 or kept fp32, bit for bit, in every
  kernel family this CPU runs (AVX2 builds take the scalar loop).
- A long QuantLinear / FPLinear forward is within the bound that bf16 rounding of the weights gives, in every
  kernel family (without native bf16 dot products, AVX2 here, the GEMM runs in fp32 on exact weights):
  |y - x W^T| <= 2^-8 * sum_k |x_k| |W_k| + 2^-8 |x W^T| (bf16 weights and outputs each err by at most 2^-9
  relative; fp32 sums add ~K 2^-24, well inside the doubled 2^-8), and fp32 layers within fp32 summation noise;
  QSPEC_PREFILL_GEMM=0 turns the path off (the exact kernels' bits).
- A dense bf16 Linear given a prompt takes fp32 blocks of its weight exactly where the family has no native bf16
  GEMM, within the same bound.
- A small random Llama's prefill with quantized layers gives the logits of the exact kernels' prefill within
  bf16 tolerance (largest and mean differences within 2^-5 of the largest and mean |logit|).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bf16_logits_close

from quantize.fplinear import FPLinear, quantize_fp8
from quantize.qlinear import QuantizedWeight, QuantLinear, set_module
from runtime.kernels import cpu_step

ext = cpu_step.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the CPU step cannot be built here")
# amx: bf16 prefills of quantized layers multiply dequantized panels on the tiles (amx_prefill in cpu_step.cpp)
FAMILIES = [f for f in ("avx2", "avx512bf16", "amx") if ext is not None and cpu_step.isa_supported(f)]
ROWS = 2 * cpu_step.PREFILL_MIN_ROWS + 3  # past the threshold, and not a multiple of anything
LONG_ROWS = 515  # past AMX's panels (amx_prefill::MAX_ROWS): the whole weight dequantized, one GEMM


@pytest.fixture(params=FAMILIES)
def family(request):
    ext.set_isa(request.param)
    yield request.param
    ext.set_isa("amx")  # back to the best this CPU has


def int_layer(bits: int, group: int, act_order: bool, N: int, K: int, compute: torch.dtype, bias: bool = False):
    """A QuantLinear on the "cpu" path with random codes, scales, integer zero points (act-order: shuffled
    groups; group -1: per channel)."""
    g = torch.Generator().manual_seed(bits * 1000 + K)
    group = K if group == -1 else group
    n_groups = -(-K // group)
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, n_groups, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 2**bits, (N, n_groups), generator=g).float()
    g_idx = (torch.arange(K) // group)[torch.randperm(K, generator=g)] if act_order else None
    bias_t = torch.randn(N, generator=g) if bias else None
    qw = QuantizedWeight(codes, scales, zeros, bits, group, g_idx, bias_t)
    return QuantLinear(qw, compute_dtype=compute, path="cpu")


def fp8_layer(block: int, N: int, K: int, compute: torch.dtype):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(K))
    return FPLinear(quantize_fp8(w, block=block), compute_dtype=compute, path="cpu")


# name -> (builder(N, K, compute), shape): ragged tiles and K not a multiple of 32; an odd K per channel
LAYERS = {
    "int4-g64": (lambda n, k, c: int_layer(4, 64, False, n, k, c), (40, 200)),
    "int4-g128": (lambda n, k, c: int_layer(4, 128, False, n, k, c), (40, 256)),
    "int4-channel-oddK": (lambda n, k, c: int_layer(4, -1, False, n, k, c), (37, 75)),
    "int4-g64-act-order": (lambda n, k, c: int_layer(4, 64, True, n, k, c), (40, 200)),
    "int4-g128-act-order-bias": (lambda n, k, c: int_layer(4, 128, True, n, k, c, bias=True), (48, 256)),
    "int3-g64": (lambda n, k, c: int_layer(3, 64, False, n, k, c), (40, 192)),
    "int2-g32": (lambda n, k, c: int_layer(2, 32, False, n, k, c), (33, 96)),
    "int8-channel": (lambda n, k, c: int_layer(8, -1, False, n, k, c), (40, 200)),
    "int8-g64-act-order": (lambda n, k, c: int_layer(8, 64, True, n, k, c), (40, 192)),
    "fp8-channel": (lambda n, k, c: fp8_layer(0, n, k, c), (40, 200)),
    "fp8-block32": (lambda n, k, c: fp8_layer(32, n, k, c), (40, 192)),
    # 13 tiles: on AMX both cores' shares, several panels each (each filled while the one before multiplies)
    "int4-g64-wide": (lambda n, k, c: int_layer(4, 64, False, n, k, c), (200, 320)),
}


def make(name: str, compute: torch.dtype):
    build, (n, k) = LAYERS[name]
    return build(n, k, compute)


def reference_weight(layer) -> torch.Tensor:
    """The layer's Python dequantization, fp32 [N, K] in input column order."""
    if isinstance(layer, QuantLinear):
        return layer.qweight().dequantize(torch.float32)
    return layer.fweight().dequantize(torch.float32)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_the_python_dequantization_bitwise(family, name, dtype):
    layer = make(name, torch.bfloat16)
    got = cpu_step.dequantize(layer.cpu_kernel_weight(), dtype)
    assert got.dtype == dtype
    assert torch.equal(got, reference_weight(layer).to(dtype))


def within_bf16_weight_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, rel: float) -> None:
    """|y - (x W^T + b)| <= rel * (sum_k |x_k| |W_k| + |x W^T + b|), in fp64."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (0 if bias is None else bias.double())
    bound = rel * (x64.abs() @ w64.abs().T + ref.abs()) + 1e-12
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize(
    "name", ["int4-g64-act-order", "int4-g128-act-order-bias", "int8-channel", "fp8-block32", "int4-g64-wide"]
)
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_rows", [16, 256])  # several blocks (the last one ragged), and one
def test_long_forward_within_the_bf16_bound(family, monkeypatch, name, compute, block_rows):
    monkeypatch.setattr(cpu_step, "PREFILL_BLOCK_ROWS", block_rows)
    calls = []
    real = cpu_step.prefill_linear
    monkeypatch.setattr(cpu_step, "prefill_linear", lambda w, x: calls.append(x.shape) or real(w, x))
    layer = make(name, compute)
    for rows in (ROWS, LONG_ROWS):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(3)).to(compute)
        y = layer(x)
        assert calls and y.dtype == compute and y.shape == (rows, layer.out_features)
        rel = 2.0**-8 if compute == torch.bfloat16 else 2.0**-15  # fp32: weights exact, sums in fp32 (K <= 256)
        within_bf16_weight_bound(y, x, reference_weight(layer), layer.bias, rel)


@pytest.mark.parametrize("bias", [False, True])
def test_dense_bf16_prompt_within_the_bf16_bound(family, monkeypatch, bias):
    from runtime.model import Linear

    monkeypatch.setattr(cpu_step, "PREFILL_BLOCK_ROWS", 48)  # several blocks, the last one ragged
    calls = []
    real = cpu_step.block_gemm
    monkeypatch.setattr(cpu_step, "block_gemm", lambda h, x: calls.append(x.shape) or real(h, x))
    torch.manual_seed(7)
    layer = Linear(200, 130, bias=bias).bfloat16()
    x = torch.randn(ROWS, 200).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    assert bool(calls) == (not ext.native_bf16_gemm()) == (family == "avx2")
    assert y.dtype == torch.bfloat16 and y.shape == (ROWS, 130)
    within_bf16_weight_bound(y, x, layer.weight.detach(), layer.bias, 2.0**-8)


def test_inputs_that_track_gradients():  # a model's activations under grad mode (no autograd through kernels)
    layer = make("int8-channel", torch.bfloat16)
    x = torch.randn(ROWS, layer.in_features).bfloat16().requires_grad_()
    assert layer(x).shape == (ROWS, layer.out_features)


def test_under_inference_mode_as_generation_runs_it():  # the cores' GEMMs write y in the caller's modes
    layer = make("int4-g64", torch.bfloat16)
    x = torch.randn(ROWS, layer.in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    plain = layer(x)
    with torch.inference_mode():
        inside = layer(x)
    assert torch.equal(inside, plain)


@pytest.mark.parametrize("name", ["int4-g64-act-order", "fp8-channel"])
def test_switch_off_keeps_the_exact_kernels(monkeypatch, name):
    layer = make(name, torch.bfloat16)
    x = torch.randn(ROWS, layer.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    exact = cpu_step.linear(layer.cpu_kernel_weight().handle(), x).bfloat16()
    monkeypatch.setenv("QSPEC_PREFILL_GEMM", "0")
    assert torch.equal(layer(x), exact)
    monkeypatch.setenv("QSPEC_PREFILL_GEMM", "1")
    short = x[: cpu_step.PREFILL_MIN_ROWS - 1]  # below the threshold: the exact kernels whatever the switch
    assert torch.equal(layer(short), exact[: cpu_step.PREFILL_MIN_ROWS - 1])


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_model_prefill_matches_the_exact_kernels(monkeypatch, kind):
    """A random Llama's long prefill (Python layers: more than the step's 64 tokens) with every decoder linear
    quantized: logits through the prefill GEMM within bf16 tolerance of the exact kernels'."""
    from formats_helpers import rtn_quantize

    from runtime.kv_cache import KVCache
    from runtime.layout import decoder_linear_names
    from runtime.model import AttentionMetadata, random_model
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    base = random_model(cfg, seed=5)
    model = random_model(cfg, seed=5).set_dtype(torch.bfloat16)
    for name in decoder_linear_names(cfg.num_layers):
        w = base.get_submodule(name).weight.detach()
        if kind == "fp8":
            layer = FPLinear(quantize_fp8(w, block=32 if "down" in name else 0), compute_dtype=torch.bfloat16)
        else:
            qw = rtn_quantize(w, 4 if kind == "int4" else 8, 32 if kind == "int4" else -1, act_order="qkv" in name)
            layer = QuantLinear(qw, compute_dtype=torch.bfloat16)
        set_module(model, name, layer)
    T = ROWS
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(6))
    calls = []
    real = cpu_step.prefill_linear
    monkeypatch.setattr(cpu_step, "prefill_linear", lambda w, x: calls.append(x.shape) or real(w, x))
    logits = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("QSPEC_PREFILL_GEMM", switch)
        cache = KVCache(cfg, 1, T + 8, torch.bfloat16)
        with torch.no_grad():  # as generation runs
            logits[switch] = model(tokens, AttentionMetadata.contiguous(1, 0, T, "cpu"), cache)
    assert len(calls) == 4 * cfg.num_layers  # every decoder linear, with the switch on only
    # a few bf16 steps of the logits: each linear's output is rounded to bf16 on both paths, from weights that
    # differ by bf16 rounding (measured on int4: max 0.040 against a largest logit of 2.9, mean 0.006 against 0.64)
    assert_bf16_logits_close(logits["1"], logits["0"])
