"""QuantConfig validation, the shared grid, RTN (per-channel / groups / sym / asym / shorter last group),
int8 weight-only and W8A8, each against an independent spelled-out oracle."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quantize import int8, rtn
from quantize.config import QuantConfig, QuantConfigError
from quantize.grid import find_params
from quantize.qembedding import QuantEmbedding
from quantize.qlinear import QuantLinear
from runtime.model import random_model
from tests.tiny_models import TINY_CONFIGS


def oracle_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """Dequantized RTN, one group at a time with python-level loops over groups."""
    maxq = 2**bits - 1
    out = torch.empty_like(w, dtype=torch.float32)  # same precision as the code: ties round alike
    gs = w.shape[1] if group_size == -1 else group_size
    for a in range(0, w.shape[1], gs):
        g = w[:, a : a + gs].float()
        lo = torch.clamp(g.min(1).values, max=0)
        hi = torch.clamp(g.max(1).values, min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / maxq).half().float()[:, None]  # checkpoints store fp16 scales
        zero = torch.full_like(scale, 2 ** (bits - 1)) if sym else torch.round(-lo[:, None] / scale)
        out[:, a : a + gs] = scale * (torch.clamp(torch.round(g / scale) + zero, 0, maxq) - zero)
    return out


@pytest.mark.parametrize(
    "bits,group_size,sym",
    [(4, 32, False), (4, 128, False), (3, -1, True), (2, 16, False), (8, -1, True), (4, 48, True)],
)
def test_rtn_matches_oracle_including_a_shorter_last_group(bits, group_size, sym):
    w = torch.randn(24, 200, generator=torch.Generator().manual_seed(bits + group_size))  # 200: no group divides it
    qw = rtn.quantize_weight(w, QuantConfig(bits=bits, group_size=group_size, sym=sym))
    expected_groups = 1 if group_size == -1 else -(-200 // group_size)
    assert qw.scales.shape == (24, expected_groups)
    assert int(qw.codes.max()) <= 2**bits - 1
    torch.testing.assert_close(qw.dequantize(), oracle_rtn(w, bits, group_size, sym), rtol=0, atol=1e-6)
    if sym:
        assert torch.all(qw.zeros == 2 ** (bits - 1))  # the qlinear contract's symmetric case


def test_mse_search_never_increases_the_searched_error():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    w[:, 0] *= 6  # outliers make clipping worthwhile
    for sym in (False, True):
        plain = find_params(w, 4, sym)
        searched = find_params(w, 4, sym, mse=True)

        def err(params):
            s, z = params
            q = torch.clamp(torch.round(w / s[:, None]) + z[:, None], 0, 15)
            return (s[:, None] * (q - z[:, None]) - w).abs().pow(2.4).sum(1)

        assert torch.all(err(searched) <= err(plain) + 1e-6)
        assert float(err(searched).sum()) < 0.95 * float(err(plain).sum())


def test_quant_config_validation():
    with pytest.raises(QuantConfigError, match="unsupported bit width 5"):
        QuantConfig(bits=5)
    with pytest.raises(QuantConfigError, match="group size must be -1"):
        QuantConfig(group_size=0)
    with pytest.raises(QuantConfigError, match="unknown module names"):
        QuantConfig(modules=("q_proj",))
    with pytest.raises(QuantConfigError, match="W8A8"):
        QuantConfig(bits=4, act_quant=True)
    model = random_model(TINY_CONFIGS["llama"])  # hidden 64, intermediate 96
    with pytest.raises(QuantConfigError, match=r"group size 128 is larger than layers\.0\.self_attn\.qkv_proj"):
        QuantConfig(group_size=128).targets(model)
    # 80 fits the 96-wide down_proj but not the 64-wide layers; only down_proj asked: fine
    assert QuantConfig(group_size=80, modules=("down_proj",)).targets(model) == [
        "layers.0.mlp.down_proj",
        "layers.1.mlp.down_proj",
    ]
    cfg = QuantConfig(bits=3, group_size=32, sym=True, extra={"desc_act": True})
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["llama-tied-mha", "qwen2"])
def test_lm_head_and_embeddings_stay_full_precision_unless_asked(name):
    model = random_model(TINY_CONFIGS[name], seed=0)
    embed = model.embed_tokens.weight.detach().clone()
    rtn.quantize_model(model, QuantConfig(bits=4, group_size=16))
    assert isinstance(model.lm_head, nn.Linear) and torch.equal(model.embed_tokens.weight, embed)
    assert all(isinstance(layer.mlp.down_proj, QuantLinear) for layer in model.layers)
    assert model.layers[0].self_attn.qkv_proj.bias is not None or not model.config.attention_bias

    asked = random_model(TINY_CONFIGS[name], seed=0)
    rtn.quantize_model(asked, QuantConfig(bits=4, group_size=16, lm_head=True))
    assert isinstance(asked.lm_head, QuantLinear)
    if asked.config.tie_word_embeddings:  # the embedding reads the quantized head's rows (test_quant_embedding)
        assert isinstance(asked.embed_tokens, QuantEmbedding) and asked.embed_tokens.head is asked.lm_head
    else:
        assert torch.equal(asked.embed_tokens.weight, embed)


def test_int8_weight_only_and_w8a8():
    model = random_model(TINY_CONFIGS["llama"], seed=1)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
    weight_only, cfg = int8.quantize_model(copy.deepcopy(model))
    assert cfg.bits == 8 and cfg.sym and cfg.group_size == -1
    w = model.layers[0].mlp.down_proj.weight
    qw = weight_only.layers[0].mlp.down_proj.qweight()
    # symmetric per-channel: step = 2 max|w| / 255; every weight (the clipped +max included) within half a step,
    # plus what rounding the scale to fp16 (relative error <= 2**-11) moves the outermost codes (<= 128 steps)
    step = 2 * w.abs().amax(1, keepdim=True) / 255
    assert torch.all((qw.dequantize() - w).abs() <= step * (0.5 + 128 * 2**-11) + 1e-7)
    assert torch.all(qw.zeros == 128)

    w8a8, _ = int8.quantize_model(copy.deepcopy(model), w8a8=True)
    layer = w8a8.layers[1].self_attn.o_proj
    assert isinstance(layer, QuantLinear) and layer.act_quant and layer.path == "reference"
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = layer(x)
        # the integer matmul path == the dequantize-both reference up to float summation order
        torch.testing.assert_close(copy.deepcopy(layer).set_path("cpu_w8a8")(x), reference, rtol=1e-5, atol=1e-5)
    # oracle: quantize x per token by hand, multiply in float64
    s = x.abs().amax(-1, keepdim=True) / 127
    xq = torch.clamp(torch.round(x / s), -127, 127)
    wq = layer.codes.double() - 128
    manual = (xq.double() @ wq.T) * s.double() * layer.scales.double()[:, 0]
    torch.testing.assert_close(reference.double(), manual, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # activation rounding adds error on top of the weight-only model's
        assert float((w8a8(tokens) - ref).norm()) > float((weight_only(tokens) - ref).norm())
