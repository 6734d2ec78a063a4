"""AWQ: folding leaves the float model unchanged, the α search and clip search optimise what they claim
(checked by recomputing their objective independently), and AWQ beats plain RTN on the block output."""

from __future__ import annotations

import copy

import pytest
import torch

from quantize.awq import AWQ, AWQConfig, scale_candidates, search_clip, weight_magnitude
from quantize.calibration import calibrate, layer0_inputs
from quantize.config import QuantConfig
from quantize.gptq import GPTQ, GPTQConfig
from quantize.rtn import quantize_model as rtn_quantize
from quantize.rtn import quantize_weight
from runtime.model import random_model
from tests.tiny_models import TINY_CONFIGS


def outlier_model(name: str, seed: int = 0):
    """A random model whose residual stream has a few large channels, like trained LLMs (AWQ's premise)."""
    model = random_model(TINY_CONFIGS[name], seed=seed)
    with torch.no_grad():
        model.embed_tokens.weight[:, :3] *= 12
    return model


class ScaleOnly(AWQ):
    """AWQ's float-layer preparation without any rounding afterwards."""

    def quantize_stage(self, stage):
        pass


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_scaling_is_folded_without_changing_the_float_model(name):
    model = outlier_model(name)
    tokens = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    qcfg = QuantConfig(bits=3, group_size=16)
    algo = ScaleOnly(qcfg, AWQConfig(clip=False), batch_size=2)
    calibrate(model, tokens, algo, batch_size=2)
    torch.testing.assert_close(model(tokens), before, rtol=1e-4, atol=1e-4)
    scaled = [s for s in algo.stats if "alpha" in s]
    # qkv, gate_up, down per layer; o_proj too where there is no GQA (the MHA config)
    per_layer = 4 if model.config.num_heads == model.config.num_kv_heads else 3
    assert len(scaled) == per_layer * model.config.num_layers
    assert any(s["alpha"] > 0 for s in scaled)  # the search did move away from "no scaling"


def test_alpha_search_is_no_worse_than_no_scaling():
    model = outlier_model("llama")
    tokens = torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(1))
    qcfg = QuantConfig(bits=3, group_size=32)
    layer = model.layers[0]
    xs, rope = layer0_inputs(model, tokens, 4)
    h = layer.input_layernorm(xs[0])
    attn = layer.self_attn

    with torch.no_grad():
        ref = attn(h, *rope[0], None)  # float attention output, before any folding

    def block_error(weight):  # independent recomputation of the objective on the attention block
        saved = attn.qkv_proj.weight.detach().clone()
        with torch.no_grad():
            attn.qkv_proj.weight.copy_(weight)
            err = float((attn(h, *rope[0], None) - ref).pow(2).mean())
            attn.qkv_proj.weight.copy_(saved)
        return err

    w = attn.qkv_proj.weight.detach().clone()
    plain = block_error(quantize_weight(w, qcfg).dequantize())  # α = 0: s = 1
    algo = ScaleOnly(qcfg, AWQConfig(clip=False), batch_size=4)
    algo.prepare_layer(0, layer, xs, rope)
    stat = algo.stats[0]
    assert stat["layer"] == "layers.0.self_attn.qkv_proj"
    # the chosen scale, applied to the original float weights, gives at most the plain-RTN block error
    x_mean = h.reshape(-1, h.shape[-1]).abs().mean(0)
    s = scale_candidates(x_mean, weight_magnitude(w, 32), stat["alpha"])
    assert block_error(quantize_weight(w * s, qcfg).dequantize() / s) <= plain * (1 + 1e-6)


def test_duo_scaling_formula():
    x_mean, w_mean = torch.tensor([1.0, 4.0, 9.0]), torch.tensor([0.5, 0.25, 1.0])
    s = scale_candidates(x_mean, w_mean, 0.5)
    raw = x_mean.sqrt() / (w_mean.sqrt() + 1e-4)
    torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())
    torch.testing.assert_close(scale_candidates(x_mean, None, 0.0), torch.ones(3))


def test_clip_search_minimises_group_output_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 40, generator=g)
    w[0, 3] = 9.0  # an outlier weight: clipping it should pay off
    x = torch.randn(200, 40, generator=g)
    qcfg = QuantConfig(bits=3, group_size=16)
    max_val = search_clip(w, x, qcfg, AWQConfig(), 16)
    assert max_val.shape == (12, 3)

    def out_error(bound):  # recomputed from scratch: clamp, fake-quantize, full output error
        b = bound.repeat_interleave(16, 1)[:, :40]
        wc = torch.maximum(torch.minimum(w, b), -b)
        return float(((x @ quantize_weight(wc, qcfg).dequantize().T - x @ w.T) ** 2).mean())

    no_clip = (
        w.abs()
        .reshape(12, -1)
        .new_tensor([[w[r, a : a + 16].abs().max().item() for a in (0, 16, 32)] for r in range(12)])
    )
    assert out_error(max_val) < out_error(no_clip)
    assert max_val[0, 0] < 9.0


@pytest.mark.parametrize("use_gptq", [False, True])
def test_awq_beats_rtn_on_model_output(use_gptq):
    model = outlier_model("llama", seed=4)
    tokens = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens)
        qcfg = QuantConfig(bits=3, group_size=32)
        rtn_err = float((rtn_quantize(copy.deepcopy(model), qcfg)(tokens) - ref).pow(2).mean())
        gptq = GPTQ(qcfg, GPTQConfig(act_order=True)) if use_gptq else None
        awq_model = calibrate(copy.deepcopy(model), tokens, AWQ(qcfg, AWQConfig(), gptq, batch_size=4), 4)
        awq_err = float((awq_model(tokens) - ref).pow(2).mean())
    assert awq_err < 0.8 * rtn_err
