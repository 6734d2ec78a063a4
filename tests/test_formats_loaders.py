"""qspec's GPTQ (v1, v2) and AWQ files run by another loader: transformers' GPTQ/AWQ integration (optimum +
gptqmodel's torch CPU kernels): the same weights layer by layer on tiny models, and on the default model a v1
export scored with the same windows as qspec.

gptqmodel 7.x declares torch>=2.14 while this project pins torch 2.13, so it is not in the ``test`` extra;
installed beside it with ``pip install --no-deps --target DIR gptqmodel optimum device-smi logbar tokenicer
pypcre defuser threadpoolctl dill`` and put on PYTHONPATH, it imports and runs here (its first load JIT-compiles
a CPU extension, ~2.5 min). Without it the test is skipped; tests/formats_helpers.py's independent packers
(written from AutoGPTQ's and AutoAWQ's reference loops) check the bit layout in the default suite instead.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from formats_helpers import rtn_quantize

from evals.quality.perplexity import window_nlls
from quantize import rtn
from quantize.formats import linear_layout, save_quantized
from quantize.qlinear import QuantLinear, set_module
from runtime.config import ModelConfig
from runtime.data import token_windows, wiki_text
from runtime.loader import load_model, load_tokenizer
from runtime.model import random_model

SMALL = ModelConfig(  # widths gptqmodel's int4 CPU kernels take (multiples of 128)
    architecture="llama",
    vocab_size=96,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    eos_token_ids=[1],
    max_position_embeddings=512,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt,bits,act_order",
    [("gptq", 4, False), ("gptq", 4, True), ("gptq_v2", 4, False), ("awq", 4, False)]
    + [("gptq", 8, False), ("gptq", 3, False), ("gptq", 2, False), ("gptq_v2", 3, True)],
)
def test_gptqmodel_dequantizes_qspec_files_to_the_same_weights(tmp_path, fmt, bits, act_order):
    """transformers + gptqmodel load each file; every layer's dequantized weight is qspec's exact product
    rounded once to the fp16 scale dtype (gptqmodel multiplies in fp16), i.e. weight difference 0."""
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum")
    from transformers import AutoModelForCausalLM

    model = random_model(SMALL, seed=0)
    expected = {}
    for name, parts in linear_layout(model):
        lin = model.get_submodule(name)
        qw = rtn_quantize(lin.weight.detach(), bits, 32, act_order=act_order, seed=1)
        qw.zeros.clamp_(min=1)  # v1 stores zero - 1
        set_module(model, name, QuantLinear(qw, path="reference"))
        start = 0
        for prefix, rows in parts:
            expected[prefix] = qw.dequantize()[start : start + rows]
            start += rows
    expected.pop("lm_head")  # transformers' GPTQ integration keeps lm_head dense: quantize the decoder only
    set_module(model, "lm_head", random_model(SMALL, seed=0).lm_head)
    out = save_quantized(model, tmp_path / fmt, {}, fmt=fmt, dense_dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32)
    for prefix, w in expected.items():
        layer = hf.get_submodule(prefix)
        assert "gptqmodel" in type(layer).__module__, prefix
        theirs = layer.dequantize_weight().float()  # [in, out]
        assert torch.equal(theirs.t(), w.half().float()), prefix


@pytest.mark.slow
@pytest.mark.integration
def test_gptq_v1_runs_in_transformers_gptqmodel_with_qspec_perplexity(tmp_path):
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = tmp_path / "gptq4"
    # 4-bit g64: a group size that divides SmolLM2's widths (576, 1536), which gptqmodel's CPU kernels need
    rtn.main(["--model", "smollm2-135m", "--bits", "4", "--group-size", "64", "--out", str(out)])
    tokenizer = load_tokenizer("smollm2-135m")
    windows = token_windows(tokenizer, wiki_text("eval"), 512, 8)
    ours, _, _ = load_model(str(out))
    with torch.no_grad():
        nll_ours = sum(window_nlls(ours, windows))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, device_map="cpu")
    layer = theirs.model.layers[0].self_attn.q_proj
    assert "gptqmodel" in type(layer).__module__  # the integration's packed layer, not a dense fallback
    with torch.no_grad():
        nll_theirs = sum(window_nlls(theirs, windows))
    n = len(windows) * 511
    ppl_ours, ppl_theirs = math.exp(nll_ours / n), math.exp(nll_theirs / n)
    print(f"perplexity qspec {ppl_ours:.6f} transformers+gptqmodel {ppl_theirs:.6f} ({type(layer).__name__})")
    assert abs(ppl_theirs / ppl_ours - 1) < 1e-4


@pytest.mark.slow
@pytest.mark.integration
def test_compressed_tensors_export_of_the_default_model_through_transformers(tmp_path):
    """SmolLM2 RTN 4-bit g64 as compressed-tensors: the library decompresses every linear to qspec's weights
    (fp32 scales: exact) and transformers' compressed-tensors integration scores the same perplexity up to the
    library's fp16 products."""
    pytest.importorskip("compressed_tensors")
    from test_formats_export import library_decompress
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "ct"
    rtn.main(["--model", "smollm2-135m", "--group-size", "64", "--format", "compressed-tensors", "--out", str(out)])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ours, _, _ = load_model(str(out))
    theirs_weights = library_decompress(out, qc)
    for name, parts in linear_layout(ours):
        if isinstance(ours.get_submodule(name), QuantLinear):
            library = torch.cat([theirs_weights[p] for p, _ in parts])
            assert torch.equal(library, ours.get_submodule(name).qweight().dequantize()), name
    windows = token_windows(load_tokenizer("smollm2-135m"), wiki_text("eval"), 512, 4)
    theirs = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    with torch.no_grad():
        ppl_ours = math.exp(sum(window_nlls(ours, windows)) / (len(windows) * 511))
        ppl_theirs = math.exp(sum(window_nlls(theirs, windows)) / (len(windows) * 511))
    print(f"perplexity qspec {ppl_ours:.6f} transformers+compressed-tensors {ppl_theirs:.6f}")
    assert abs(ppl_theirs / ppl_ours - 1) < 2e-4  # fp16-rounded weights on their side
