"""Packed quantized checkpoints in the layouts other tools load: GPTQ (v1 "gptq" and "gptq_v2"), AWQ GEMM and
compressed-tensors (llm-compressor / vLLM); and qspec's own format, for what no other tool can run.

"qspec": compressed-tensors' tensor layout under ``quant_method: qspec`` with the model's online Hadamard
rotations (quantize.rotation) in ``quantization_config.rotation``: every setting compressed-tensors holds (W8A8
included) plus the online rotations, which its loaders could not re-install. Other tools refuse the unknown
quant_method instead of running a rotated model without its rotations; qspec's loader reads it.

``save_quantized`` writes an HF-style directory (config.json with ``quantization_config``, safetensors with
per-layer packed tensors under the unfused HF names q_proj/k_proj/v_proj, gate_proj/up_proj); layers that are
not QuantLinear are saved as plain weights, in the dense dtype config.json declares (bf16 unless asked).
A setting a format cannot express (a ragged last group, act-order g_idx, bits, int8 activations, widths its
packing cannot fill) is refused before anything is written (``refusal``), naming the layer and what would work;
what only the quantized values show (GPTQ v1 cannot store a zero point of 0) is ``zero_point_refusal``, and
``holding_format`` names the nearest format that holds a model when the asked-for one does not.
``load_quantized_into`` reads such a directory, whoever wrote it, into a runtime Transformer, concatenating the
parts back into the fused qkv_proj / gate_up_proj QuantLinears.
A quantized lm_head of a tied model is written once (``lm_head: true``, no dense embedding table) and loads as
both the head and the embedding (quantize.qembedding.QuantEmbedding).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from quantize.formats import awq, gptq
from quantize.formats import compressed_tensors as ct
from quantize.formats.errors import CheckpointError, check_safetensors_file, group_layout
from quantize.fplinear import FloatWeight, FPLinear
from quantize.packing import block_shape
from quantize.qembedding import shares_quantized_head, tie_quantized_embedding
from quantize.qlinear import QuantizedWeight, QuantLinear, set_module
from quantize.rotation import HadamardMLP, RotatedRMSNorm, install_online_hadamard
from runtime import layout
from runtime.kernels import cpu_step
from runtime.loader import load_state_dict, register_quantized_format, save_checkpoint

FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "qspec")
CT_LAYOUT = ("compressed-tensors", "qspec")  # formats whose tensors are compressed-tensors'
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
__all__ = [
    "FORMATS",
    "DENSE_DTYPES",
    "CheckpointError",
    "default_format",
    "refusal",
    "zero_point_refusal",
    "holding_format",
    "save_quantized",
    "load_quantized_into",
    "linear_layout",
    "float_refusal",
    "round_dense_tensors",
]


def default_format(method: str, act_quant: bool = False, bits: int = 4, sym: bool = False, online: bool = False) -> str:
    """The format most loaders read for a method's checkpoints (online: the model carries online rotations, which
    only qspec's loader re-installs -> "qspec").

    GPTQ and RTN/int8 weight-only -> "gptq" (v1): transformers (gptqmodel), AutoGPTQ, vLLM (gptq, gptq_marlin),
    TGI, SGLang and ExLlama all read it; RTN is GPTQ's grid without the Hessian update, and 8-bit is in v1.
    Asymmetric 2/3-bit grids -> "gptq_v2": v1 stores zero - 1 and so cannot hold zero point 0, which those grids
    do produce (a few groups with no negative weight: 4 of 1.66M on SmolLM2 at 3-bit g64); gptqmodel and
    transformers read v2. 4- and 8-bit asymmetric grids produce zero point 0 only where a group's most negative
    weight is under half a step (e.g. next to a large positive outlier), which a model may or may not have: they
    default to v1, and the quantizer CLIs write gptq_v2 instead when the codes show one (``holding_format``).
    AWQ -> "awq" (GEMM): what AutoAWQ, transformers and vLLM's awq / awq_marlin read.
    W8A8 -> compressed-tensors (int-quantized): the only one of these formats that can say activations are int8.
    """
    if online:
        return "qspec"
    if act_quant:
        return "compressed-tensors"
    if method.startswith("awq") and bits == 4:
        return "awq"
    return "gptq_v2" if bits < 4 and not sym else "gptq"


def dividing_group_sizes(widths: list[int]) -> str:
    """Group sizes (multiples of 16, as the packed kernels want) that divide every width, for error messages."""
    from math import gcd

    g = 0
    for w in widths:
        g = gcd(g, w)
    sizes = [d for d in range(16, g + 1, 16) if g % d == 0]
    return ", ".join(map(str, sizes)) + (" or " if sizes else "") + "-1 (per-channel)"


def refusal(
    fmt: str,
    name: str,
    in_features: int,
    out_features: int,
    bits: int,
    group_size: int,
    g_idx: bool = False,
    act_quant: bool = False,
    sym: bool = False,
    widths: list[int] | None = None,
    parts: list[int] | None = None,
) -> str | None:
    """Why `fmt` cannot hold this layer's setting (one line naming the layer and what would work), or None.

    group_size is the layer's (>= in_features: per-channel); widths: every quantized layer's input width, for
    the list of group sizes that would work; parts: the output rows of the tensors the layer is saved as (a
    fused qkv_proj is saved as q/k/v_proj; default: one tensor of out_features rows). Shapes and settings only:
    the values' own limit (GPTQ v1 zero points) is zero_point_refusal.
    """
    parts = parts or [out_features]
    grouped = group_size < in_features
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}"
    if grouped and in_features % group_size:
        return (
            f"{name}: in_features {in_features} is not a multiple of group size {group_size}; {fmt} would need a "
            f"ragged last group, which its loaders reject: use --group-size "
            f"{dividing_group_sizes(widths or [in_features])}"
        )
    if fmt in ("gptq", "gptq_v2"):
        if act_quant:
            return (
                f"{name}: W8A8 (int8 activations) cannot be expressed in a GPTQ checkpoint (other loaders would "
                "run it weight-only): use --format compressed-tensors"
            )
        per_block = block_shape(bits)[0]
        ragged = [f"in_features {in_features}"] if in_features % per_block else []
        ragged += [f"{n} output rows" for n in parts if n % per_block]
        if ragged:
            return (
                f"{name}: GPTQ packs {bits}-bit codes {per_block} at a time along both dimensions, and "
                f"{', '.join(ragged)} are not a multiple of {per_block}: use --format compressed-tensors (which pads "
                f"a short tail){', or drop --lm-head' if name == 'lm_head' else ''}"
            )
        return None
    if fmt == "awq":
        if bits != 4:
            return (
                f"{name}: AWQ GEMM stores 4-bit codes, this layer has {bits} bits: use --format gptq or "
                "compressed-tensors"
            )
        if g_idx:
            return (
                f"{name}: AWQ has no g_idx, so act-order (permuted groups) cannot be saved: use --format gptq, or "
                "--static-groups"
            )
        if act_quant:
            return f"{name}: W8A8 (int8 activations) cannot be expressed in AWQ: use --format compressed-tensors"
        if any(n % 8 for n in parts):
            return (
                f"{name}: AWQ GEMM packs 8 output columns per word; output rows {parts} are not all multiples of 8: "
                "use --format compressed-tensors"
            )
        return None
    # compressed-tensors' layout (also qspec's)
    if g_idx:
        return (
            f"{name}: {fmt} (compressed-tensors >= 0.14) has no g_idx (actorder 'group' was removed), so act-order "
            "with permuted groups cannot be saved: use --static-groups (actorder 'weight') or --format gptq"
        )
    if act_quant and (grouped or not sym or bits != 8):
        return f"{name}: compressed-tensors W8A8 (int-quantized) holds symmetric per-channel int8 weights"
    return None


def linear_layout(model, quantized_head: bool = False) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each linear module of a runtime Transformer with the HF tensor prefixes of its row blocks.

    e.g. ("layers.0.self_attn.qkv_proj", [("model.layers.0.self_attn.q_proj", 576), (".k_proj", 192), ...]).
    A tied lm_head is listed only when it is (or, quantized_head, is about to be) a QuantLinear.
    """
    cfg = model.config
    with_head = quantized_head or isinstance(model.lm_head, QuantLinear) or not cfg.tie_word_embeddings
    return layout.linear_layout(cfg, with_head)


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """A fused QuantizedWeight -> one per row block (the input-side grouping, g_idx, is shared)."""
    parts, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        bias = None if qw.bias is None else qw.bias[rows].clone()
        parts.append(
            QuantizedWeight(qw.codes[rows], qw.scales[rows], qw.zeros[rows], qw.bits, qw.group_size, qw.g_idx, bias)
        )
        start += n
    return parts


