"""Shared fixtures: tiny random-weight models built from configs, and the embedded default model."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model import random_model
from tests.serve_helpers import save_tiny_checkpoint
from tests.tiny_models import TINY_CONFIGS

torch.set_num_threads(max(1, torch.get_num_threads()))


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
