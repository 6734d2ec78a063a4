"""The CPU step's int8-activation kernels (W8A8, W4A8: runtime/kernels/cpu_step.cpp, namespace i8act) against a
torch reference of the same math, bit for bit: per-token int8 activations (quantize_activations_per_token), exact
integer sums per group, then acc = d_0 * s_0, acc = acc + d_g * s_g, y = acc * s in fp32. Every kernel this CPU
runs (AVX2 and AVX-512 vpmaddwd, AVX2 vpmaddubsw for int4, AVX512-VNNI vpdpbusd), group sizes, odd shapes, 1..64
rows, row invariance, and whole steps of W8A8 / W4A8 layers against the Python layers on the reference path."""

from __future__ import annotations

import pytest
import torch
from patching import kv_pieces, spy_on_cpu_step

from quantize.grid import quantize_activations_per_token
from runtime.kernels import cpu_step

ext = cpu_step.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the CPU step cannot be built here")
# (isa cap, VNNI allowed, the kernel int8-activation layers then run at one row); "amx": VNNI at one row, AMX-INT8
# tiles from AMX_INT8_MIN_ROWS rows where the layer's groups fit whole 64-column chunks (the same bits)
KERNELS = [("avx2", False, "avx2-maddwd"), ("avx512", False, "avx512-maddwd"), ("avx512", True, "avx512-vnni")]
KERNELS += [("amx", True, "avx512-vnni")] if ext is not None and "amx_int8" in cpu_step.cpu_flags() else []
KERNELS = [k for k in KERNELS if ext is not None and cpu_step.isa_supported(k[0])]
if ext is not None and "avx512_vnni" not in cpu_step.cpu_flags():
    KERNELS = [k for k in KERNELS if not k[1]]
KERNEL_IDS = ["amx-int8" if k[0] == "amx" else k[2] for k in KERNELS]


@pytest.fixture(params=KERNELS, ids=KERNEL_IDS)
def kernel(request):
    isa, vnni, name = request.param
    ext.set_isa(isa)
    ext.set_vnni(vnni)
    yield name
    ext.set_isa("amx")
    ext.set_vnni(True)


def quantized(n: int, k: int, bits: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).float()
    return codes, scales, zeros


def handle(codes, scales, zeros, bits: int, group: int, bias=None):
    n, k = codes.shape
    kw = cpu_step.KernelWeight(
        kind="i8" if bits == 8 else "i4", out_features=n, in_features=k, group=group,
        data=cpu_step.pack_codes(codes, bits), scales=cpu_step.group_table(scales, n),
        zeros=cpu_step.group_table(zeros - (128 if bits == 8 else 0), n), bias=bias, int8_activations=True,
    )  # fmt: skip
    return kw.handle()


def reference(x, codes, scales, zeros, group: int, bias=None) -> torch.Tensor:
    """The stated math in torch: int64 sums per group (exact), then the fp32 epilogue in its fixed order."""
    q, s = quantize_activations_per_token(x)
    acc = None
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        centered = codes[:, cols].long() - zeros[:, g : g + 1].long()
        part = (q[:, cols].long() @ centered.T).float() * scales[:, g]
        acc = part if acc is None else acc + part
    y = acc * s
    return y if bias is None else y + bias


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, : k // 3] *= 0.01  # rows of different ranges: rounding of x / s at every magnitude
    return x


SHAPES = [(48, 256), (37, 90), (100, 200)]  # (N, K): whole tiles, ragged rows and columns


