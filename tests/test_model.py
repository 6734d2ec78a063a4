"""Our Llama-family decoder against transformers' own implementation on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import ModelConfig, UnsupportedModelError
from runtime.loader import ModelSpecError, load_model, resolve, save_checkpoint
from runtime.model import AttentionMetadata, random_model


def hf_twin(model, tmp_path):
    from transformers import AutoModelForCausalLM

    save_checkpoint(model, tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


@torch.inference_mode()
def test_logits_match_transformers(tiny_config, tmp_path):
    ours = random_model(tiny_config, seed=1)
    hf = hf_twin(ours, tmp_path)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 24), generator=gen)
    # Offset positions reach past the rope scaling's original context, so the scaled bands matter.
    positions = torch.arange(24).expand(2, -1) + torch.tensor([[0], [300]])
    ref = hf(tokens, position_ids=positions).logits
    got = ours(tokens, AttentionMetadata.causal(positions))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_loaded_checkpoint_roundtrip(tmp_path):
    from tests.tiny_models import TINY_CONFIGS

    ours = random_model(TINY_CONFIGS["qwen2"], seed=2)
    save_checkpoint(ours, tmp_path / "single")
    save_checkpoint(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    tokens = torch.randint(0, 96, (1, 10))
    for d in ("single", "sharded"):
        loaded, cfg, _ = load_model(str(tmp_path / d))
        assert cfg == TINY_CONFIGS["qwen2"]
        assert torch.equal(loaded(tokens), ours(tokens))


def test_mutated_layer_is_caught(tmp_path):
    """The HF comparison bites: a wrong rope base in one model makes the logits differ."""
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS["llama"]
    ours = random_model(cfg, seed=1)
    hf = hf_twin(ours, tmp_path)
    wrong = ModelConfig(**{**cfg.to_dict(), "rope_theta": cfg.rope_theta * 2})
    mutant = random_model(wrong, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.inference_mode():
        assert (mutant(tokens) - hf(tokens).logits).abs().max() > 1e-3


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import TINY_CONFIGS

    save_checkpoint(random_model(TINY_CONFIGS["llama"]), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.down_proj.weight|layers.1.mlp.down_proj.weight"):
        load_model(str(tmp_path))


def test_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import TINY_CONFIGS

    save_checkpoint(random_model(TINY_CONFIGS["llama"]), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="o_proj"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-model", "unknown model spec"),
        ("/nonexistent/model.gguf", "GGUF file not found"),
        (".", "config.json is missing"),
    ],
)
def test_bad_model_specs(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        resolve(spec)


def test_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match="no model.safetensors"):
        resolve(str(tmp_path))
