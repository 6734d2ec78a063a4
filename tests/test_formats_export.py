"""Formats other tools run: compressed-tensors checked with the compressed-tensors library itself, refusals of
what a format cannot hold (ragged groups, g_idx, bits, W8A8 in GPTQ), dense tensors in the declared dtype,
and ``python -m quantize.export`` between formats."""

from __future__ import annotations

import json

import pytest
import torch
from formats_helpers import rtn_quantize
from safetensors.torch import load_file

from quantize import export
from quantize.formats import FORMATS, CheckpointError, linear_layout, save_quantized
from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import QuantLinear, set_module
from runtime.loader import load_model
from runtime.model import Transformer, random_model
from tests.tiny_models import TINY_CONFIGS

LLAMA = TINY_CONFIGS["llama"]  # hidden 64, intermediate 96: widths 64 and 96
QWEN2 = TINY_CONFIGS["qwen2-tied"]  # biases on q/k/v, tied embeddings


def quantized(config, bits, group_size, sym=False, act_order=False, act_quant=False, min_zero=0, seed=0):
    """A random model whose linears (fused ones as one matrix) are RTN QuantLinears; the dequantized weight
    of every HF layer name is returned alongside."""
    model = random_model(config, seed=seed)
    expected = {}
    for name, parts in linear_layout(model):
        lin = model.get_submodule(name)
        qw = rtn_quantize(lin.weight.detach(), bits, group_size, sym=sym, act_order=act_order, seed=seed)
        qw.zeros.clamp_(min=min_zero)
        qw.bias = None if lin.bias is None else lin.bias.detach().clone()
        set_module(model, name, QuantLinear(qw, act_quant=act_quant, path="reference"))
        start = 0
        for prefix, rows in parts:
            expected[prefix] = qw.dequantize()[start : start + rows]
            start += rows
    return model, expected


def library_decompress(path, qc):
    """Every quantized layer of a compressed-tensors checkpoint decompressed by the library's own compressor,
    with its scales upcast to fp32 (the library multiplies in the scale's dtype)."""
    pytest.importorskip("compressed_tensors")  # the `test` extra installs it
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(
        targets=group["targets"], weights=group["weights"], input_activations=group["input_activations"]
    )
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = load_file(path / "model.safetensors")
    out = {}
    for key in tensors:
        if key.endswith(".weight_scale"):
            prefix = key.removesuffix(".weight_scale")
            local = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
            local["weight_scale"] = local["weight_scale"].float()
            local.pop("bias", None)
            out[prefix] = compressor.decompress(local, scheme)["weight"]
    return out


CT_CASES = [  # bits, group size, symmetric
    (4, 32, False),
    (4, 16, True),
    (4, -1, True),
    (8, -1, False),
    (3, 32, False),
    (2, 16, False),
    (8, 32, True),
]


@pytest.mark.parametrize("bits,group_size,sym", CT_CASES)
@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_compressed_tensors_decompresses_with_the_library_to_the_same_weights(tmp_path, config, bits, group_size, sym):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, expected = quantized(config, bits, group_size, sym=sym)
    out = save_quantized(model, tmp_path / "ct", {"quant_method": "rtn"}, fmt="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    # the library reads the config back to the same config groups (llm-compressor's own serialisation)
    assert QuantizationConfig.model_validate(qc).model_dump()["config_groups"] == qc["config_groups"]
    assert ("lm_head" in qc["ignore"]) == config.tie_word_embeddings  # the untied llama head is quantized too
    # 1. the library's compressor, fp32: exactly qspec's dequantized weights
    ours = library_decompress(out, qc)
    assert ours.keys() == expected.keys()
    for prefix, w in expected.items():
        assert torch.equal(ours[prefix], w), prefix
    # 2. transformers + compressed-tensors from the directory: the library multiplies in the fp16 scale dtype,
    # so each weight is qspec's exact product rounded once to fp16
    hf = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    hf_state = hf.state_dict()
    for prefix, w in expected.items():
        assert torch.equal(hf_state[prefix + ".weight"].float(), w.half().float()), prefix
    # logits: qspec's loaded checkpoint vs transformers running the library's exact (fp32) weights
    hf.load_state_dict({**hf_state, **{p + ".weight": w for p, w in ours.items()}})
    loaded, _, _ = load_model(str(out))
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    for name, _ in linear_layout(model):  # and qspec reads back the same codes
        a, b = model.get_submodule(name).qweight(), loaded.get_submodule(name).qweight()
        assert torch.equal(a.codes, b.codes) and torch.equal(a.zeros, b.zeros), name


def test_compressed_tensors_w8a8_is_int_quantized(tmp_path):
    model, expected = quantized(LLAMA, 8, -1, sym=True, act_quant=True)
    out = save_quantized(model, tmp_path / "ct", {}, fmt="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "int-quantized" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "strategy": "token",
        "dynamic": True,
    }
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    ours = library_decompress(out, qc)
    for prefix, w in expected.items():
        assert torch.equal(ours[prefix], w), prefix
    loaded, _, _ = load_model(str(out))
    assert all(loaded.get_submodule(n).act_quant for n, _ in linear_layout(loaded))
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 5))
    for mod in loaded.modules():
        if isinstance(mod, QuantLinear):
            mod.set_path("reference")
    dense = {k: v.bfloat16().float() for k, v in random_model(LLAMA, seed=0).hf_state_dict().items()}
    oracle = Transformer(LLAMA)
    oracle.load_hf_state_dict({**dense, **{p + ".weight": w for p, w in expected.items()}})
    for name, _ in linear_layout(oracle):  # the same per-token int8 activations, on the library's weights
        w = oracle.get_submodule(name).weight.detach()
        qw = rtn_quantize(w, 8, -1, sym=True)
        set_module(oracle, name, QuantLinear(qw, act_quant=True, path="reference"))
    assert torch.equal(loaded(tokens), oracle(tokens))


