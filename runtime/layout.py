"""The decoder's shape in one place: the linear layers of a decoder layer, how runtime.model fuses an HF
checkpoint's projections into them (q/k/v -> qkv_proj, gate/up -> gate_up_proj), and the names on both sides.

The loader, calibration, the checkpoint formats, the compiled CPU step and the benchmarks all read this table,
so a new architecture's layout is described here once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from runtime.config import ModelConfig


@dataclass(frozen=True)
class FusedLinear:
    parent: str  # submodule of a decoder layer: "self_attn" | "mlp"
    name: str  # runtime.model's leaf name
    parts: tuple[str, ...]  # the HF checkpoint's leaves, concatenated along the output rows in this order

    @property
    def path(self) -> str:
        return f"{self.parent}.{self.name}"

    def part_rows(self, cfg: ModelConfig) -> list[int]:
        rows = {
            "q_proj": cfg.q_size,
            "k_proj": cfg.kv_size,
            "v_proj": cfg.kv_size,
            "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size,
            "down_proj": cfg.hidden_size,
        }
        return [rows[p] for p in self.parts]

    def has_bias(self, cfg: ModelConfig) -> bool:
        return self.name == "qkv_proj" and cfg.attention_bias  # Qwen2's q/k/v biases


# In forward order.
DECODER_LINEARS = (
    FusedLinear("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedLinear("self_attn", "o_proj", ("o_proj",)),
    FusedLinear("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    FusedLinear("mlp", "down_proj", ("down_proj",)),
)
LINEAR_NAMES = tuple(linear.name for linear in DECODER_LINEARS)
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3


def decoder_linear_names(num_layers: int, leaves: tuple[str, ...] = LINEAR_NAMES) -> list[str]:
    """Dotted module names ("layers.0.self_attn.qkv_proj", ...) in forward order, restricted to ``leaves``."""
    return [f"layers.{i}.{lin.path}" for i in range(num_layers) for lin in DECODER_LINEARS if lin.name in leaves]


def linear_layout(cfg: ModelConfig, with_head: bool) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each linear module with the HF tensor prefixes of its row blocks, e.g.
    ("layers.0.self_attn.qkv_proj", [("model.layers.0.self_attn.q_proj", 576), ("...k_proj", 192), ...])."""
    out = []
    for i in range(cfg.num_layers):
        for lin in DECODER_LINEARS:
            hf = f"model.layers.{i}.{lin.parent}."
            out.append((f"layers.{i}.{lin.path}", [(hf + p, n) for p, n in zip(lin.parts, lin.part_rows(cfg))]))
    if with_head:
        out.append(("lm_head", [("lm_head", cfg.vocab_size)]))
    return out


def fused_layer_state(cfg: ModelConfig, read: Callable[[str], Tensor], hf_prefix: str) -> dict[str, Tensor]:
    """One decoder layer's tensors under runtime.model's names (relative to the layer), read by HF name
    (``read(hf_prefix + "self_attn.q_proj.weight")``) and fused."""
    state = {}
    for lin in DECODER_LINEARS:
        state[f"{lin.path}.weight"] = torch.cat([read(f"{hf_prefix}{lin.parent}.{p}.weight") for p in lin.parts])
        if lin.has_bias(cfg):
            state[f"{lin.path}.bias"] = torch.cat([read(f"{hf_prefix}{lin.parent}.{p}.bias") for p in lin.parts])
    norms = LAYER_NORMS + (QK_NORMS if cfg.qk_norm else ())
    state.update({f"{n}.weight": read(f"{hf_prefix}{n}.weight") for n in norms})
    return state


def unfused_layer_state(
    cfg: ModelConfig, layer: nn.Module, hf_prefix: str, skip: Collection[str] = ()
) -> dict[str, Tensor]:
    """The inverse of fused_layer_state for a dense layer: HF names with the prefix, views of the weights.
    skip: linears (paths inside the layer, e.g. "mlp.down_proj") left out without reading their ``.weight``."""
    out = {}
    for lin in DECODER_LINEARS:
        if lin.path in skip:
            continue
        module = layer.get_submodule(lin.path)
        rows = lin.part_rows(cfg)
        for p, w in zip(lin.parts, module.weight.detach().split(rows)):
            out[f"{hf_prefix}{lin.parent}.{p}.weight"] = w
        if lin.has_bias(cfg):
            for p, b in zip(lin.parts, module.bias.detach().split(rows)):
                out[f"{hf_prefix}{lin.parent}.{p}.bias"] = b
    norms = LAYER_NORMS + (QK_NORMS if cfg.qk_norm else ())
    out.update({f"{hf_prefix}{n}.weight": layer.get_submodule(n).weight.detach() for n in norms})
    return out


def device_of(model: nn.Module) -> torch.device:
    """The device a model runs on. Read from the final norm, not embed_tokens: a quantized embedding
    dequantizes its whole table for ``.weight``."""
    return model.norm.weight.device
