"""The one table of weight quantizers: a name -> how it runs, one method syntax, one build function.

    NAME[:key=value,...]        e.g. rtn  rtn:mse=1  int8  my_pkg.hqq:HQQ:iters=20

NAME is a built-in (the table below), a name registered by ``register`` or by an installed package's entry point in
the group ``qspec.quantizers`` (``name = "my_pkg.mod:attr"``), or a plug-in given as ``module:attr`` (the same
syntax as speculate.registry's methods: runtime.plugins). Every entry names the CLI module that builds its
checkpoints (``python -m quantize.rtn``; plug-ins: ``python -m quantize.plugin --method NAME``), and, when it can
quantize a model in memory without calibration data, a factory of a ``WeightQuantizer``.

The plug-in contract: ``module:attr`` is a class built as ``Cls(**options)`` or a factory ``fn(**options)`` that
returns an object with a ``name`` (str) and ``quantize_model(model, cfg) -> model``. Subclassing ``WeightQuantizer``
supplies ``quantize_model``: define ``quantize_weight(weight [out, in], cfg, name) -> QuantizedWeight`` (integer
codes, scales, zeros on cfg's grid) and every QuantLinear path, checkpoint format and loader works unchanged.
A method that learns from data subclasses ``CalibratedQuantizer`` instead and defines ``quantize_weight(weight, cfg,
name, inputs)``: qspec runs its layer-by-layer calibration pass (quantize.calibration, the one GPTQ and AWQ use:
layers read one at a time with --layer-by-layer, finished layers kept for --resume, the lm_head last) and hands each
linear the inputs it sees with every layer before it already quantized. ``check_method`` checks all of that without
a model, so a CLI refuses a bad plug-in in one line before it loads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from quantize.calibration import LayerAlgorithm, Stage, calibrate
from quantize.config import QuantConfig, QuantConfigError
from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import QuantizedWeight, quant_linear, set_module
from quantize.rtn_weight import quantize_weight as rtn_weight
from runtime import plugins

ENTRY_POINT_GROUP = "qspec.quantizers"
PLUGIN_MODULE = "quantize.plugin"  # the CLI that runs any in-memory quantizer (plug-ins' checkpoints)


class QuantizerError(QuantConfigError):
    """A quantizer method that does not resolve, meet the contract or take these options (one line)."""


class WeightQuantizer:
    """Base of in-memory quantizers: one weight at a time onto cfg's grid; qspec walks the model."""

    name = "weights"

    def config(self, cfg: QuantConfig) -> QuantConfig:
        """The grid this quantizer runs on, given the CLI's (int8 fixes 8-bit per-channel symmetric)."""
        return cfg

    def quantize_weight(self, weight: Tensor, cfg: QuantConfig, name: str) -> QuantizedWeight:
        """weight [out, in] float -> codes [out, in] in [0, 2**bits), scales / zeros [out, n_groups]."""
        raise NotImplementedError

    def quantize_model(self, model: nn.Module, cfg: QuantConfig) -> nn.Module:
        """Replace every linear cfg targets by a QuantLinear (in place; the reference path); returns the model."""
        for name in cfg.targets(model):
            layer = model.get_submodule(name)
            qw = self.quantize_weight(layer.weight.detach(), cfg, name)
            if layer.bias is not None:
                qw = dataclasses.replace(qw, bias=layer.bias.detach().float())
            set_module(model, name, quant_linear(qw, cfg.act_quant, layer))
        if cfg.lm_head and model.config.tie_word_embeddings:
            tie_quantized_embedding(model)  # the embedding reads the quantized head's rows
        return model

    def describe(self) -> dict:
        return {"name": self.name}


class RTN(WeightQuantizer):
    """Round to nearest on cfg's grid (quantize.rtn_weight), optionally with an MSE search of each range."""

    name = "rtn"

    def __init__(self, mse: bool = False):
        self.mse = mse

    def quantize_weight(self, weight: Tensor, cfg: QuantConfig, name: str) -> QuantizedWeight:
        return rtn_weight(weight, cfg, mse=self.mse, name=name)

    def describe(self) -> dict:
        return {"name": self.name, "mse": self.mse}


class Int8(RTN):
    """int8 weight-only: RTN on the symmetric 8-bit per-channel grid, whatever grid the CLI was given."""

    name = "int8"

    def __init__(self):
        super().__init__(mse=False)

    def config(self, cfg: QuantConfig) -> QuantConfig:
        return dataclasses.replace(cfg, bits=8, group_size=-1, sym=True, extra=dict(cfg.extra))


