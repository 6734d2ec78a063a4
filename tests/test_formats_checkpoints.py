"""Packed checkpoints: bit-exact packing against independent packers, third-party checkpoints, round trips,
and errors that name the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from formats_helpers import autoawq_pack_cols, autogptq_pack_rows, awq_layer_tensors, gptq_layer_tensors, rtn_quantize
from safetensors.torch import load_file, save_file

from quantize.formats import CheckpointError, linear_layout, load_quantized_into, save_quantized
from quantize.packing import pack_codes, pack_codes_awq, unpack_codes, unpack_codes_awq
from quantize.qlinear import QuantLinear, set_module
from runtime.config import ModelConfig
from runtime.loader import load_model
from runtime.model import Transformer, random_model
from tests.tiny_models import TINY_CONFIGS

LLAMA = TINY_CONFIGS["llama"]
QWEN2 = TINY_CONFIGS["qwen2-tied"]  # biases on q/k/v, tied embeddings


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_packing_matches_autogptq_reference(bits):
    codes = torch.randint(0, 2**bits, (96, 40), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    ours = pack_codes(codes, bits)
    theirs = torch.from_numpy(autogptq_pack_rows(codes.numpy(), bits).view(np.int32).copy())
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    assert torch.equal(unpack_codes(theirs, bits, 96), codes)


def test_awq_packing_matches_autoawq_reference():
    codes = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    theirs = torch.from_numpy(autoawq_pack_cols(codes.numpy()).view(np.int32).copy())
    assert torch.equal(pack_codes_awq(codes), theirs)
    assert torch.equal(unpack_codes_awq(theirs), codes)


def quantize_model(model: Transformer, bits: int, group_size: int, act_order=False, sym=False, min_zero=0):
    """Swap every linear (fused ones as one matrix) for a reference QuantLinear with RTN codes."""
    for name, _ in linear_layout(model):
        lin = model.get_submodule(name)
        qw = rtn_quantize(lin.weight.detach(), bits, group_size, sym=sym, act_order=act_order)
        qw.zeros.clamp_(min=min_zero)
        qw.bias = None if lin.bias is None else lin.bias.detach().clone()
        set_module(model, name, QuantLinear(qw))
    return model


def write_checkpoint(path, config: ModelConfig, tensors: dict, quantization_config: dict):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({**config.to_hf(), "quantization_config": quantization_config}))
    return path


def third_party_checkpoint(tmp_path, config, fmt, bits, group_size, act_order, seed=0):
    """A checkpoint written with the independent packers, and the QuantizedWeight of every HF layer."""
    dense = random_model(config, seed=seed).hf_state_dict()
    tensors, expected = {}, {}
    for name, w in dense.items():
        is_linear = name.endswith("proj.weight") or name == "lm_head.weight"
        if not is_linear:
            tensors[name] = w
            continue
        prefix = name.removesuffix(".weight")
        # act-order: the same seed gives q/k/v (and gate/up) the same g_idx, as GPTQ's shared Hessian does
        qw = rtn_quantize(w, bits, group_size, act_order=act_order, seed=w.shape[1])
        if fmt == "gptq":
            qw.zeros.clamp_(min=1)  # v1 cannot store zero point 0
        qw.bias = dense.get(prefix + ".bias")
        expected[prefix] = qw
        if fmt == "awq":
            tensors.update(awq_layer_tensors(prefix, qw))
        else:
            tensors.update(gptq_layer_tensors(prefix, qw, v1=fmt == "gptq"))
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": False}
        qc["checkpoint_format"] = fmt
    return write_checkpoint(tmp_path / "ckpt", config, tensors, qc), expected


def expected_fused(model, expected):
    """The runtime module name -> the concatenated dequantized weight the checkpoint should load to."""
    out = {}
    for module_name, parts in linear_layout(model):
        if all(p in expected for p, _ in parts):
            out[module_name] = torch.cat([expected[p].dequantize() for p, _ in parts])
    return out


@pytest.mark.parametrize(
    "fmt,bits,group_size,act_order",
    [
        ("gptq", 4, 32, False),
        ("gptq", 3, 32, True),
        ("gptq_v2", 2, 16, False),
        ("gptq_v2", 3, 64, False),
        ("gptq_v2", 4, 32, True),
        ("gptq_v2", 8, -1, False),
        ("awq", 4, 32, False),
    ],
)
@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_third_party_checkpoint_loads_bit_for_bit(tmp_path, config, fmt, bits, group_size, act_order):
    path, expected = third_party_checkpoint(tmp_path, config, fmt, bits, group_size, act_order)
    model, _, _ = load_model(str(path))
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_path("reference")  # this test is about the format; fast paths are tested against it
    want = expected_fused(model, expected)
    assert len(want) == len(linear_layout(model)) > 0
    for name, w in want.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear) and module.bits == bits
        assert torch.equal(module.qweight().dequantize(), w), name
    # logits: the loaded model equals a model built directly from the expected weights
    oracle = Transformer(config)
    oracle.load_hf_state_dict(
        {**load_file(path / "model.safetensors"), **{p + ".weight": qw.dequantize() for p, qw in expected.items()}}
    )
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), oracle(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fmt,bits,group_size,act_order",
    [("gptq_v2", 4, 32, False), ("gptq_v2", 3, 32, True), ("gptq", 8, 16, True), ("gptq", 2, -1, False)]
    + [("awq", 4, 16, False)],
)
def test_round_trip_identical_weights_and_logits(tmp_path, fmt, bits, group_size, act_order):
    model = quantize_model(random_model(LLAMA, seed=3), bits, group_size, act_order, min_zero=int(fmt == "gptq"))
    tokens = torch.randint(0, LLAMA.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    before = model(tokens)
    out = save_quantized(model, tmp_path / "q", {"damp_percent": 0.01}, fmt=fmt, dense_dtype=torch.float32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == bits and qc["damp_percent"] == 0.01
    assert qc["group_size"] == (-1 if group_size == -1 else group_size)
    loaded = load_quantized_into(Transformer(LLAMA), out, qc)
    for name, _ in linear_layout(model):
        a, b = model.get_submodule(name).qweight(), loaded.get_submodule(name).qweight()
        assert torch.equal(a.dequantize(), b.dequantize()), name
        assert torch.equal(a.codes, b.codes) and torch.equal(a.group_index(), b.group_index())
    assert torch.equal(loaded(tokens), before)
    # saving the loaded model again writes the same bytes for every tensor
    again = save_quantized(loaded, tmp_path / "q2", {"damp_percent": 0.01}, fmt=fmt, dense_dtype=torch.float32)
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_saved_tensors_match_independent_packer(tmp_path):
    model = quantize_model(random_model(QWEN2, seed=0), 3, 32, act_order=True)
    out = save_quantized(model, tmp_path / "q", {}, fmt="gptq_v2", dense_dtype=torch.float32)
    saved = load_file(out / "model.safetensors")
    qkv = model.layers[1].self_attn.qkv_proj.qweight()
    k_rows = slice(QWEN2.q_size, QWEN2.q_size + QWEN2.kv_size)
    k = rtn_like(qkv, k_rows)
    for name, tensor in gptq_layer_tensors("model.layers.1.self_attn.k_proj", k, v1=False).items():
        assert torch.equal(saved[name], tensor), name
    assert torch.equal(saved["model.layers.1.self_attn.k_proj.bias"], model.layers[1].self_attn.qkv_proj.bias[k_rows])
    assert not any(k.endswith("qkv_proj.qweight") or "gate_up" in k for k in saved)  # unfused HF names only


def rtn_like(qw, rows):
    from quantize.qlinear import QuantizedWeight

    return QuantizedWeight(qw.codes[rows], qw.scales[rows], qw.zeros[rows], qw.bits, qw.group_size, qw.g_idx)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = quantize_model(random_model(LLAMA, seed=5), 4, 32)
    out = save_quantized(model, tmp_path / "q", {}, fmt="gptq_v2", max_shard_bytes=20_000, dense_dtype=torch.float32)
    assert (out / "model.safetensors.index.json").is_file()
    loaded, _, _ = load_model(str(out))
    tokens = torch.randint(0, LLAMA.vocab_size, (1, 6))
    assert torch.equal(loaded(tokens), model(tokens))


# ---- errors name the tensor ------------------------------------------------------------------------------


@pytest.fixture
def saved_gptq(tmp_path):
    model = quantize_model(random_model(LLAMA, seed=0), 4, 32)
    out = save_quantized(model, tmp_path / "q", {}, fmt="gptq_v2")
    return out, json.loads((out / "config.json").read_text())["quantization_config"]


def test_truncated_file_names_the_tensor(saved_gptq):
    path, qc = saved_gptq
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"truncated: tensor '[\w.]+'"):
        load_quantized_into(Transformer(LLAMA), path, qc)
    f.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="truncated inside the safetensors header"):
        load_quantized_into(Transformer(LLAMA), path, qc)


def test_wrong_shape_names_the_tensor(saved_gptq):
    path, qc = saved_gptq
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.qweight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(11, 64\), expected \(12, 64\)"):
        load_quantized_into(Transformer(LLAMA), path, qc)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"bits": 8}, r"tensor 'model.layers.0.self_attn.q_proj.qweight' has shape \(8, 64\), expected \(16, 64\)"),
        ({"group_size": 16}, r"tensor 'model.layers.0.self_attn.q_proj.qzeros' has shape \(2, 8\), expected \(4, 8\)"),
        ({"checkpoint_format": "marlin"}, "unsupported GPTQ checkpoint_format 'marlin'"),
        ({"quant_method": "bitsandbytes"}, "unsupported quant_method 'bitsandbytes'"),
        ({"quant_method": "awq", "version": "gemm"}, r"tensor 'model.layers.0.self_attn.q_proj.qweight' has shape"),
    ],
)
def test_config_that_does_not_match_tensors(saved_gptq, change, match):
    path, qc = saved_gptq
    with pytest.raises(CheckpointError, match=match):
        load_quantized_into(Transformer(LLAMA), path, {**qc, **change})


def test_missing_and_unused_tensors_are_named(saved_gptq):
    path, qc = saved_gptq
    tensors = load_file(path / "model.safetensors")
    scales = tensors.pop("model.layers.0.mlp.up_proj.scales")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.up_proj.scales' is missing"):
        load_quantized_into(Transformer(LLAMA), path, qc)
    tensors["model.layers.0.mlp.up_proj.scales"] = scales
    tensors["model.layers.0.mlp.extra_proj.weight"] = scales.clone()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not used by the model: \\['model.layers.0.mlp.extra_proj.weight'\\]"):
        load_quantized_into(Transformer(LLAMA), path, qc)


def test_fused_parts_with_different_g_idx_are_refused(saved_gptq):
    path, qc = saved_gptq
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = torch.flip(tensors[name], [0]).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {name} differs"):
        load_quantized_into(Transformer(LLAMA), path, qc)


def test_save_refuses_what_the_format_cannot_store(tmp_path):
    model = quantize_model(random_model(LLAMA, seed=0), 4, 32)
    model.layers[0].mlp.down_proj.zeros[0, 0] = 0
    v1_message = r"layers.0.mlp.down_proj: zero points span \[0, .*zero point 0, .* needs --format gptq_v2"
    with pytest.raises(CheckpointError, match=v1_message):
        save_quantized(model, tmp_path / "v1", {}, fmt="gptq")
    model = quantize_model(random_model(LLAMA, seed=0), 3, 32)
    with pytest.raises(CheckpointError, match="AWQ GEMM stores 4-bit codes, this layer has 3 bits"):
        save_quantized(model, tmp_path / "awq", {}, fmt="awq")
    with pytest.raises(ValueError, match=r"quant_config\['bits'\] = 4 but the layers say 3"):
        save_quantized(model, tmp_path / "x", {"bits": 4})


def test_w8a8_and_algorithm_metadata_survive_the_round_trip(tmp_path):
    model = random_model(LLAMA, seed=4)
    for name, _ in linear_layout(model):
        qw = rtn_quantize(model.get_submodule(name).weight.detach(), 8, -1, sym=True)
        set_module(model, name, QuantLinear(qw, act_quant=True))
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 5))
    with pytest.raises(CheckpointError, match="layers.0.self_attn.qkv_proj: W8A8 .* use --format compressed-tensors"):
        save_quantized(model, tmp_path / "v2", {}, fmt="gptq_v2")
    meta = {"quant_method": "rtn", "bits": 8, "group_size": -1}
    out = save_quantized(model, tmp_path / "q", meta, fmt="compressed-tensors", dense_dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    assert config["qspec_quant_config"] == meta
    loaded, _, _ = load_model(str(out))
    assert all(loaded.get_submodule(n).act_quant for n, _ in linear_layout(loaded))
    assert torch.equal(loaded(tokens), model(tokens))


def test_scales_that_fp16_changes_are_warned_about(tmp_path):
    model = quantize_model(random_model(LLAMA, seed=0), 4, 32)
    model.layers[0].self_attn.o_proj.scales[0, 0] += 1e-6  # not representable in fp16
    with pytest.warns(UserWarning, match="layers.0.self_attn.o_proj: scales are not fp16-exact"):
        save_quantized(model, tmp_path / "q", {})


def test_autogptq_era_checkpoint_with_only_quantize_config_json(tmp_path):
    path, expected = third_party_checkpoint(tmp_path, LLAMA, "gptq", 4, 32, act_order=False)
    hf = json.loads((path / "config.json").read_text())
    (path / "quantize_config.json").write_text(json.dumps(hf.pop("quantization_config")))
    (path / "config.json").write_text(json.dumps(hf))
    model, _, _ = load_model(str(path))
    down = model.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear)
    assert torch.equal(down.qweight().dequantize(), expected["model.layers.1.mlp.down_proj"].dequantize())


# ---- the save holds no dequantized copy of the model --------------------------------------------------------


def refuse_dequantized_weights(monkeypatch) -> None:
    """Reading a quantized layer's ``.weight`` (a full fp32 dequantization of it) fails the test: the save used
    to read every one (a QuantEmbedding's too), holding a second, fp32 copy of the model (the 1.5B: 12.6 GB)."""
    from quantize.fplinear import FPLinear

    def refuse(self):
        raise AssertionError(f"{type(self).__name__}.weight: a whole layer dequantized during the save")

    monkeypatch.setattr(QuantLinear, "weight", property(refuse))
    monkeypatch.setattr(FPLinear, "weight", property(refuse))


def packed_reference(model, fmt: str, dense_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``model`` holds, built the way the save did before it stopped dequantizing: every
    HF tensor of the model in dense_dtype, each quantized layer's weight replaced by its packed tensors."""
    from quantize.formats import awq, gptq, is_symmetric, split_rows
    from quantize.formats import compressed_tensors as ct
    from quantize.qembedding import shares_quantized_head

    state = {k: v.to(dense_dtype) for k, v in model.hf_state_dict().items()}
    if shares_quantized_head(model):
        del state["model.embed_tokens.weight"]
    sym = all(is_symmetric(m) for m in model.modules() if isinstance(m, QuantLinear))
    for name, parts in linear_layout(model):
        module = model.get_submodule(name)
        if not isinstance(module, QuantLinear):
            continue
        for (prefix, _), qw in zip(parts, split_rows(module.qweight(), [n for _, n in parts])):
            state.pop(prefix + ".weight", None)
            state.pop(prefix + ".bias", None)
            qw.bias = None if qw.bias is None else qw.bias.to(dense_dtype)
            if fmt == "awq":
                state.update(awq.to_tensors(prefix, qw))
            elif fmt == "compressed-tensors":
                state.update(ct.to_tensors(prefix, qw, sym, module.act_quant))
            else:
                state.update(gptq.to_tensors(prefix, qw, checkpoint_format=fmt))
    return state


@pytest.mark.parametrize(
    "config,fmt,head",
    [
        (LLAMA, "gptq_v2", False),
        (LLAMA, "awq", False),
        (LLAMA, "compressed-tensors", False),
        (QWEN2, "gptq", False),  # q/k/v biases, tied embedding
        (QWEN2, "gptq_v2", True),  # a quantized head shared with the tied embedding: no dense table written
        (LLAMA, "gptq_v2", True),  # a quantized untied head
    ],
    ids=["llama-gptq_v2", "llama-awq", "llama-ct", "qwen2-tied-gptq", "qwen2-tied-head", "llama-head"],
)
def test_save_writes_the_same_tensors_without_dequantizing_a_layer(tmp_path, monkeypatch, config, fmt, head):
    from quantize.qembedding import tie_quantized_embedding

    act_order = fmt.startswith("gptq")  # awq and compressed-tensors have no g_idx
    model = quantize_model(random_model(config, seed=6), 4, 32, act_order=act_order, min_zero=int(fmt == "gptq"))
    if head:
        set_module(model, "lm_head", QuantLinear(rtn_quantize(model.lm_head.weight.detach(), 4, 32)))
        if config.tie_word_embeddings:
            tie_quantized_embedding(model)
    want = packed_reference(model, fmt, torch.bfloat16)  # reads every .weight: before the patch below
    refuse_dequantized_weights(monkeypatch)
    out = save_quantized(model, tmp_path / "q", {}, fmt=fmt)
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == want.keys()
    for k in want:
        assert saved[k].dtype == want[k].dtype and torch.equal(saved[k], want[k]), k
    assert ("model.embed_tokens.weight" in saved) == (not (head and config.tie_word_embeddings))


def test_fp8_save_does_not_dequantize_a_layer(tmp_path, monkeypatch):
    from quantize import fp8

    refuse_dequantized_weights(monkeypatch)
    model = fp8.quantize_model(random_model(LLAMA, seed=0), fp8.float_config("e4m3", 0, False))
    out = save_quantized(model, tmp_path / "fp8", {}, fmt="compressed-tensors")
    assert any(k.endswith(".weight_scale") for k in load_file(out / "model.safetensors"))


def test_quantized_checkpoint_loads_without_a_random_init(tmp_path, monkeypatch):
    """The reader fills an allocated, uninitialised model: no weight is randomly initialised first (the 1.5B's
    load built its whole dense fp32 model that way, 7.9 GB peak), and the load is the same."""
    model = quantize_model(random_model(LLAMA, seed=7), 4, 32, act_order=True)
    out = save_quantized(model, tmp_path / "q", {}, fmt="gptq_v2")
    before, _, _ = load_model(str(out))

    def guard(init):
        def guarded(self):
            if self.weight.device.type != "meta":
                raise AssertionError(f"a {type(self).__name__} was randomly initialised to load a quantized checkpoint")
            init(self)

        return guarded

    for module in (torch.nn.Linear, torch.nn.Embedding):
        monkeypatch.setattr(module, "reset_parameters", guard(module.reset_parameters))
    loaded, _, _ = load_model(str(out))
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(tokens), before(tokens))
    assert dict(loaded.state_dict()).keys() == dict(before.state_dict()).keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), before.state_dict().values()))
