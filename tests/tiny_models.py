"""Tiny random-model shapes shared by the tests: one base shape, named variants, and a way to vary it."""

from __future__ import annotations

from runtime.config import ModelConfig

# The shape every tiny test model starts from: a few layers, GQA, a vocabulary of 96 with EOS = 1.
TINY_SHAPE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_ids=[1],
)


def tiny_model_config(**fields) -> ModelConfig:
    """TINY_SHAPE with `fields` changed: tests name only what their model needs to differ in."""
    return ModelConfig(**{**TINY_SHAPE, **fields})


TINY_CONFIGS = {
    "llama": tiny_model_config(max_position_embeddings=512),
    "llama-tied-mha": tiny_model_config(
        vocab_size=80,
        hidden_size=48,
        intermediate_size=64,
        num_layers=3,
        num_heads=3,
        num_kv_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "mistral": tiny_model_config(architecture="mistral", num_kv_heads=1, rope_theta=1e6),
    "qwen2": tiny_model_config(architecture="qwen2", attention_bias=True, rope_theta=1e6),
    # biases on q/k/v, tied embeddings, a wider MLP (widths 64 and 128)
    "qwen2-tied": tiny_model_config(
        architecture="qwen2", intermediate_size=128, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3": tiny_model_config(
        architecture="qwen3", head_dim=32, qk_norm=True, rope_theta=1e6, tie_word_embeddings=True
    ),
    "llama3-rope": tiny_model_config(
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear-rope": tiny_model_config(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn-rope": tiny_model_config(
        architecture="qwen3",
        head_dim=32,
        qk_norm=True,
        rope_theta=1e6,
        max_position_embeddings=1024,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ),
}
