"""QuantConfig: the weight grid every quantizer targets (bits, groups, symmetry) and which layers get it.

Algorithm knobs live with their algorithms (GPTQConfig in quantize/gptq.py, AWQConfig in quantize/awq.py);
this is what a packed checkpoint has to describe. ``to_dict`` gives the ``quantization_config`` entry that
is written to config.json (HF / GPTQModel key names where one exists).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torch import nn

from quantize.qlinear import SUPPORTED_BITS
from runtime.layout import LINEAR_NAMES, decoder_linear_names

# Linear layers of runtime.model.DecoderLayer, by their leaf name (q/k/v and gate/up are fused).
DECODER_LINEARS = LINEAR_NAMES


class QuantConfigError(ValueError):
    """A quantization setting that cannot be applied (to this model)."""


@dataclass
class QuantConfig:
    bits: int = 4
    group_size: int = 128  # input columns per group; -1 = one group per output channel (per-channel)
    sym: bool = False  # symmetric: zero point fixed at 2**(bits-1)
    modules: tuple[str, ...] = DECODER_LINEARS  # leaf names of decoder-layer linears to quantize
    lm_head: bool = False  # output head stays full precision unless asked; tied: the embedding shares its codes
    act_quant: bool = False  # W8A8: dynamic per-token int8 activations (8-bit weights only)
    extra: dict = field(default_factory=dict)  # algorithm settings recorded alongside (desc_act, ...)

    def __post_init__(self):
        self.modules = tuple(self.modules)
        if self.bits not in SUPPORTED_BITS:
            raise QuantConfigError(
                f"unsupported bit width {self.bits}; supported: {', '.join(map(str, SUPPORTED_BITS))}"
            )
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size < 1):
            raise QuantConfigError(
                f"group size must be -1 (per-channel) or a positive integer, got {self.group_size!r}"
            )
        unknown = sorted(set(self.modules) - set(DECODER_LINEARS))
        if unknown:
            raise QuantConfigError(f"unknown module names {unknown}; choose from {list(DECODER_LINEARS)}")
        if not self.modules and not self.lm_head:
            raise QuantConfigError("nothing to quantize: modules is empty and lm_head is False")
        if self.act_quant and self.bits != 8:
            raise QuantConfigError(f"W8A8 (act_quant) needs 8-bit weights, got bits={self.bits}")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def group_size_for(self, in_features: int, layer_name: str = "layer") -> int:
        """The group size used for a layer of this width (per-channel = the whole row); checks it fits."""
        if self.group_size == -1:
            return in_features
        if self.group_size > in_features:
            raise QuantConfigError(
                f"group size {self.group_size} is larger than {layer_name}'s input width {in_features}; "
                "use a smaller group or -1 (per-channel)"
            )
        return self.group_size

    def targets(self, model: nn.Module) -> list[str]:
        """Dotted names of the linear layers this config quantizes in a runtime.model.Transformer, in
        forward order; raises if a group does not fit one of them."""
        names = self.target_names(model)
        for name in names:
            self.group_size_for(model.get_submodule(name).in_features, name)
        return names

    def quantizes(self, linear_name: str) -> bool:
        """Whether a linear of this short name (qkv_proj, ..., lm_head) is one this config quantizes."""
        return linear_name in self.modules or (linear_name == "lm_head" and self.lm_head)

    def target_names(self, model: nn.Module) -> list[str]:
        """targets() without the group check."""
        names = decoder_linear_names(len(model.layers), self.modules)
        if self.lm_head:
            names.append("lm_head")
        return names

    def to_dict(self) -> dict:
        """The ``quantization_config`` written to config.json."""
        out = {
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "modules": list(self.modules),
            "lm_head": self.lm_head,
            "act_quant": self.act_quant,
        }
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        return cls(**kwargs, extra={k: v for k, v in d.items() if k not in known})

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.bits}-bit {group} {'sym' if self.sym else 'asym'}{' W8A8' if self.act_quant else ''}"