class CalibratedQuantizer(WeightQuantizer):
    """Base of quantizers that learn from calibration data, one linear at a time, inside qspec's calibration pass."""

    name = "calibrated"
    calibrated = True  # quantize.plugin then takes --calib / --nsamples / --seqlen / --layer-by-layer / --resume

    def quantize_weight(self, weight: Tensor, cfg: QuantConfig, name: str, inputs: list[Tensor]) -> QuantizedWeight:
        """weight [out, in] float and the linear's calibration inputs (per batch of windows [B, T, in], fp32, the
        layers before it already quantized) -> codes [out, in] in [0, 2**bits), scales / zeros [out, n_groups]."""
        raise NotImplementedError

    def quantize_model(
        self, model: nn.Module, cfg: QuantConfig, tokens: Tensor | None = None, batch_size: int = 8
    ) -> nn.Module:
        """Quantize in place over calibration tokens [N, T] (what quantize.plugin does, without a checkpoint)."""
        if tokens is None:
            raise QuantizerError(
                f"quantizer {self.name!r} needs calibration tokens: run `python -m {PLUGIN_MODULE} --method ...`, "
                "or pass tokens [N, T] to quantize_model"
            )
        return calibrate(model, tokens, CalibrationStages(self, cfg), batch_size, cfg.lm_head)


class CalibrationStages(LayerAlgorithm):
    """A CalibratedQuantizer in the calibration pass: each targeted linear -> a QuantLinear from its weight and
    inputs; per layer the seconds and the relative output error on the first batch of inputs (a figure every
    method shares, to compare them: sum (x W^T - x Wq^T)^2 / sum (x W^T)^2)."""

    def __init__(self, quantizer: CalibratedQuantizer, cfg: QuantConfig):
        self.quantizer, self.cfg, self.stats = quantizer, cfg, []

    @torch.no_grad()
    def quantize_stage(self, stage: Stage) -> None:
        if not self.cfg.quantizes(stage.name):
            return
        linear, started = stage.linear, time.perf_counter()
        weight = linear.weight.detach()
        qw = self.quantizer.quantize_weight(weight, self.cfg, stage.full_name, stage.inputs)
        if linear.bias is not None:
            qw = dataclasses.replace(qw, bias=linear.bias.detach().float())
        seconds = time.perf_counter() - started
        x = stage.inputs[0].reshape(-1, weight.shape[1]).float()
        exact = x @ weight.float().T
        error = (exact - x @ qw.dequantize(torch.float32).T).square().sum() / exact.square().sum().clamp(min=1e-30)
        self.stats.append({"layer": stage.full_name, "seconds": round(seconds, 3), "output_rel_error": float(error)})
        set_module(stage.owner, stage.path, quant_linear(qw, self.cfg.act_quant, linear))


@dataclass(frozen=True)
class Entry:
    """A quantizer: the CLI module that builds its checkpoints, and, if it runs in memory, its factory."""

    module: str  # python -m module ... writes a checkpoint (experiments rows build with it)
    make: Callable[..., WeightQuantizer] | None = None  # make(**options); None: calibrated, CLI only
    options: dict[str, type | None] | None = None  # option -> type; None: any option
    grid: bool = True  # takes --bits / --group-size
    calibrated: bool = False  # takes --calib


def entry(make: Callable, module: str = PLUGIN_MODULE, **kw) -> Entry:
    return Entry(module, make, plugins.builder_options(make, 0, error=QuantizerError), **kw)


# The one table: name -> entry. register() adds to it; entry points and module:attr plug-ins resolve beside it.
REGISTRY: dict[str, Entry | Callable | str] = {
    "rtn": entry(RTN, "quantize.rtn"),
    "int8": entry(Int8, "quantize.int8", grid=False, calibrated=True),  # --calib: SmoothQuant's (--w8a8 --smooth)
    "gptq": Entry("quantize.gptq", calibrated=True),
    "awq": Entry("quantize.awq", calibrated=True),
    "fp8": Entry("quantize.fp8", grid=False, calibrated=True),  # FP8 / FP4 codes: quantize.fplinear
}
QUANTIZERS = tuple(REGISTRY)


def register(name: str, quantizer: Entry | Callable | str) -> None:
    """Register a WeightQuantizer class, a factory fn(**options) or a "module:attr" under name."""
    if ":" in name or "," in name:
        raise QuantizerError(f"a quantizer name holds no ':' or ',', got {name!r}")
    REGISTRY[name] = quantizer


def entry_points() -> dict[str, str]:
    return plugins.entry_points(ENTRY_POINT_GROUP)


