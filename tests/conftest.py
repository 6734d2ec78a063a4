"""Shared fixtures: tiny random-weight models built from configs, and the embedded default model."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model import random_model
from tests.patching import PROJECT_PACKAGES, patch_everywhere, restore_late_bindings  # noqa: F401 (re-exported)
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


@pytest.fixture(autouse=True)
def undo_late_bindings():
    """After each test (and after monkeypatch's own undo): no project module keeps a patch_everywhere value."""
    yield
    restore_late_bindings()
