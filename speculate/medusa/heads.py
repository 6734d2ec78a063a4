"""Medusa heads (Cai et al. 2024): K extra next-next-token predictors on the target's last hidden state.

Head k (k = 1..K) maps the final-norm hidden state at position t to logits for token t + 1 + k (the base
lm_head predicts t + 1). Each head is a stack of residual blocks ``h + SiLU(W h + b)`` followed by a
vocabulary projection; with ``share_lm_head`` the projection is the frozen base lm_head, so all K heads
project in one [K, H] x [H, V] matmul (one read of the vocabulary matrix per step on CPU).

A checkpoint is a directory with ``medusa_config.json`` and ``medusa_heads.safetensors``; the config
records a fingerprint of the base model so heads trained for another model are refused, not silently run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.loader import begin_atomic_dir, finish_atomic_dir

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"


class MedusaCheckpointError(ValueError):
    """A Medusa checkpoint that is missing, malformed, or trained for a different base model."""


def model_fingerprint(model) -> str:
    """Identity of a base model: shape config plus a hash of a slice of the lm_head and embedding weights.

    Two different checkpoints of the same architecture get different fingerprints; dtype does not matter.
    """
    cfg = model.config
    h = hashlib.sha256()
    h.update(json.dumps([cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers]).encode())
    for w in (model.lm_head.weight, model.embed_tokens.weight):
        sample = w.detach()[:64, :64].float().cpu().contiguous()
        h.update(torch.round(sample * 1e4).to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class MedusaConfig:
    num_heads: int = 3
    num_layers: int = 1  # residual blocks per head
    hidden_size: int = 576
    vocab_size: int = 49152
    share_lm_head: bool = True
    base_model: str = ""  # the spec the heads were trained on (informational)
    base_fingerprint: str = ""  # model_fingerprint of the base model (checked on load)
    # top-i accuracy of head k on held-out data: accuracy[k][i] = P(target's next-next token == i-th
    # candidate of head k). Used to build the candidate tree (speculate.medusa.tree).
    accuracy: list[list[float]] = field(default_factory=list)
    # measured joint acceptance of rank paths, [[i1, .., id], p] (speculate.medusa.train.held_out_tables); when
    # present the tree is built from it (older checkpoints: from the product of ``accuracy``)
    paths: list[list] = field(default_factory=list)
    training: dict = field(default_factory=dict)  # command, steps, tokens, seconds, losses

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        # Zero init: an untrained head starts as the base lm_head applied to h (Medusa's initialisation).
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.proj = None if config.share_lm_head else nn.ModuleList(nn.Linear(H, V, bias=False) for _ in self.blocks)

    def hidden(self, h: Tensor) -> Tensor:
        """[..., H] -> [K, ..., H]: each head's residual-block output."""
        return torch.stack([blocks(h) for blocks in self.blocks])

    def forward(self, h: Tensor, lm_head: nn.Module) -> Tensor:
        """[..., H] final-norm hidden states -> [K, ..., V] logits of tokens t+2 .. t+1+K."""
        z = self.hidden(h)
        if self.proj is None:
            return lm_head(z.to(lm_head.weight.dtype))  # one matmul for all heads
        return torch.stack([proj(z[k]) for k, proj in enumerate(self.proj)])

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        tmp = begin_atomic_dir(out, marker=CONFIG_NAME)  # OUT.partial, renamed once complete
        state = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(state, tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        return finish_atomic_dir(tmp, out)


def load_medusa(path: str | Path, model) -> MedusaHeads:
    """Load heads for ``model``; refuses heads trained for a different base model."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if path.name.endswith(".partial"):
        raise MedusaCheckpointError(f"{path} is an unfinished save (interrupted or still running), not Medusa heads")
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise MedusaCheckpointError(
            f"{path} is not a Medusa checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME}); "
            "train one with `python -m speculate.medusa.train`"
        )
    try:
        config = MedusaConfig(**json.loads((path / CONFIG_NAME).read_text()))
    except (TypeError, json.JSONDecodeError) as err:
        raise MedusaCheckpointError(f"{path / CONFIG_NAME} is malformed: {err}") from err
    cfg = model.config
    if (config.hidden_size, config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise MedusaCheckpointError(
            f"Medusa heads at {path} were trained for a model with hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size} ({config.base_model or 'unknown'}); this model has {cfg.hidden_size} and "
            f"{cfg.vocab_size}"
        )
    fingerprint = model_fingerprint(model)
    if config.base_fingerprint and config.base_fingerprint != fingerprint:
        raise MedusaCheckpointError(
            f"Medusa heads at {path} were trained for another model ({config.base_model or 'unknown'}, fingerprint "
            f"{config.base_fingerprint}); this model's fingerprint is {fingerprint}"
        )
    heads = MedusaHeads(config)
    heads.load_state_dict(load_file(path / WEIGHTS_NAME))
    device = model.embed_tokens.weight.device
    return heads.to(device=device, dtype=model.norm.weight.dtype).eval()
