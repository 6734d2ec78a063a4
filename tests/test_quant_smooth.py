"""SmoothQuant for W8A8: folding the smoothing scales leaves the float model unchanged, the scale is the
paper's formula (recomputed from the layer's own inputs and weights), and smoothing lowers the W8A8 output
error on a model with outlier activation channels."""

from __future__ import annotations

import copy

import pytest
import torch

from quantize import int8
from quantize.calibration import calibrate, layer0_inputs
from quantize.int8 import SmoothQuant
from runtime.model import random_model
from tests.tiny_models import TINY_CONFIGS


def outlier_model(name: str, seed: int = 0, factor: float = 20.0):
    """A random model whose residual stream has a few large channels (the activations SmoothQuant targets)."""
    model = random_model(TINY_CONFIGS[name], seed=seed)
    with torch.no_grad():
        model.embed_tokens.weight[:, :3] *= factor
    return model


class SmoothOnly(SmoothQuant):
    """The smoothing of each float layer without any rounding afterwards."""

    def quantize_stage(self, stage):
        pass


def tokens(seed: int, n: int = 4, t: int = 24, vocab: int = 80) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_smoothing_is_folded_without_changing_the_float_model(name):
    model = outlier_model(name)
    x = tokens(0)
    with torch.no_grad():
        before = model(x)
    algo = SmoothOnly(int8.int8_config(w8a8=True), alpha=0.5)
    calibrate(model, x, algo, batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-4)
    # qkv, gate_up, down per layer; o_proj too where there is no GQA (the MHA config)
    per_layer = 4 if model.config.num_heads == model.config.num_kv_heads else 3
    assert len(algo.stats) == per_layer * model.config.num_layers


def test_scale_is_the_smoothquant_formula():
    model = outlier_model("llama")
    x = tokens(1)
    layer = model.layers[0]
    xs, rope = layer0_inputs(model, x, 4)
    with torch.no_grad():
        h = layer.input_layernorm(xs[0]).reshape(-1, 64)
    w = layer.self_attn.qkv_proj.weight.detach().clone()
    norm_before = layer.input_layernorm.weight.detach().clone()
    alpha = 0.6
    expected = h.abs().amax(0).pow(alpha) / w.abs().amax(0).pow(1 - alpha)
    SmoothOnly(int8.int8_config(w8a8=True), alpha).prepare_layer(0, layer, xs, rope)
    # the fold divided the norm weight by s and multiplied the qkv columns by s
    torch.testing.assert_close(norm_before / layer.input_layernorm.weight.detach(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight.detach(), w * expected, rtol=1e-5, atol=1e-6)


def test_smoothing_lowers_w8a8_output_error():
    model = outlier_model("llama", seed=3)
    calib, held_out = tokens(4, n=8, t=32), tokens(5, n=8, t=32)
    with torch.no_grad():
        ref = model(held_out)
        plain, cfg = int8.quantize_model(copy.deepcopy(model), w8a8=True)
        plain_err = float((plain(held_out) - ref).pow(2).mean())
        smoothed = calibrate(copy.deepcopy(model), calib, SmoothQuant(cfg, alpha=0.5), batch_size=4)
        smooth_err = float((smoothed(held_out) - ref).pow(2).mean())
    assert smooth_err < 0.5 * plain_err