def expected_kernel(family: str, bits: int, K: int, group: int) -> str:
    """The kernel a layer takes in a family: VNNI reads 4 (int8) or 8 (int4) columns per load and AVX2's int4
    kernel (vpmaddubsw) two column pairs per step, so a group must not end inside one (a single group may)."""
    single = -(-K // group) == 1
    if family == "avx512-vnni" and not (single or group % (8 if bits < 8 else 4) == 0):
        return "avx512-maddwd"
    if family == "avx2-maddwd" and bits < 8 and (single or group % 4 == 0):
        return "avx2-maddubs"
    return family


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("group", [64, 128, -1, 12])
@pytest.mark.parametrize("N,K", SHAPES)
def test_kernels_equal_the_reference_bitwise(kernel, bits, group, N, K):
    group = K if group == -1 else group
    codes, scales, zeros = quantized(N, K, bits, group, seed=N + K + bits)
    h = handle(codes, scales, zeros, bits, group)
    assert ext.int8_kernel(h) == expected_kernel(kernel, bits, K, group)
    tiles = ext.isa() == "amx" and kernel == "avx512-vnni" and -(-K // 32) * 32 % 64 == 0 and group % 64 == 0
    assert ext.int8_kernel(h, 9) == ("amx-int8" if tiles else ext.int8_kernel(h))
    assert ext.int8_kernel(h, ext.AMX_INT8_MIN_ROWS - 1) == ext.int8_kernel(h)
    for m in (1, 5, 64, 150):  # 150: a prompt chunk's call, blocks of 64 rows and a ragged one
        x = rows(m, K, m)
        assert torch.equal(ext.linear(h, x), reference(x, codes, scales, zeros, group))


@pytest.mark.parametrize("zero", [200.0, -3.0])
def test_int4_zero_points_outside_the_codes_stay_exact(kernel, zero):
    """The AMX-INT8 tiles subtract int4 zero points from the codes in signed bytes (0..15 fit); a zero point outside
    the codes' range sends the layer to the VNNI kernel (the same bits), never to a wrapped byte."""
    n, k, group = 48, 256, 64
    codes, scales, zeros = quantized(n, k, 4, group, seed=13)
    zeros[5, 1] = zero
    h = handle(codes, scales, zeros, 4, group)
    if kernel == "avx512-vnni" and ext.isa() == "amx":
        assert ext.int8_kernel(h, 9) == "avx512-vnni"
    for m in (9, 150):
        x = rows(m, k, m)
        assert torch.equal(ext.linear(h, x), reference(x, codes, scales, zeros, group))


@pytest.mark.parametrize("bits,group", [(8, -1), (4, 64)])
def test_many_rows_keep_each_panel_of_codes(kernel, bits, group):
    """A call of more than 64 rows with K long enough that a core's tiles span several panels of kept codes (K =
    4096: 8 tiles a panel, 19 tiles over 2 cores): the reference's bits, and each row the bits of a 1-row call."""
    n, k = 300, 4096
    group = k if group == -1 else group
    codes, scales, zeros = quantized(n, k, bits, group, seed=11)
    h = handle(codes, scales, zeros, bits, group)
    x = rows(130, k, 5)
    together = ext.linear(h, x)
    assert torch.equal(together, reference(x, codes, scales, zeros, group))
    for m in (0, 63, 64, 129):
        assert torch.equal(ext.linear(h, x[m : m + 1])[0], together[m])


def test_activation_quantization_matches_quantize_activations_per_token(kernel):
    """Ties round half to even (torch.round), all-zero rows give zeros: read back through an identity weight."""
    k = 64
    x = torch.arange(-32, 32).float().repeat(4, 1) * torch.tensor([[0.25], [1.0], [2.0 / 127], [0.0]])
    x[:3, 0] = torch.tensor([63.5, 127.0, 1.0])  # scales 0.5 (x / s lands on every half), 1, 1 / 127
    h = handle(torch.eye(k, dtype=torch.uint8), torch.ones(k, 1), torch.zeros(k, 1), 8, k)
    q, s = quantize_activations_per_token(x)
    assert torch.equal(ext.linear(h, x), q.float() * s)


@pytest.mark.parametrize("bits,group", [(8, -1), (4, 64), (4, 32)])
def test_rows_never_change_a_result(kernel, bits, group):
    n, k = 80, 192
    group = k if group == -1 else group
    codes, scales, zeros = quantized(n, k, bits, group, seed=7)
    bias = torch.randn(n)
    h = handle(codes, scales, zeros, bits, group, bias)
    x = rows(37, k, 3)
    if ext.isa() == "amx" and kernel == "avx512-vnni" and group % 64 == 0:
        assert ext.int8_kernel(h, 37) == "amx-int8" and ext.int8_kernel(h, 1) == "avx512-vnni"  # both kernels
    together = ext.linear(h, x)
    assert torch.equal(together, reference(x, codes, scales, zeros, group, bias))
    for m in range(37):
        assert torch.equal(ext.linear(h, x[m : m + 1])[0], together[m])


@pytest.mark.parametrize("bits,group,act_order", [(8, -1, False), (8, 32, True), (4, 64, False), (4, 32, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_cpu_path_equals_its_reference(bits, group, act_order, dtype):
    """W8A8 / W4A8 QuantLinear on the "cpu" path (its automatic pick here) equals the reference path bit for bit."""
    from formats_helpers import rtn_quantize

    from quantize.qlinear import QuantLinear

    qw = rtn_quantize(torch.randn(72, 160) * 0.05, bits, group, act_order=act_order)
    qw.bias = torch.randn(72) * 0.1
    ref = QuantLinear(qw, act_quant=True, compute_dtype=dtype, path="reference").to(dtype)
    fast = QuantLinear(qw, act_quant=True, compute_dtype=dtype).to(dtype)
    for m in (1, 9):
        x = torch.randn(m, 160).to(dtype)
        assert torch.equal(fast(x), ref(x))
    assert fast.path == "cpu"
    assert torch.equal(fast.qweight().codes, qw.codes)


def int8_act_model(cfg, bits: int, dtype: torch.dtype):
    """A random model whose every decoder linear is a W8A8 (sym, per channel) or W4A8 (g32) QuantLinear."""
    from formats_helpers import rtn_quantize

    from quantize.qlinear import QuantLinear, set_module
    from runtime.layout import decoder_linear_names
    from runtime.model import random_model

    model = random_model(cfg, seed=2).set_dtype(dtype)
    base = random_model(cfg, seed=2)
    for name in decoder_linear_names(cfg.num_layers):
        qw = rtn_quantize(base.get_submodule(name).weight.detach(), bits, -1 if bits == 8 else 32, sym=bits == 8)
        set_module(model, name, QuantLinear(qw, act_quant=True, compute_dtype=dtype, path="cpu"))
    return model


@torch.inference_mode()
@pytest.mark.parametrize("bits,dtype", [(8, torch.bfloat16), (8, torch.float32), (4, torch.bfloat16)])
def test_whole_step_equals_the_python_reference_layers(bits, dtype, monkeypatch):
    """A model of W8A8 (or W4A8) layers runs inside the compiled step, a prompt longer than MAX_TOKENS included,
    and its logits match the Python layers with the plain backend and every layer on the reference path. Each
    quantized layer is bitwise equal (above); the step's attention and norms sum in another order than torch's,
    and a last-bit difference at a layer's input can move an activation by one int8 step (a few logits then move
    by ~0.05), so the logits agree within 1 % in norm (fp32 models; bf16 ones within their own rounding noise),
    not bit for bit."""
    from quantize.qlinear import QuantLinear
    from runtime import backends
    from runtime.kv_cache import KVCache
    from runtime.model import AttentionMetadata
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    model = int8_act_model(cfg, bits, dtype)
    taken = []
    original = cpu_step.decode
    monkeypatch.setattr(cpu_step, "decode", lambda *a, **k: taken.append(original(*a, **k)) or taken[-1])
    prompt = cpu_step.MAX_TOKENS + 6
    tokens = torch.randint(0, cfg.vocab_size, (2, prompt + 3), generator=torch.Generator().manual_seed(6))

    def run(fast: bool) -> torch.Tensor:
        model.fast_decode = fast
        cache = KVCache(cfg, 2, prompt + 8, dtype)
        first = model(tokens[:, :prompt], AttentionMetadata.contiguous(2, 0, prompt, "cpu"), cache)[:, -1:]
        return torch.cat([first] + [model(tokens[:, i : i + 1], AttentionMetadata.contiguous(2, i, 1, "cpu"), cache)
                                    for i in range(prompt, prompt + 3)], dim=1)  # fmt: skip

    fast = run(True)
    assert len(taken) == 4 and all(t is not None for t in taken)  # the prefill and each decode step ran compiled
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.set_path("reference")
    with backends.use_backend(backends.PLAIN):
        slow = run(False)
    bound = 1e-2 if dtype == torch.float32 else 4e-2  # bf16: every layer's output rounded to bf16 (measured ~2 %)
    assert float((fast - slow).float().norm() / slow.float().norm()) < bound


@torch.inference_mode()
def test_a_long_prompt_in_one_step_equals_it_in_chunks(monkeypatch):
    """A W4A8 model's prompt longer than MAX_TOKENS runs through the step in one call (the Python layers would
    call the same integer kernels), and gives the same bits as the same prompt in chunks of at most MAX_TOKENS
    (the step's shape invariance); a dense model's long prompt still goes to the Python layers."""
    from runtime.kv_cache import KVCache
    from runtime.model import AttentionMetadata, random_model
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    model = int8_act_model(cfg, 4, torch.float32)
    taken = spy_on_cpu_step(monkeypatch)
    prompt = cpu_step.MAX_TOKENS + 36
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(3))
    cache = KVCache(cfg, 1, prompt, torch.float32)
    whole = model(tokens, AttentionMetadata.contiguous(1, 0, prompt, "cpu"), cache)
    cache = KVCache(cfg, 1, prompt, torch.float32)
    cut = cpu_step.MAX_TOKENS - 4
    parts = [model(tokens[:, :cut], AttentionMetadata.contiguous(1, 0, cut, "cpu"), cache),
             model(tokens[:, cut:], AttentionMetadata.contiguous(1, cut, prompt - cut, "cpu"), cache)]  # fmt: skip
    assert taken == [True, True, True]
    assert torch.equal(whole, torch.cat(parts, dim=1))
    dense = random_model(cfg, seed=2)
    taken.clear()
    dense(tokens, AttentionMetadata.contiguous(1, 0, prompt, "cpu"), KVCache(cfg, 1, prompt, torch.float32))
    assert taken == []  # the backend did not offer it to the step


@torch.inference_mode()
def test_a_prompt_past_the_step_chunk_runs_through_the_step_in_chunks(monkeypatch):
    """A W8A8 model's prompt longer than the step's chunk (MAX_INT8_ACT_TOKENS, shrunk to 70 here) runs through the
    step in chunks of it (the backend cuts it: 3 chunks for 170 tokens), with the bits of the same prompt fed in those
    chunks by hand, and within bf16 noise of the Python layers (the plain backend, which ran such prompts before);
    pieces of 6 keys: the chunks of 70 take their keys in one piece, the last one of 30 merges its pieces."""
    from runtime import backends
    from runtime.kv_cache import KVCache
    from runtime.kv_policy import chunked_prefill
    from runtime.model import AttentionMetadata
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    model = int8_act_model(cfg, 8, torch.bfloat16)
    monkeypatch.setattr(cpu_step, "MAX_INT8_ACT_TOKENS", 70)
    taken = spy_on_cpu_step(monkeypatch)
    prompt = 170
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(4))

    def cache():
        return KVCache(cfg, 1, prompt, torch.bfloat16)

    with kv_pieces(6):
        whole = model(tokens, AttentionMetadata.contiguous(1, 0, prompt, "cpu"), cache())
        assert taken == [True, True, True]
        by_hand = chunked_prefill(model, tokens, cache(), chunk=70)
    assert torch.equal(model.logits(by_hand), whole)
    with backends.use_backend(backends.PLAIN):
        plain = model(tokens, AttentionMetadata.contiguous(1, 0, prompt, "cpu"), cache())
    assert float((whole.float() - plain.float()).norm() / plain.float().norm()) < 4e-2


@pytest.mark.parametrize("group", [64, -1])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_products_stay_exact(kernel, group, sign):
    """Every code 15 against activations of +-127 (the int16 partial sums of AVX2's int4 kernel at their largest,
    8 steps x 2 x 15 x 127 = 30480) and a zero point of 0: still the exact integer sums, at row counts below and
    above the expanded-tile path's (4 rows: 6 = 4 + 2)."""
    N, K = 32, 512
    group = K if group == -1 else group
    codes = torch.full((N, K), 15, dtype=torch.uint8)
    scales = torch.full((N, K // group), 0.01)
    zeros = torch.zeros(N, K // group)
    h = handle(codes, scales, zeros, 4, group)
    for m in (3, 6):
        x = torch.full((m, K), sign)
        assert torch.equal(ext.linear(h, x), reference(x, codes, scales, zeros, group))