def quantizer_names() -> list[str]:
    return [*REGISTRY, *(name for name in entry_points() if name not in REGISTRY)]


def inherited(obj, member: str, base: type = WeightQuantizer) -> bool:
    """Whether obj's member is base's own (not defined by the plug-in)."""
    own = getattr(obj, member, None)
    return getattr(own, "__func__", own) is getattr(base, member)


def calibrated(obj) -> bool:
    """Whether a quantizer (class, instance or factory) takes calibration data: CalibratedQuantizer's contract."""
    return getattr(obj, "calibrated", False) is True


def missing_members(obj) -> list[str]:
    """What a quantizer class (or instance) lacks of the contract quantize.plugin and the verdict use."""
    missing = []
    if not isinstance(getattr(obj, "name", None), str):
        missing.append("name (a str)")
    if calibrated(obj):
        if inherited(obj, "quantize_weight", CalibratedQuantizer):
            missing.append("quantize_weight(weight, cfg, name, inputs)")
    elif not callable(getattr(obj, "quantize_model", None)):
        missing.append("quantize_model(model, cfg)")
    elif inherited(obj, "quantize_model") and inherited(obj, "quantize_weight"):
        missing.append("quantize_weight(weight, cfg, name)")
    return missing


def resolve(name: str, text: str | None = None) -> Entry:
    """The entry of a registered name, an entry-point name or a module:attr plug-in, its contract checked."""
    found = REGISTRY.get(name) or entry_points().get(name)
    if found is None and ":" not in name:
        where = "" if (text or name) == name else f" in method {text!r}"
        raise QuantizerError(
            f"unknown quantizer {name!r}{where}; choose from {', '.join(quantizer_names())} or a plug-in module:attr"
        )
    found = found or name
    if isinstance(found, Entry):
        return found
    obj = plugins.load_attribute(name, found, QuantizerError) if isinstance(found, str) else found
    if isinstance(obj, type) and missing_members(obj):
        raise QuantizerError(
            f"plug-in {name!r}: class {obj.__qualname__} is not a quantizer: it lacks {', '.join(missing_members(obj))}"
            " (subclass quantize.registry.WeightQuantizer and define name and quantize_weight)"
        )
    if not callable(obj):
        raise QuantizerError(f"plug-in {name!r}: {obj!r} is neither a quantizer class nor a factory function")
    options = plugins.builder_options(obj, 0, name, QuantizerError, "(**options)")
    return Entry(PLUGIN_MODULE, obj, options, calibrated=calibrated(obj))


@dataclass(frozen=True)
class Method:
    name: str
    options: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}:{opts}" if opts else self.name


def check_method(method: str | Method) -> Method:
    """A method checked without a model: the name resolves (a plug-in imports and meets the contract) and every
    option is one it takes, of its type. Returns it with typed options; a problem is one QuantizerError line."""
    text = str(method).strip()
    name, opts = plugins.split_method(text, lambda n: n in REGISTRY or n in entry_points())
    given = plugins.parse_options(opts, lambda item: QuantizerError(f"bad option {item!r} in method {text!r}"))
    found = resolve(name, text)
    options = {}
    for key, value in given.items():
        if found.options is not None and key not in found.options:
            takes = ", ".join(f"{k}=" for k in found.options) or "no options"
            raise QuantizerError(f"unknown option {key!r} in method {text!r}; {name} takes {takes}")
        kind = None if found.options is None else found.options[key]
        options[key] = plugins.typed(value, kind, key, text, QuantizerError)
    return Method(name, options)


def build(method: str | Method) -> WeightQuantizer:
    """The in-memory quantizer a method describes: checked first, so bad input fails before any model loads."""
    method = check_method(method)
    found = resolve(method.name)
    if found.make is None:
        raise QuantizerError(
            f"quantizer {method.name!r} needs calibration data: run `python -m {found.module}`, then --model DIR"
        )
    quantizer = found.make(**method.options)
    missing = missing_members(quantizer)
    if missing:
        raise QuantizerError(f"plug-in {method.name!r} built {quantizer!r}, which lacks {', '.join(missing)}")
    return quantizer


def module_of(method: str) -> tuple[str, list[str]]:
    """(CLI module, leading arguments) that build a checkpoint with this method: a built-in's own module, or
    quantize.plugin --method METHOD."""
    checked = check_method(method)
    found = resolve(checked.name)
    return (found.module, []) if found.module != PLUGIN_MODULE else (PLUGIN_MODULE, ["--method", str(checked)])
