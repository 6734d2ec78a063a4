"""Model configuration: the subset of an HF config.json that the Llama-family decoder needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from runtime.cliutil import UsageError

# HF architecture name -> our family name. Everything else is refused with an error naming it.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(UsageError):
    """The checkpoint's architecture or a config feature is not implemented by runtime.model."""


@dataclass
class ModelConfig:
    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}: runtime.model implements "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 writes rope_parameters (theta + scaling in one dict); older configs split them.
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta") or rope_params.pop("rope_theta", 10000.0)
        rope_params.pop("rope_theta", None)
        rope_scaling = hf.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", rope_params.get("type", "default")) != "default" else None
        )
        if rope_scaling:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}")
            rope_scaling = {**rope_scaling, "rope_type": rope_type}
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def to_hf(self) -> dict:
        """An HF config.json dict for this config (used to build test checkpoints and HF oracles)."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        hf = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.architecture in ("llama", "mistral"):
            hf["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            hf["sliding_window"] = None
        return hf

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# --dtype names every CLI accepts
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


DTYPE_CHOICES = sorted(DTYPES) + ["auto"]  # auto: fp32, or bf16 for a quantized checkpoint (its kernels' dtype)


def cli_dtype(name: str) -> torch.dtype | None:
    """A --dtype name -> torch dtype; None for "auto" (runtime.loader.load_model picks per checkpoint)."""
    return None if name == "auto" else DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The short --dtype name of a torch dtype (fp32, bf16, fp16), or torch's own name for any other."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