def test_compressed_tensors_act_order_only_with_static_groups(tmp_path):
    model, _ = quantized(LLAMA, 4, 32, act_order=True)
    with pytest.raises(CheckpointError, match=r"layers.0.self_attn.qkv_proj: compressed-tensors .* no g_idx"):
        save_quantized(model, tmp_path / "x", {}, fmt="compressed-tensors")
    assert not (tmp_path / "x").exists()
    model, _ = quantized(LLAMA, 4, 32)  # static groups: act-order changed the codes, not the layout
    out = save_quantized(model, tmp_path / "ct", {"act_order": True, "static_groups": True}, fmt="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"


@pytest.mark.parametrize("fmt", FORMATS)
def test_ragged_last_group_is_refused_by_every_format(tmp_path, fmt):
    model, _ = quantized(LLAMA, 4, 48)  # 64 = 48 + 16: a ragged last group on every 64-wide layer
    with pytest.raises(
        CheckpointError,
        match=r"^layers.0.self_attn.qkv_proj: in_features 64 is not a multiple of group size 48; .* "
        r"use --group-size 16, 32 or -1 \(per-channel\)$",
    ):
        save_quantized(model, tmp_path / "x", {}, fmt=fmt)
    assert not (tmp_path / "x").exists()


def test_awq_reader_refuses_a_ragged_group(tmp_path):
    model, _ = quantized(LLAMA, 4, 32)
    out = save_quantized(model, tmp_path / "awq", {}, fmt="awq")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="in_features 64 is not a multiple of group_size 48; AWQ GEMM holds"):
        load_model(str(out))


@pytest.mark.parametrize(
    "fmt,kwargs,match",
    [
        ("awq", dict(bits=3, group_size=32), "AWQ GEMM stores 4-bit codes, this layer has 3 bits"),
        ("awq", dict(bits=4, group_size=32, act_order=True), "AWQ has no g_idx"),
        ("gptq", dict(bits=8, group_size=-1, sym=True, act_quant=True), r"W8A8 .* use --format compressed-tensors"),
        ("awq", dict(bits=4, group_size=-1, act_quant=False), None),
        ("compressed-tensors", dict(bits=8, group_size=32, sym=True, act_quant=True), "symmetric per-channel int8"),
    ],
)
def test_settings_a_format_cannot_hold_are_refused(tmp_path, fmt, kwargs, match):
    model, _ = quantized(LLAMA, **kwargs)
    if match is None:
        assert save_quantized(model, tmp_path / "ok", {}, fmt=fmt).is_dir()
        return
    with pytest.raises(CheckpointError, match=match):
        save_quantized(model, tmp_path / "x", {}, fmt=fmt)
    assert not (tmp_path / "x").exists()


def test_tied_quantized_head_is_refused_by_compressed_tensors(tmp_path):
    model, _ = quantized(QWEN2, 4, 32)
    head = rtn_quantize(model.lm_head.weight.detach(), 4, 32)
    set_module(model, "lm_head", QuantLinear(head))
    tie_quantized_embedding(model)
    with pytest.raises(CheckpointError, match="lm_head: a quantized head shared with the tied embedding"):
        save_quantized(model, tmp_path / "x", {}, fmt="compressed-tensors")


