"""Shared fixtures: tiny random-weight models built from configs, and the embedded default model."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model import random_model
from tests.serve_helpers import save_tiny_checkpoint

torch.set_num_threads(max(1, torch.get_num_threads()))

TINY_CONFIGS = {
    "llama": ModelConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        eos_token_ids=[1],
        max_position_embeddings=512,
    ),
    "llama-tied-mha": ModelConfig(
        architecture="llama",
        vocab_size=80,
        hidden_size=48,
        intermediate_size=64,
        num_layers=3,
        num_heads=3,
        num_kv_heads=3,
        head_dim=16,
        tie_word_embeddings=True,
        eos_token_ids=[1],
        max_position_embeddings=512,
    ),
    "mistral": ModelConfig(
        architecture="mistral",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=1e6,
        eos_token_ids=[1],
    ),
    "qwen2": ModelConfig(
        architecture="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        attention_bias=True,
        rope_theta=1e6,
        eos_token_ids=[1],
    ),
    "qwen2-tied": ModelConfig(  # biases on q/k/v, tied embeddings, a wider MLP (widths 64 and 128)
        architecture="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        attention_bias=True,
        tie_word_embeddings=True,
        eos_token_ids=[1],
    ),
    "qwen3": ModelConfig(
        architecture="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        rope_theta=1e6,
        tie_word_embeddings=True,
        eos_token_ids=[1],
    ),
    "llama3-rope": ModelConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        eos_token_ids=[1],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear-rope": ModelConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        eos_token_ids=[1],
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
    "yarn-rope": ModelConfig(
        architecture="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        eos_token_ids=[1],
        rope_theta=1e6,
        max_position_embeddings=1024,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ),
}


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_config(request) -> ModelConfig:
    return TINY_CONFIGS[request.param]


@pytest.fixture
def tiny_llama():
    return random_model(TINY_CONFIGS["llama"], seed=0)


@pytest.fixture(scope="session")
def default_model():
    """(model fp32, tokenizer, checkpoint dir) of the embedded SmolLM2-135M-Instruct."""
    from runtime.loader import load_model, load_tokenizer

    model, _, path = load_model("smollm2-135m", dtype=torch.float32)
    return model, load_tokenizer(str(path)), path


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model[2], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer random model with the real tokenizer's vocabulary, saved as a checkpoint directory."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


PROJECT_PACKAGES = ("runtime", "quantize", "speculate", "evals", "experiments")


def patch_everywhere(monkeypatch, target: str, value) -> None:
    """monkeypatch "package.module.name" and every loaded project module's own binding of it: a module that
    did ``from package.module import name`` holds its own reference, which patching the source misses."""
    module_name, _, name = target.rpartition(".")
    original = getattr(importlib.import_module(module_name), name)
    for mod in list(sys.modules.values()):  # (the source module included: it holds the original too)
        if getattr(mod, "__name__", "").split(".")[0] in PROJECT_PACKAGES and getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, value)
