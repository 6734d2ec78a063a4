"""A feature-level draft head in the manner of EAGLE (Li et al. 2024): one decoder layer that reads the
target's final-norm hidden state at position t together with the embedding of token t + 1, and predicts
the target's hidden state at t + 1; the target's own lm_head turns that feature into the distribution of
token t + 2. Drafting feeds the head its own predicted features, one level of the draft tree at a time.

Shape (EAGLE-1): x = fc([embed(token); feature]) (2H -> H, with bias), then one decoder layer of the
target's architecture whose input RMSNorm is the identity (the features are already normalised); no final
norm (the output regresses the target's normalised feature directly).

The head attends only over the draft path from the last committed token (relative rope positions 0..d),
because the speculator contract (``speculate.base.SpecState``) exposes the hidden state of the last
committed token only; training uses the same short causal windows (``speculate.eagle.train``).

A checkpoint is a directory with ``eagle_config.json`` and ``eagle_head.safetensors``; the config records the
target's fingerprint so a head trained for another model is refused.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from runtime.config import ModelConfig
from runtime.model import AttentionMetadata, DecoderLayer, Transformer, rope_inv_freq
from speculate.medusa.heads import model_fingerprint

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "eagle_head.safetensors"


class EagleCheckpointError(ValueError):
    """An EAGLE checkpoint that is missing, malformed, or trained for a different base model."""


@dataclass
class EagleConfig:
    layer: dict  # the target's ModelConfig fields (the head's decoder layer has the target's shapes)
    base_model: str = ""
    base_fingerprint: str = ""
    window: int = 6  # training window: the longest draft path (root + depth) the head was fit on
    accuracy: dict = field(default_factory=dict)  # held-out top-1 agreement with the target, per depth
    training: dict = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: Transformer, base_model: str = "", window: int = 6) -> EagleConfig:
        layer = {**asdict(model.config), "num_layers": 1}
        return cls(layer=layer, base_model=base_model, base_fingerprint=model_fingerprint(model), window=window)

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.layer)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        mc = config.model_config()
        H = mc.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = DecoderLayer(mc, 0)
        self.layer.input_layernorm = nn.Identity()
        # Transformer.rope reads these two attributes only: the head's rope is the target's
        inv_freq, self.rope_attention_scale = rope_inv_freq(mc)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def inputs(self, embeds: Tensor, features: Tensor) -> Tensor:
        """[..., H] embedding of token t + 1 and [..., H] feature of position t -> [..., H] layer input."""
        return self.fc(torch.cat([embeds, features.to(embeds.dtype)], -1))

    def forward(self, x: Tensor) -> Tensor:
        """x [N, T, H] one causal draft path per row (positions 0..T-1) -> [N, T, H] predicted features."""
        N, T, _ = x.shape
        positions = torch.arange(T, device=x.device).expand(N, -1)
        cos, sin = Transformer.rope(self, positions, x.dtype)
        meta = AttentionMetadata(positions, positions, None, T, is_causal=T > 1)
        return self.layer(x, cos, sin, meta, None)

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        tmp = out / (WEIGHTS_NAME + ".partial")
        save_file(state, tmp)
        tmp.rename(out / WEIGHTS_NAME)
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        return out


def load_eagle(path: str | Path, model: Transformer) -> EagleHead:
    """Load a head for ``model``; refuses a head trained for a different base model."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise EagleCheckpointError(
            f"{path} is not an EAGLE checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
            "train one with `python -m speculate.eagle.train`"
        )
    try:
        config = EagleConfig(**json.loads((path / CONFIG_NAME).read_text()))
        config.model_config()
    except (TypeError, json.JSONDecodeError) as err:
        raise EagleCheckpointError(f"{path / CONFIG_NAME} is malformed: {err}") from err
    fingerprint = model_fingerprint(model)
    if config.base_fingerprint != fingerprint:
        raise EagleCheckpointError(
            f"EAGLE head at {path} was trained for another model ({config.base_model or 'unknown'}, fingerprint "
            f"{config.base_fingerprint}); this model's fingerprint is {fingerprint}"
        )
    head = EagleHead(config)
    head.load_state_dict(load_file(path / WEIGHTS_NAME))
    return head.to(device=model.embed_tokens.weight.device, dtype=model.norm.weight.dtype).eval()
