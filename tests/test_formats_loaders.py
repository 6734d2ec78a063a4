"""qspec's GPTQ v1 export run by another loader: transformers' GPTQ integration (optimum + gptqmodel's torch CPU
kernels) on the default model, scored with the same windows as qspec.

gptqmodel 7.x declares torch>=2.14 while this project pins torch 2.13, so it is not in the ``test`` extra;
installed beside it with ``pip install --no-deps --target DIR gptqmodel optimum device-smi logbar tokenicer
pypcre defuser threadpoolctl dill`` and put on PYTHONPATH, it imports and runs here (its first load JIT-compiles
a CPU extension, ~2.5 min). Without it the test is skipped; tests/formats_helpers.py's independent packers
(written from AutoGPTQ's and AutoAWQ's reference loops) check the bit layout in the default suite instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from evals.perplexity import window_nlls
from quantize import rtn
from runtime.data import token_windows, wiki_text
from runtime.loader import load_model, load_tokenizer


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
