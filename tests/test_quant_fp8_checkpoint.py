"""FP8 checkpoints in compressed-tensors' float-quantized layout: saved, decompressed by the library, and loaded
back through qspec's reader to the same logits as the in-memory FP8 model."""

from __future__ import annotations

import json

import pytest
import torch

from quantize import fp8
from quantize.formats import CheckpointError, linear_layout, save_quantized
from quantize.fplinear import FPLinear
from runtime.loader import load_model
from runtime.model import random_model
from tests.conftest import TINY_CONFIGS
from tests.test_formats_export import library_decompress
from tests.test_quant_cli import run_error, tiny_checkpoint  # noqa: F401 (fixture)

LLAMA = TINY_CONFIGS["llama"]  # q/k/v rows 64/32/32, gate/up 96/96
QWEN2 = TINY_CONFIGS["qwen2-tied"]  # biases on q/k/v


def fp8_model(config, block: int, w8a8: bool, lm_head: bool = False):
    cfg = fp8.float_config("e4m3", block, w8a8, lm_head=lm_head)
    return fp8.quantize_model(random_model(config, seed=0), cfg), cfg


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("block,w8a8", [(0, False), (0, True), (16, False)])
def test_fp8_checkpoint_round_trip(tmp_path, config, block, w8a8):
    model, cfg = fp8_model(config, block, w8a8)
    out = save_quantized(model, tmp_path / "ct", cfg.to_dict(), fmt="compressed-tensors", dense_dtype=torch.float32)
    assert not (tmp_path / "ct.partial").exists()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "float-quantized" and weights["type"] == "float" and weights["num_bits"] == 8
    assert weights["strategy"] == ("block" if block else "channel")
    assert (qc["config_groups"]["group_0"]["input_activations"] is not None) == w8a8
    # the library's own float-quantized compressor decompresses every part to qspec's dequantized rows
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, FPLinear):
            expected[name] = module.fweight().dequantize()
    ours = library_decompress(out, qc)
    for name, parts in linear_layout(model):
        if name in expected:
            assert torch.equal(torch.cat([ours[prefix] for prefix, _ in parts]), expected[name]), name
    # qspec's loader: FP8 layers again, the same logits bit for bit (fp32 dense tensors)
    loaded, _, _ = load_model(str(out))
    layers = [m for m in loaded.modules() if isinstance(m, FPLinear)]
    assert len(layers) == len(expected) and all(m.act_quant == w8a8 and m.block == block for m in layers)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = loaded(tokens)  # the automatic path (CPU: the step's kernels, same math in another order)
        torch.testing.assert_close(fast, model(tokens), rtol=1e-4, atol=1e-4)
        for m in layers:
            m.set_path(model.get_submodule(next(n for n, x in loaded.named_modules() if x is m)).path)
        assert torch.equal(loaded(tokens), model(tokens))  # on the original's path: bit for bit
    if not w8a8:  # transformers + compressed-tensors, dequantized (weight-only): HF's own forward, same logits
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        hf = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
        with torch.no_grad():
            torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_refusals(tmp_path):
    model, cfg = fp8_model(LLAMA, 48, False)  # 48-row blocks straddle q (64 rows) and k
    with pytest.raises(CheckpointError, match="scale blocks would straddle its parts"):
        save_quantized(model, tmp_path / "a", cfg.to_dict(), fmt="compressed-tensors")
    model, cfg = fp8_model(LLAMA, 0, False)
    with pytest.raises(CheckpointError, match="compressed-tensors \\(float-quantized\\) only"):
        save_quantized(model, tmp_path / "b", cfg.to_dict(), fmt="gptq")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_saves_a_loadable_fp8_checkpoint(tiny_checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")
    ckpt = str(tiny_checkpoint)
    assert "emulated (no FP4 checkpoint layout" in run_error(
        fp8.main, ["--model", ckpt, "--format", "nvfp4", "--out", str(tmp_path / "x")], capsys
    )
    assert not (tmp_path / "x").exists()
    out = tmp_path / "gptq-fp8"
    calib = ["--gptq", "--nsamples", "4", "--seqlen", "32", "--batch-size", "2"]
    rec = tmp_path / "r.jsonl"
    argv = ["--model", ckpt, *calib, "--w8a8", "--out", str(out), "--dense-dtype", "fp32", "--eval", "wiki:2"]
    fp8.main(argv + ["--record", str(rec)])
    record = json.loads(rec.read_text())
    assert record["format"] == "compressed-tensors" and record["out"] == str(out)
    loaded, _, _ = load_model(str(out))
    assert all(m.act_quant for m in loaded.modules() if isinstance(m, FPLinear))
    assert sum(isinstance(m, FPLinear) for m in loaded.modules()) == 4 * 2
