"""qspec's runtime: Llama-family model code, KV caches, the one sampler, decoding loops, the serving engine.

runtime is the lowest layer (runtime <- quantize <- speculate <- evals <- experiments): it imports none of the
others and defines the contracts they plug into: a linear layer is any module with ``forward(x)``
(runtime.model), the checkpoint-format registry (runtime.loader.register_quantized_format), the model's shape
(runtime.layout), and the provenance every result record carries (runtime.provenance).

Importing it installs the compiled CPU step as the process's model backend (runtime.backends): runtime.model is
the plain PyTorch model, and the step takes over where it applies (CPU, no autograd), for every model however built.
"""

from runtime.backends import CPU_STEP
from runtime.config import DTYPES, ModelConfig, UnsupportedModelError
from runtime.decoding import GenerationOutput, encode_prompt, generate
from runtime.engine import EngineConfig, LLMEngine, RequestOutput
from runtime.kv_cache import KVCache
from runtime.layout import DECODER_LINEARS, device_of
from runtime.loader import (
    DEFAULT_MODEL,
    ModelSpecError,
    load_model,
    load_tokenizer,
    register_quantized_format,
    resolve,
    save_checkpoint,
)
from runtime.model import AttentionMetadata, Transformer, random_model, set_backend
from runtime.paths import qspec_home
from runtime.provenance import provenance
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.stopping import StopChecker

set_backend(CPU_STEP)

__all__ = [
    "DECODER_LINEARS",
    "DEFAULT_MODEL",
    "DTYPES",
    "AttentionMetadata",
    "EngineConfig",
    "GenerationOutput",
    "KVCache",
    "LLMEngine",
    "ModelConfig",
    "ModelSpecError",
    "RequestOutput",
    "SamplingParams",
    "StopChecker",
    "Transformer",
    "UnsupportedModelError",
    "device_of",
    "encode_prompt",
    "generate",
    "load_model",
    "load_tokenizer",
    "logits_to_probs",
    "provenance",
    "qspec_home",
    "random_model",
    "register_quantized_format",
    "resolve",
    "save_checkpoint",
]