@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_tensors_in_the_declared_dtype(tmp_path, fmt):
    model, _ = quantized(QWEN2, 4, 32)
    tokens = torch.randint(0, QWEN2.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    out = save_quantized(model, tmp_path / "bf16", {}, fmt=fmt)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16
    scales = [v for k, v in tensors.items() if k.endswith(("scales", "weight_scale"))]
    assert scales and all(v.dtype == torch.float16 for v in scales)
    floats = {v.dtype for k, v in tensors.items() if v.is_floating_point() and not k.endswith(("scales", "_scale"))}
    assert floats == {torch.bfloat16}
    loaded, _, _ = load_model(str(out))
    # the oracle: the in-memory model with its dense tensors rounded to bf16
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        for mod in model.modules():
            if isinstance(mod, QuantLinear) and mod.bias is not None:
                mod.bias.copy_(mod.bias.bfloat16().float())
        for mod in loaded.modules():
            if isinstance(mod, QuantLinear):
                mod.set_path("reference")
        assert torch.equal(loaded(tokens), model(tokens))
    fp32 = save_quantized(model, tmp_path / "fp32", {}, fmt=fmt, dense_dtype=torch.float32)
    assert json.loads((fp32 / "config.json").read_text())["torch_dtype"] == "float32"
    assert load_file(fp32 / "model.safetensors")["model.norm.weight"].dtype == torch.float32


def test_export_converts_between_formats_with_identical_weights(tmp_path, capsys):
    model, _ = quantized(LLAMA, 4, 32, min_zero=1)
    src = save_quantized(model, tmp_path / "v2", {"quant_method": "rtn", "damp_percent": 0.01}, fmt="gptq_v2")
    (src / "qspec_quantize.json").write_text(json.dumps({"quant_config": {"bits": 4, "group_size": 32, "x": 1}}))
    source, _, _ = load_model(str(src))
    previous = src
    for fmt in ("gptq", "awq", "compressed-tensors", "gptq_v2"):  # a chain: each export reads the previous one
        out = tmp_path / fmt
        record = export.main(["--model", str(previous), "--format", fmt, "--out", str(out), "--dense-dtype", "fp32"])
        assert record["format"] == fmt and record["export"]["from"] == str(previous)
        assert json.loads((out / "qspec_quantize.json").read_text())["quant_config"]["x"] == 1
        loaded, _, _ = load_model(str(out))
        for name, _ in linear_layout(source):
            a, b = source.get_submodule(name).qweight(), loaded.get_submodule(name).qweight()
            assert torch.equal(a.codes, b.codes) and torch.equal(a.zeros, b.zeros), (fmt, name)
            assert torch.equal(a.scales, b.scales), (fmt, name)
        previous = out
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq" and qc["x"] == 1
    capsys.readouterr()


def test_export_refusal_is_one_argparse_error(tmp_path, capsys):
    model, _ = quantized(LLAMA, 3, 32)
    src = save_quantized(model, tmp_path / "v2", {}, fmt="gptq_v2")
    with pytest.raises(SystemExit) as exc:
        export.main(["--model", str(src), "--format", "awq", "--out", str(tmp_path / "awq")])
    assert exc.value.code == 2
    assert "AWQ GEMM stores 4-bit codes, this layer has 3 bits" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "awq").exists()
    dense = tmp_path / "dense"
    from runtime.loader import save_checkpoint

    save_checkpoint(random_model(LLAMA, seed=0), dense)
    with pytest.raises(SystemExit):
        export.main(["--model", str(dense), "--format", "gptq", "--out", str(tmp_path / "y")])
    assert "is not a quantized checkpoint" in capsys.readouterr().err


def test_compressed_tensors_mixed_symmetry_keeps_every_zero_point(tmp_path):
    model, _ = quantized(LLAMA, 4, 32)
    sym = rtn_quantize(model.layers[0].mlp.down_proj.qweight().dequantize(), 4, 32, sym=True)
    set_module(model, "layers.0.mlp.down_proj", QuantLinear(sym, path="reference"))
    out = save_quantized(model, tmp_path / "ct", {}, fmt="compressed-tensors", dense_dtype=torch.float32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert "model.layers.0.mlp.down_proj.weight_zero_point" in load_file(out / "model.safetensors")
    loaded, _, _ = load_model(str(out))
    assert torch.equal(loaded.layers[0].mlp.down_proj.qweight().dequantize(), sym.dequantize())
