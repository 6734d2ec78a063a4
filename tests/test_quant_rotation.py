"""QuaRot-style rotations (quantize/rotation.py): Hadamard matrices by their defining identity, the online
rotation against its dense matrix, and the rotated float model against the unrotated one (logits within 1e-4
in fp32), on tiny random models and on the default model (slow)."""

from __future__ import annotations

import copy

import pytest
import torch

from quantize import rtn
from quantize.awq import scale_producer
from quantize.config import QuantConfig
from quantize.qlinear import QuantLinear
from quantize.rotation import (
    HadamardMLP,
    HadamardRotation,
    RotatedRMSNorm,
    hadamard,
    install_online_hadamard,
    random_hadamard,
    rotate_model,
    rotation_record,
)
from runtime.model import random_model
from tests.tiny_models import tiny_model_config

TINY = {
    # hidden 48 = 12 * 4 and intermediate 96 = 12 * 8 exercise Paley's factor; 64/128 are pure Sylvester
    "tied-paley": tiny_model_config(
        vocab_size=80, hidden_size=48, num_heads=3, num_kv_heads=3, tie_word_embeddings=True
    ),
    "untied-gqa-sylvester": tiny_model_config(intermediate_size=128),
    "qwen2-bias-576": tiny_model_config(
        architecture="qwen2",
        vocab_size=64,
        hidden_size=576,  # SmolLM2's width: 12 * 12 * 4
        intermediate_size=1536,  # 12 * 128
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        attention_bias=True,
    ),
}


