"""qspec's quantizers, packed checkpoint formats and quantized linear layers.

Algorithms produce integer codes, scales and zeros (QuantizedWeight); QuantLinear serves them with the same
forward contract as a linear layer; quantize.formats packs and saves them in layouts other tools load, and
registers its readers with runtime.loader (importing this package is enough for ``load_model`` to read them).
Each algorithm's entry point is its module: ``quantize.rtn``, ``quantize.int8``, ``quantize.gptq``,
``quantize.awq`` (``python -m quantize.gptq --help``).
"""

from quantize.awq import AWQ, AWQConfig
from quantize.config import QuantConfig, QuantConfigError
from quantize.formats import FORMATS, CheckpointError, load_quantized_into, save_quantized
from quantize.gptq import GPTQ, GPTQConfig, GPTQError
from quantize.int8 import SmoothQuant
from quantize.qembedding import QuantEmbedding
from quantize.qlinear import SUPPORTED_BITS, QuantizedWeight, QuantLinear, quant_linear

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
