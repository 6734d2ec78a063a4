"""qspec's quantizers, packed checkpoint formats and quantized linear layers.

Algorithms produce integer codes, scales and zeros (QuantizedWeight); QuantLinear serves them with the same
forward contract as a linear layer; quantize.formats packs and saves them in layouts other tools load, and
registers its readers with runtime.loader (importing this package is enough for ``load_model`` to read them).
Each algorithm's entry point is its module: ``quantize.rtn``, ``quantize.int8``, ``quantize.gptq``,
``quantize.awq``, and ``quantize.plugin`` for any quantizer of ``quantize.registry`` (plug-ins included)
(``python -m quantize.gptq --help``). ``quantize.fast_copy`` builds a fast quantized copy of a model in memory (the
speed benchmarks' rows, quantized drafts).
"""

import importlib

from quantize.config import QuantConfig, QuantConfigError
from quantize.formats import FORMATS, CheckpointError, load_quantized_into, save_quantized
from quantize.qembedding import QuantEmbedding
from quantize.qlinear import SUPPORTED_BITS, QuantizedWeight, QuantLinear, quant_linear

# Entry-point modules (python -m ...) load on first use of their names: importing them with the package would
# make runpy warn that the module ran after it was already imported.
_LAZY = {
    "AWQ": "quantize.awq",
    "AWQConfig": "quantize.awq",
    "GPTQ": "quantize.gptq",
    "GPTQConfig": "quantize.gptq",
    "GPTQError": "quantize.gptq",
    "SmoothQuant": "quantize.int8",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AWQ",
    "FORMATS",
    "GPTQ",
    "SUPPORTED_BITS",
    "AWQConfig",
    "CheckpointError",
    "GPTQConfig",
    "GPTQError",
    "QuantConfig",
    "QuantConfigError",
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedWeight",
    "SmoothQuant",
    "load_quantized_into",
    "quant_linear",
    "save_quantized",
]