@pytest.mark.parametrize("n", [1, 2, 4, 12, 24, 48, 144, 576, 1536])
def test_hadamard_is_hadamard(n):
    H = hadamard(n)
    assert set(H.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(H @ H.t(), n * torch.eye(n))


@pytest.mark.parametrize("n", [3, 20, 100, 1728])
def test_unsupported_width_is_a_clear_error(n):
    with pytest.raises(ValueError, match=f"no Hadamard matrix for width {n}"):
        hadamard(n)


def test_random_hadamard_is_orthogonal_and_seeded():
    Q = random_hadamard(48, seed=3)
    torch.testing.assert_close(Q @ Q.t(), torch.eye(48, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(Q, random_hadamard(48, seed=3)) and not torch.equal(Q, random_hadamard(48, seed=4))


@pytest.mark.parametrize("n", [64, 96, 1536])
def test_online_rotation_equals_its_dense_matrix(n):
    rot = HadamardRotation(n)
    R = rot.matrix()
    torch.testing.assert_close(R @ R.t(), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.randn(2, 3, n, dtype=torch.float64)
    torch.testing.assert_close(rot(x), x @ R, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("online", [True, False])
@pytest.mark.parametrize("mode", ["residual", "online"])
def test_rotated_model_has_the_same_logits(name, online, mode):
    model = random_model(TINY[name], seed=1)
    tokens = torch.randint(0, TINY[name].vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        rotated = rotate_model(copy.deepcopy(model), seed=0, online=online, mode=mode)
        out = rotated(tokens)
    assert (out - ref).abs().max() <= 1e-4
    if mode == "residual":  # norms folded (unit weights), the head untied from the rotated embedding
        assert not rotated.config.tie_word_embeddings and rotated.lm_head.weight is not rotated.embed_tokens.weight
        ones = torch.ones(TINY[name].hidden_size)
        assert all(torch.equal(layer.input_layernorm.weight, ones) for layer in rotated.layers)
    else:  # the norms keep their weights and rotate their outputs; embedding and head untouched
        assert rotated.config.tie_word_embeddings == TINY[name].tie_word_embeddings
        assert all(isinstance(layer.post_attention_layernorm, RotatedRMSNorm) for layer in rotated.layers)
        assert torch.equal(rotated.embed_tokens.weight, model.embed_tokens.weight)
    assert all(isinstance(layer.mlp, HadamardMLP) == online for layer in rotated.layers)
    changed = rotated.layers[0].self_attn.qkv_proj.weight  # a no-op would pass the logits check too
    assert not torch.allclose(changed, model.layers[0].self_attn.qkv_proj.weight)


@pytest.mark.parametrize("online", [True, False])
def test_rotating_a_subset_of_layers_keeps_the_logits_and_leaves_the_other_layers_plain(online):
    """layers=[1] (online mode): layer 0 keeps its modules and weights bit for bit, layer 1 is rotated, the float
    model's logits stay within 1e-4; the record names the layers and the loader re-installs only those."""
    cfg = TINY["untied-gqa-sylvester"]
    model = random_model(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        rotated = rotate_model(copy.deepcopy(model), seed=0, online=online, mode="online", layers=[1])
        assert (rotated(tokens) - ref).abs().max() <= 1e-4
    plain, rot = rotated.layers[0], rotated.layers[1]
    assert not isinstance(plain.input_layernorm, RotatedRMSNorm) and not isinstance(plain.mlp, HadamardMLP)
    for name, p in plain.named_parameters():
        assert torch.equal(p, model.layers[0].get_parameter(name)), name
    assert isinstance(rot.input_layernorm, RotatedRMSNorm) and isinstance(rot.mlp, HadamardMLP) == online
    assert not torch.allclose(rot.self_attn.qkv_proj.weight, model.layers[1].self_attn.qkv_proj.weight)
    record = rotation_record(0, online, "online", [1])
    assert record["layers"] == [1] and "layers" not in rotation_record(0, online, "online")
    fresh = install_online_hadamard(random_model(cfg, seed=1), record)
    assert [isinstance(layer.post_attention_layernorm, RotatedRMSNorm) for layer in fresh.layers] == [False, True]


@pytest.mark.parametrize(
    "mode, layers, match",
    [("residual", [1], "only in mode 'online'"), ("online", [2], r"layers \[2\]"), ("online", [], "non-empty")],
)
def test_bad_layer_subset_is_an_error(mode, layers, match):
    with pytest.raises(ValueError, match=match):
        rotate_model(random_model(TINY["untied-gqa-sylvester"], seed=0), mode=mode, layers=layers)


def test_rotation_spreads_an_outlier_channel():
    """The point of rotating: a residual channel 100x larger than the rest is spread over all channels."""
    cfg = TINY["untied-gqa-sylvester"]
    model = random_model(cfg, seed=2)
    with torch.no_grad():
        model.embed_tokens.weight[:, 5] *= 100
        x = model.embed_tokens.weight.detach().clone()
        rotate_model(model, seed=0)
        xr = model.embed_tokens.weight.detach()
    ratio = lambda t: float(t.abs().amax(1).mean() / t.abs().mean())  # noqa: E731
    assert ratio(xr) < ratio(x) / 4


def test_rotate_after_quantizing_or_twice_is_an_error():
    cfg = TINY["untied-gqa-sylvester"]
    model = rtn.quantize_model(random_model(cfg, seed=0), QuantConfig(bits=4, group_size=32))
    with pytest.raises(ValueError, match="rotate before quantizing"):
        rotate_model(model)
    model = rotate_model(random_model(cfg, seed=0))
    with pytest.raises(ValueError, match="already rotated"):
        rotate_model(model)
    with pytest.raises(ValueError, match="unknown rotation mode 'spin'"):
        rotate_model(random_model(cfg, seed=0), mode="spin")


@pytest.mark.parametrize("mode", ["residual", "online"])
def test_rotated_rtn_model_quantizes_every_linear_and_awq_skips_scales_a_rotation_would_cross(mode):
    cfg = TINY["untied-gqa-sylvester"]
    model = rotate_model(random_model(cfg, seed=0), mode=mode)
    rtn.quantize_model(model, QuantConfig(bits=4, group_size=32))
    layer = model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(layer.mlp, HadamardMLP)
    assert scale_producer(layer, "down_proj") is None  # the rotation sits between the up rows and down_proj
    assert (scale_producer(layer, "gate_up_proj") is None) == (mode == "online")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["residual", "online"])
def test_default_model_rotated_logits_within_fp32_rounding(default_model, mode):
    """The rotated fp32 model stays within 3x the plain fp32 model's own rounding of the exact (fp64) logits.

    The issue's bar, |rotated - plain| <= 1e-4 in fp32, is not met on the default model (1.2e-4 to 4.4e-4 by token
    set, mode and thread count) and cannot be: an exact channel permutation of the same model, bit-identical
    weights in another summation order, is 1.1e-4 to 3.5e-4 from the plain one (scripts/rotation_logits_error.py,
    notes/issue-20.md). So the test bounds the error against fp64, not against another fp32 rounding."""
    model = copy.deepcopy(default_model[0])
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        exact = copy.deepcopy(model).set_dtype(torch.float64)(tokens).float()
        out = rotate_model(model, seed=0, mode=mode)(tokens)
    floor = (ref - exact).abs().max()
    assert (out - exact).abs().max() <= 3 * floor