def concat_rows(name: str, parts: list[tuple[str, QuantizedWeight]]) -> QuantizedWeight:
    first_name, first = parts[0]
    for part_name, qw in parts[1:]:
        if (qw.bits, qw.group_size) != (first.bits, first.group_size):
            raise CheckpointError(f"{part_name}: bits/group size differ from {first_name}; cannot fuse into {name}")
        if not torch.equal(first.group_index(), qw.group_index()):
            raise CheckpointError(
                f"tensor {part_name}.g_idx differs from {first_name}.g_idx: {name} fuses them and needs one grouping"
            )
    biases = [qw.bias for _, qw in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise CheckpointError(f"{name}: some of {[n for n, _ in parts]} have a bias and some do not")
    return QuantizedWeight(
        codes=torch.cat([qw.codes for _, qw in parts]),
        scales=torch.cat([qw.scales for _, qw in parts]),
        zeros=torch.cat([qw.zeros for _, qw in parts]),
        bits=first.bits,
        group_size=first.group_size,
        g_idx=first.g_idx,
        bias=None if biases[0] is None else torch.cat(biases),
    )


def split_float_rows(fw: FloatWeight, sizes: list[int]) -> list[FloatWeight]:
    """A fused e4m3 FloatWeight -> one per row block; block scales split at block rows (float_refusal checked
    that every part but the last fills whole blocks)."""
    parts, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        srows = rows if not fw.block else slice(start // fw.block, -(-(start + n) // fw.block))
        bias = None if fw.bias is None else fw.bias[rows].clone()
        parts.append(FloatWeight(fw.codes[rows], fw.scales[srows], fw.fmt, fw.block, bias=bias))
        start += n
    return parts


def concat_float_rows(name: str, parts: list[tuple[str, FloatWeight]]) -> FloatWeight:
    first = parts[0][1]
    if first.block and any(fw.out_features % first.block for _, fw in parts[:-1]):
        raise CheckpointError(
            f"{name}: the block scales of {[n for n, _ in parts]} do not fill whole {first.block}-row blocks, so "
            "they cannot be fused into one layer"
        )
    biases = [fw.bias for _, fw in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise CheckpointError(f"{name}: some of {[n for n, _ in parts]} have a bias and some do not")
    return FloatWeight(
        torch.cat([fw.codes for _, fw in parts]),
        torch.cat([fw.scales for _, fw in parts]),
        "e4m3",
        first.block,
        bias=None if biases[0] is None else torch.cat(biases),
    )


def float_layers(model) -> list[tuple[str, FPLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FPLinear)]


def float_refusal(model, names: list[str], fmt: str, block: int) -> str | None:
    """Why the FP8 layers ``names`` (e4m3, one scale block size) cannot be saved (one line), or None: only
    compressed-tensors float-quantized holds them, a tied head has no place there, and block scales of a fused
    layer must not straddle the HF parts it splits into."""
    if fmt != "e4m3":
        return f"{fmt} is emulated (no FP4 checkpoint layout is written): only e4m3 layers can be saved"
    if "lm_head" in names and model.config.tie_word_embeddings:
        return "lm_head: a quantized head of a tied model cannot be expressed in compressed-tensors: drop --lm-head"
    for module_name, parts in linear_layout(model, quantized_head=True):
        sizes = [n for _, n in parts]
        if module_name in names and block and any(n % block for n in sizes[:-1]):
            return (
                f"{module_name}: {block} x {block} scale blocks would straddle its parts {sizes} "
                "(the checkpoint stores them unfused): use per-channel scales (no --block-size) or a block size "
                "dividing them"
            )
    return None


def check_float_expressible(model, layers: list[tuple[str, FPLinear]], fmt: str) -> int:
    """Raise CheckpointError unless the model's FP8 ``layers`` can be saved as ``fmt``; returns their block size."""
    if fmt != "compressed-tensors":
        raise CheckpointError(f"FP8 layers are saved as compressed-tensors (float-quantized) only, not {fmt}")
    if quantized_layers(model):
        raise CheckpointError("the model mixes integer (QuantLinear) and FP8 layers; one quantization_config needs one")
    schemes = {(m.fmt, m.block, m.act_quant) for _, m in layers}
    if len(schemes) > 1:
        raise CheckpointError(f"FP8 layers mix schemes (format, block, W8A8) {sorted(schemes)}; one config needs one")
    fmt_name, block, _ = schemes.pop()
    why = float_refusal(model, [n for n, _ in layers], fmt_name, block)
    if why:
        raise CheckpointError(why)
    return block


def quantized_layers(model) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def is_symmetric(layer: QuantLinear) -> bool:
    return bool((layer.zeros.float() == 2 ** (layer.bits - 1)).all())  # the buffer: no unpacking


def online_rotated(model) -> bool:
    """Whether the model applies Hadamard rotations at run time (quantize.rotation's online modules)."""
    return any(isinstance(m, HadamardMLP | RotatedRMSNorm) for m in model.modules())


def check_expressible(model, fmt: str, quant_config: dict | None = None) -> None:
    """Raise CheckpointError (one line naming the layer) if `fmt` cannot hold some QuantLinear of the model, or
    its online rotations (only qspec's loader re-installs them, from quant_config's rotation record)."""
    if online_rotated(model):
        if fmt == "compressed-tensors":
            raise CheckpointError(
                "the model applies online Hadamard rotations, which compressed-tensors' loaders cannot re-install: "
                "use --format qspec"
            )
        if not (quant_config or {}).get("rotation"):
            raise CheckpointError("the model applies online Hadamard rotations but its metadata has no rotation record")
    layers = quantized_layers(model)
    widths = [m.in_features for _, m in layers]
    parts = {name: [n for _, n in rows] for name, rows in linear_layout(model)}
    for name, m in layers:
        why = refusal(
            fmt,
            name,
            m.in_features,
            m.out_features,
            m.bits,
            m.group_size,
            g_idx=m.g_idx is not None,
            act_quant=m.act_quant,
            sym=is_symmetric(m),
            widths=widths,
            parts=parts.get(name),
        )
        if why:
            raise CheckpointError(why)
    why = zero_point_refusal(model, fmt)
    if why:
        raise CheckpointError(why)
    if fmt in CT_LAYOUT and shares_quantized_head(model):
        raise CheckpointError(
            "lm_head: a quantized head shared with the tied embedding cannot be expressed in compressed-tensors "
            "(the embedding needs its own dense table there): drop --lm-head or use --format gptq"
        )


def zero_range(fmt: str, bits: int) -> tuple[int, int]:
    """The zero points a format's integer layout stores: GPTQ v1 writes zero - 1 into `bits` bits (AutoGPTQ's
    kernels add the one back), so its range is [1, 2**bits]; the others store the zero point as is."""
    return (1, 2**bits) if fmt == "gptq" else (0, 2**bits - 1)


def zero_point_refusal(model, fmt: str) -> str | None:
    """Why `fmt` cannot store the zero points the model's QuantLinears actually have (one line), or None.

    Only the quantized values show this: an asymmetric grid puts a group's zero point at round(-min / step),
    which is 0 when the group's most negative weight is under half a step, i.e. it has no negative weight or
    one large positive outlier dwarfs them; GPTQ v1 (zero - 1 in `bits` bits) cannot store that 0."""
    bad, first, total = 0, None, 0
    for name, m in quantized_layers(model):
        z = m.zeros.double()
        if not torch.equal(z, z.round()):
            return f"{name}: zero points are not integers; integer checkpoint formats store integer zero points"
        low, high = zero_range(fmt, m.bits)
        outside = int(((z < low) | (z > high)).sum())
        total += z.numel()
        if outside:
            bad += outside
            first = first or (name, int(z.min()), int(z.max()), low, high, m.bits)
    if not bad:
        return None
    name, zmin, zmax, low, high, bits = first
    what = f"{name}: zero points span [{zmin}, {zmax}] ({bad} of {total} groups of the model outside [{low}, {high}])"
    if fmt == "gptq" and zmin == 0:
        return (
            f"{what}: GPTQ v1 stores zero - 1, so zero point 0, which an asymmetric grid gives a group whose most "
            "negative weight is under half a step (none, or a large positive outlier beside it), needs --format "
            "gptq_v2 or compressed-tensors, or --sym"
        )
    return f"{what}: {fmt} with {bits} bits stores [{low}, {high}]"


FALLBACK_ORDER = ("gptq_v2", "compressed-tensors", "qspec")  # nearest to a GPTQ / AWQ request first


def holding_format(model, fmt: str, quant_config: dict | None = None) -> tuple[str, str | None]:
    """(fmt, None) when `fmt` holds the model's quantized layers; otherwise (the nearest format that does, why
    `fmt` cannot): gptq_v2 (the same layout and loaders' config keys, zero points as is), then compressed-tensors,
    then qspec's own. Raises CheckpointError when none does. For what is known only after quantizing (a GPTQ v1
    zero point of 0); the quantizer CLIs refuse what the arguments already decide before the model loads."""
    if float_layers(model):
        return fmt, None  # FP8: one format, checked before quantizing (check_float_expressible when saving)
    try:
        check_expressible(model, fmt, quant_config)
        return fmt, None
    except CheckpointError as err:
        why = str(err)
    for alt in FALLBACK_ORDER:
        if alt == fmt:
            continue
        try:
            check_expressible(model, alt, quant_config)
        except CheckpointError:
            continue
        return alt, why
    raise CheckpointError(why)


def config_group_size(layers: list[tuple[str, QuantLinear]]) -> int:
    """The one ``group_size`` a quantization_config gives these layers (-1: per-channel). A layer whose group is
    its whole width is per-channel and agrees with any group at least that wide (loaders then use one group per
    row), so group 64 on widths 64 and 128 is one config; a per-channel layer wider than the others' group is not."""
    grouped = {m.group_size for _, m in layers if m.group_size < m.in_features}
    group = grouped.pop() if len(grouped) == 1 else -1
    if grouped or any(group != -1 and m.group_size >= m.in_features > group for _, m in layers):
        sizes = sorted({min(m.group_size, m.in_features) for _, m in layers})
        raise ValueError(f"save_quantized: layers mix group sizes {sizes}; one quantization_config needs one")
    return group


def agrees_with_layers(key: str, value, derived, layers: list[tuple[str, QuantLinear]]) -> bool:
    """Whether the caller's quant_config[key] describes the layers as the derived value does (group_size: the
    same group per layer, e.g. 64 and -1 on layers 64 wide)."""
    if key != "group_size" or not isinstance(value, int) or value == 0:
        return value == derived
    return all(group_layout(value, m.in_features)[0] == group_layout(derived, m.in_features)[0] for _, m in layers)


def quantization_config_for(model, quant_config: dict, fmt: str) -> dict:
    """The config.json ``quantization_config``: what the layers actually are, plus the caller's metadata
    (GPTQ / AWQ; compressed-tensors gets exactly the keys llm-compressor writes)."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("save_quantized: the model has no QuantLinear layers")
    bits = {m.bits for _, m in layers}
    if len(bits) > 1:
        raise ValueError(f"save_quantized: layers mix bit widths {sorted(bits)}; one quantization_config needs one")
    group_size = config_group_size(layers)
    act_quant = {m.act_quant for _, m in layers}
    if len(act_quant) > 1:
        raise ValueError("save_quantized: some layers quantize activations (W8A8) and some do not")
    derived = {
        "bits": bits.pop(),
        "group_size": group_size,
    }
    sym = all(is_symmetric(m) for _, m in layers)
    if fmt in CT_LAYOUT:
        quantized = {n for n, _ in layers}
        ignore = [hf for name, parts in linear_layout(model) if name not in quantized for hf, _ in parts]
        if "lm_head" not in quantized and "lm_head" not in ignore:
            ignore.append("lm_head")  # tied heads too: transformers builds an lm_head Linear for them
        static_act_order = bool(quant_config.get("act_order")) and not any(m.g_idx is not None for _, m in layers)
        document = ct.quantization_config(
            derived["bits"],
            derived["group_size"],
            sym,
            act_quant.pop(),
            ignore,
            actorder="weight" if static_act_order else None,
        )
        return document if fmt == "compressed-tensors" else qspec_document(document, quant_config)
    if fmt in ("gptq", "gptq_v2"):
        derived.update(
            quant_method="gptq",
            checkpoint_format=fmt,
            desc_act=any(m.g_idx is not None for _, m in layers),
            sym=sym,
            lm_head=isinstance(model.lm_head, QuantLinear),
            pack_dtype="int32",
        )
    else:
        derived.update(quant_method="awq", version="gemm", zero_point=True, modules_to_not_convert=None)
    out = {**quant_config, **derived}
    for key, value in quant_config.items():
        if key in derived and value != derived[key]:
            if key == "group_size" and agrees_with_layers(key, value, derived[key], layers):
                continue  # the same grouping: the derived value is written
            if key in ("bits", "group_size", "desc_act"):
                raise ValueError(
                    f"save_quantized: quant_config[{key!r}] = {value!r} but the layers say {derived[key]!r}"
                )
            # e.g. quant_method "rtn": the algorithm, not the format other loaders dispatch on; kept under meta
            out.setdefault("meta", {})[key] = value
    if any(m.act_quant for _, m in layers):
        out["act_quant"] = True  # read back by qspec only; refusal() keeps new W8A8 saves out of GPTQ files
    return out


def qspec_document(document: dict, quant_config: dict) -> dict:
    """qspec's quantization_config: a compressed-tensors document under quant_method qspec, with the rotation."""
    out = {**document, "quant_method": "qspec", "layout": "compressed-tensors"}
    if quant_config.get("rotation"):
        out["rotation"] = quant_config["rotation"]
    return out


@torch.no_grad()
def round_dense_tensors(model, dense_dtype: torch.dtype) -> None:
    """Round, in place, what ``save_quantized`` stores in dense_dtype to that dtype's values (the tensors keep
    their own dtype): every parameter (embeddings, norms, unquantized linears and their biases; quantized layers
    have none) and the quantized layers' biases. A model measured after this gives the figure its checkpoint
    reloads to; quantized codes and scales are stored as they are. Buffers that are not saved (rotary
    frequencies, Hadamard matrices) are rebuilt at load and left alone. The rounded values are new tensors, so
    kernels' views keyed by the old ones (runtime.model's dense linears) are rebuilt."""
    for p in model.parameters():  # tied parameters are listed once and stay tied (one Parameter)
        if p.is_floating_point() and p.dtype != dense_dtype:
            p.data = p.data.to(dense_dtype).to(p.dtype)
    for m in model.modules():
        if isinstance(m, QuantLinear | FPLinear) and m.bias is not None and m.bias.dtype != dense_dtype:
            m.bias = m.bias.to(dense_dtype).to(m.bias.dtype)
            cpu_step.drop_kernel_weight(m)  # a CPU kernel's view holding the old bias


def save_quantized(
    model,
    out_dir: str | Path,
    quant_config: dict,
    tokenizer_from: Path | None = None,
    fmt: str = "gptq_v2",
    max_shard_bytes: int | None = None,
    dense_dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a model whose linear layers are QuantLinear as a packed checkpoint directory.

    quant_config: the quantizer's metadata (e.g. {"damp_percent": 0.01, "true_sequential": True, "meta": {...}}),
    merged into a GPTQ / AWQ ``quantization_config`` (compressed-tensors: kept under the top-level config.json
    key ``qspec_quant_config``); bits / group_size / desc_act / sym are derived from the layers and may be given
    only if they agree. Scales are stored in fp16 as every GPTQ/AWQ loader expects them (compressed-tensors
    too). Everything not quantized (embeddings, norms, dense linears, biases) is stored in dense_dtype, which
    config.json declares. A setting the format cannot hold raises CheckpointError before anything is written.
    """

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    if dense_dtype not in DENSE_DTYPES.values():
        raise ValueError(f"dense_dtype must be one of {list(DENSE_DTYPES.values())}, got {dense_dtype}")
    floats = float_layers(model)
    if floats:
        block = check_float_expressible(model, floats, fmt)
        quantized = {n for n, _ in floats}
        ignore = [hf for name, parts in linear_layout(model) if name not in quantized for hf, _ in parts]
        if "lm_head" not in quantized and "lm_head" not in ignore:
            ignore.append("lm_head")  # tied heads too, as for integer compressed-tensors
        qconfig = ct.float_quantization_config(block, floats[0][1].act_quant, ignore)
    else:
        check_expressible(model, fmt, quant_config)
        qconfig = quantization_config_for(model, quant_config, fmt)
    # dense tensors under HF names, in the declared dtype; the quantized layers' packed tensors are added below.
    # Their modules are skipped, not read: a QuantLinear's (FPLinear's) .weight dequantizes it to a full fp32
    # matrix, and reading them all held a second, fp32 copy of the model at the save (the 1.5B: 12.6 GB peak).
    replaced = {name for name, m in model.named_modules() if isinstance(m, QuantLinear | FPLinear)}
    if shares_quantized_head(model):
        # the embedding is the quantized lm_head (written below, lm_head: true): no dense table on disk either
        replaced.add("embed_tokens")
    dense = model.hf_state_dict(skip=replaced)
    state = {k: v.to(dense_dtype) if v.is_floating_point() else v for k, v in dense.items()}
    sym = all(is_symmetric(m) for _, m in quantized_layers(model))  # one scheme: zero points for all or none
    for module_name, parts in linear_layout(model):
        module = model.get_submodule(module_name)
        if not isinstance(module, QuantLinear | FPLinear):
            continue
        sizes = [n for _, n in parts]
        split = split_float_rows(module.fweight(), sizes) if isinstance(module, FPLinear) else None
        for (prefix, _), qw in zip(parts, split or split_rows(module.qweight(), sizes)):
            state.pop(prefix + ".weight", None)
            state.pop(prefix + ".bias", None)
            if qw.bias is not None:
                qw.bias = qw.bias.to(dense_dtype)
            if split is not None:
                state.update(ct.float_to_tensors(prefix, qw))
            elif fmt == "awq":
                state.update(awq.to_tensors(prefix, qw))
            elif fmt in CT_LAYOUT:
                state.update(ct.to_tensors(prefix, qw, sym, module.act_quant))
            else:
                state.update(gptq.to_tensors(prefix, qw, checkpoint_format=fmt))
    state = {k: v.contiguous() for k, v in state.items()}
    dtype_name = str(dense_dtype).removeprefix("torch.")
    extra = {"quantization_config": qconfig, "torch_dtype": dtype_name, "dtype": dtype_name}
    if fmt in CT_LAYOUT and quant_config:
        extra["qspec_quant_config"] = quant_config
    out = save_checkpoint(
        model,
        out_dir,
        max_shard_bytes=max_shard_bytes,
        extra_config=extra,
        tokenizer_from=tokenizer_from,
        state_dict=state,
        # AutoGPTQ-era loaders read quantize_config.json rather than config.json; written before the atomic rename
        extra_files={"quantize_config.json": json.dumps(qconfig, indent=2)} if fmt in ("gptq", "gptq_v2") else {},
    )
    return out


def read_tensors(path: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint dir, after checking every file covers the bytes its header promises."""

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    for f in files:
        if not (path / f).is_file():
            raise CheckpointError(f"{path}: checkpoint file {f} is missing")
        check_safetensors_file(path / f)
    return load_state_dict(path)


def parse_quantization_config(qc: dict) -> dict:
    """Normalised reading of a GPTQ / AWQ / compressed-tensors ``quantization_config`` (or quantize_config.json)."""
    method = str(qc.get("quant_method", "gptq")).lower()
    if method in CT_LAYOUT:
        return ct.parse_config(qc)  # qspec: compressed-tensors' layout (its rotation is read by the caller)
    if "bits" not in qc and "w_bit" not in qc:
        raise CheckpointError(f"quantization_config has no 'bits': {qc}")
    bits = int(qc.get("bits", qc.get("w_bit")))
    group_size = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in gptq.CHECKPOINT_FORMATS:
            raise CheckpointError(f"unsupported GPTQ checkpoint_format {fmt!r}; supported: {gptq.CHECKPOINT_FORMATS}")
        if bits not in (2, 3, 4, 8):
            raise CheckpointError(f"unsupported GPTQ bit width {bits}")
        act_quant = bool(qc.get("act_quant", False))
        return {"method": "gptq", "format": fmt, "bits": bits, "group_size": group_size, "act_quant": act_quant}
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version not in awq.VERSIONS:
            raise CheckpointError(f"unsupported AWQ version {version!r}; supported: {awq.VERSIONS}")
        zero_point = bool(qc.get("zero_point", True))
        return {"method": "awq", "format": version, "bits": bits, "group_size": group_size, "zero_point": zero_point}
    raise CheckpointError(f"unsupported quant_method {method!r}; supported: gptq, awq, compressed-tensors, qspec")


def quantized_key(qc: dict) -> str:
    """The tensor suffix that marks a layer as quantized in this checkpoint's format."""
    if qc["method"] == "compressed-tensors":
        return ".weight_scale"  # pack-quantized and int-quantized layers both carry one; dense layers do not
    return ".qweight"


def load_quantized_into(model, path: str | Path, quantization_config: dict, dtype: torch.dtype = torch.float32):
    """Fill a runtime Transformer from a GPTQ / AWQ / compressed-tensors checkpoint dir; quantized layers become
    QuantLinear.

    Every tensor is checked against the model config and quantization_config; a missing, misshapen or
    unused tensor, or a truncated file, raises CheckpointError naming it. A quantized lm_head of a model with
    tied embeddings (``lm_head: true``) also serves as the embedding (QuantEmbedding) unless the checkpoint
    carries its own dense ``model.embed_tokens.weight``, which then loads as written.
    """
    path = Path(path)
    qc = parse_quantization_config(quantization_config)
    tensors = {k: v for k, v in read_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()
    cfg = model.config
    qkey = quantized_key(qc)
    quantized_head = "lm_head" + qkey in tensors
    if quantization_config.get("rotation"):
        install_online_hadamard(model, quantization_config["rotation"])  # the weights were rotated for it
    for module_name, parts in linear_layout(model, quantized_head):
        module = model.get_submodule(module_name)
        in_features = module.in_features
        quantized = [p + qkey in tensors for p, _ in parts]
        if any(quantized) and not all(quantized):
            raise CheckpointError(
                f"{module_name}: {[p for (p, _), q in zip(parts, quantized) if not q]} are not quantized but "
                f"{[p for (p, _), q in zip(parts, quantized) if q]} are; a fused layer needs all or none"
            )
        if not all(quantized):
            if module_name == "lm_head" and cfg.tie_word_embeddings:
                continue
            load_dense_linear(module, module_name, parts, tensors, used)
            continue
        qparts = []
        for prefix, rows in parts:
            if qc["method"] == "gptq":
                qw = gptq.from_tensors(tensors, prefix, in_features, rows, qc["bits"], qc["group_size"], qc["format"])
            elif qc["format"] == ct.FLOAT_FORMAT:
                qw = ct.float_from_tensors(tensors, prefix, in_features, rows, qc)
            elif qc["method"] == "compressed-tensors":
                qw = ct.from_tensors(tensors, prefix, in_features, rows, qc)
            else:
                qw = awq.from_tensors(
                    tensors, prefix, in_features, rows, qc["bits"], qc["group_size"], qc["zero_point"]
                )
            used.update(k for k in tensors if k.startswith(prefix + "."))
            qparts.append((prefix, qw))
        act_quant = qc.get("act_quant", False) and qc["bits"] == 8
        if qc["format"] == ct.FLOAT_FORMAT:
            layer = FPLinear(concat_float_rows(module_name, qparts), act_quant=act_quant, compute_dtype=dtype)
        else:
            layer = QuantLinear(concat_rows(module_name, qparts), act_quant=act_quant, compute_dtype=dtype)
        set_module(model, module_name, layer)
    if cfg.tie_word_embeddings and quantized_head and hf_key(tensors, "model.embed_tokens.weight") is None:
        tie_quantized_embedding(model)
    load_dense_params(model, tensors, used)
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{path}: tensors not used by the model: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return model


def register() -> None:
    """Make runtime.loader.load_model read GPTQ, AWQ and compressed-tensors checkpoints (also the entry
    point runtime finds)."""
    for method in ("gptq", "awq", "compressed-tensors", "qspec"):
        register_quantized_format(method, load_quantized_into)


register()


def hf_key(tensors: dict[str, Tensor], name: str) -> str | None:
    """The checkpoint's key for an HF name, with or without the leading 'model.'."""
    for key in (name, name.removeprefix("model."), "model." + name):
        if key in tensors:
            return key
    return None


def load_dense_linear(module: nn.Module, module_name: str, parts, tensors: dict[str, Tensor], used: set[str]) -> None:
    weights, biases = [], []
    for prefix, rows in parts:
        key = hf_key(tensors, prefix + ".weight")
        if key is None:
            raise CheckpointError(f"tensor {prefix + '.qweight'!r} (or {prefix + '.weight'!r}) is missing")
        if tuple(tensors[key].shape) != (rows, module.in_features):
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {(rows, module.in_features)}"
            )
        weights.append(tensors[key])
        used.add(key)
        bias_key = hf_key(tensors, prefix + ".bias")
        if bias_key is not None:
            biases.append(tensors[bias_key])
            used.add(bias_key)
    with torch.no_grad():
        module.weight.copy_(torch.cat(weights).to(module.weight.dtype))
        if module.bias is not None:
            if len(biases) != len(parts):
                raise CheckpointError(f"{module_name}: bias tensors missing for some of {[p for p, _ in parts]}")
            module.bias.copy_(torch.cat(biases).to(module.bias.dtype))


def load_dense_params(model, tensors: dict[str, Tensor], used: set[str]) -> None:
    """Embeddings and norms (everything that is not a linear layer) from HF names."""
    linear_prefixes = tuple(name + "." for name, _ in linear_layout(model)) + ("lm_head.",)
    for name, param in model.named_parameters():
        if name.startswith(linear_prefixes) or ".qkv_proj." in name or ".gate_up_proj." in name:
            continue
        key = hf_key(tensors, "model." + name)
        if key is None:
            raise CheckpointError(f"tensor {'model.' + name!r} is missing from the checkpoint")
        if tensors[key].shape != param.shape:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensors[key].to(param.dtype))
        used.add(key)
