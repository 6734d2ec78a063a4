"""One builder of a fast quantized copy of a model: what the speed benchmarks time and what a quantized draft
proposes with. Round-to-nearest codes (quantize.rtn_weight) or FP8 / FP4 (quantize.fplinear) on each targeted
linear of a deep copy, every quantized layer on its device's automatic fast path.

Quality measurements want the exact reference path instead: quantize.rtn's and quantize.fp8's quantize_model
(in place, pinned to the dequantize-every-forward path), or a checkpoint those commands wrote.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from quantize.config import QuantConfig
from quantize.fplinear import FPLinear, quantize_fp4, quantize_fp8
from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import QuantLinear, set_module
from quantize.rtn_weight import quantize_weight
from runtime.config import DTYPES
from runtime.loader import load_model

# the named copies the speed benchmarks time (evals.speed.bench_decode's qspec rows, the targets of
# evals.speculation.spec_cost and specbench --dtype)
NAMED_COPIES = (
    "fp32",
    "bf16",
    "bf16-fp32head",
    "int8",
    "int4",
    "int4-int8head",
    "fp8",
    "w8a8",
    "w4a8",
    "w4a8-int8head",
    "w4a8-w8a8head",
)
INT8_HEAD = QuantConfig(bits=8, group_size=-1, sym=True, modules=(), lm_head=True)  # per-channel symmetric
W8A8_HEAD = QuantConfig(bits=8, group_size=-1, sym=True, modules=(), lm_head=True, act_quant=True)  # + int8 inputs


def fast_quantized_copy(
    model: nn.Module,
    cfg: QuantConfig,
    head: QuantConfig | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    codes_from_copy: bool = False,
    int8_activations: bool | None = None,
) -> nn.Module:
    """A deep copy of a runtime.model.Transformer with cfg's linears quantized (FP8 / FP4 when cfg comes from
    quantize.fp8.float_config, else RTN) and, with ``head``, the lm_head quantized on head's grid. A tied
    embedding reads the rows of an RTN-quantized head (no full-precision table is kept).

    dtype: the copy's compute dtype, mixed (fp32 residual stream: the shape qspec's CPU step runs in one call);
    None keeps the model's. Codes are rounded from the source model's weights (full precision: the codes a
    quantize.rtn checkpoint of it would hold); ``codes_from_copy`` rounds the copy's, after the dtype cast.
    int8_activations: override cfg.act_quant for the decoder linears (W4A8: int4 codes with int8 activations, an
    approximation no checkpoint format holds, so QuantConfig refuses it; the head keeps its own grid's)."""
    fast = copy.deepcopy(model)  # a deepcopy keeps a tied lm_head tied inside the copy
    if dtype is not None and dtype != fast.compute_dtype:
        fast.set_dtype(dtype, mixed=True)
    source = fast if codes_from_copy else model
    grids = [cfg] if head is None else [cfg, head]
    for grid in grids:
        for name in grid.targets(fast):
            act = grid.act_quant if int8_activations is None or grid is head else int8_activations
            set_module(fast, name, _quantized_layer(source.get_submodule(name), fast.get_submodule(name), grid, act))
    if isinstance(fast.lm_head, QuantLinear) and fast.config.tie_word_embeddings:
        tie_quantized_embedding(fast)  # one packed table serves the head and the embedding
    for layer in fast.modules():
        if isinstance(layer, QuantLinear | FPLinear):
            layer.auto = True  # each layer picks its device's fast path at its first forward
    return fast.eval()


def _quantized_layer(source: nn.Module, like: nn.Module, cfg: QuantConfig, act_quant: bool) -> nn.Module:
    """The quantized layer for one linear: codes from ``source``'s weight, compute dtype and device of ``like``
    (the copy's linear it replaces)."""
    dtype, device = like.weight.dtype, like.weight.device
    fmt = cfg.extra.get("fmt")
    if fmt is None:
        qweight = quantize_weight(source.weight, cfg, source.bias)
        return QuantLinear(qweight, act_quant=act_quant, compute_dtype=dtype).to(device)
    if cfg.extra.get("scale_search"):
        raise ValueError("a fast copy rounds FP8 scales to amax / 448; searched scales need quantize.fp8")
    if fmt == "e4m3":
        block = (cfg.extra.get("weight_block_size") or [0])[0]
        fweight = quantize_fp8(source.weight, block, source.bias)
    else:
        fweight = quantize_fp4(source.weight, fmt, source.bias)
    return FPLinear(fweight, act_quant=act_quant, compute_dtype=dtype).to(device)


def named_fast_copy(base: nn.Module, name: str) -> nn.Module:
    """The fp32 base model in one of NAMED_COPIES: dense fp32 (the base itself) / bf16 / bf16 with an fp32 head,
    FP8 e4m3 per-channel, or RTN codes on every decoder linear (int8 per-channel symmetric, int4 group 64
    asymmetric; -int8head: the tied head int8 too), all with bf16 activations; w8a8 / w4a8: the int8 / int4 codes
    with int8 activations (per token, dynamic; w4a8-int8head: int8 activations into 4-bit layers and an 8-bit head
    with bf16 inputs; w4a8-w8a8head: the head's inputs int8 too, llama.cpp Q4_K_M's shape, whose output layer takes
    Q8_K activations: an integer head, the fastest one-row step on CPUs whose float units bound the head)."""
    if name not in NAMED_COPIES:
        raise ValueError(f"unknown copy {name!r}; choose from {', '.join(NAMED_COPIES)}")
    if name == "fp32":
        return base
    if name == "bf16-fp32head":
        return copy.deepcopy(base).set_dtype(torch.bfloat16, head_dtype=torch.float32)
    if name == "bf16":
        return copy.deepcopy(base).set_dtype(torch.bfloat16)
    if name == "fp8":
        fp8 = QuantConfig(bits=8, group_size=-1, sym=True)
        fp8.extra.update(fmt="e4m3")
        return fast_quantized_copy(base, fp8)
    layers = name.removesuffix("-int8head").removesuffix("-w8a8head")
    bits, group = (8, -1) if layers in ("int8", "w8a8") else (4, 64)
    cfg = QuantConfig(bits=bits, group_size=group, sym=bits == 8)
    head = INT8_HEAD if name.endswith("-int8head") else W8A8_HEAD if name.endswith("-w8a8head") else None
    return fast_quantized_copy(base, cfg, head=head, int8_activations=layers in ("w8a8", "w4a8"))


def load_named_copy(spec: str, name: str):
    """(model, ModelConfig, checkpoint dir) of a model spec as the named copy ``name``: fp32 / bf16 load in that
    dtype, every other copy is built from the fp32 weights (its codes are the ones a checkpoint of them holds)."""
    if name in ("fp32", "bf16"):
        return load_model(spec, dtype=DTYPES[name])
    if name not in NAMED_COPIES:
        raise ValueError(f"unknown copy {name!r}; choose from {', '.join(NAMED_COPIES)}")
    model, config, path = load_model(spec, dtype=torch.float32)
    return named_fast_copy(model, name), config, path
