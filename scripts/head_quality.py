"""Quality of the lm_head options on the default model: perplexity (wiki eval, 32 windows x 512 tokens) and
greedy match with fp32 (20 wiki prompts x 64 tokens, position by position) for the bf16 / fp32 / int8 heads over
bf16 layers, and the bf16 / int8 heads over int4 g64 layers. Run from the repository root:

    PYTHONPATH=. python scripts/head_quality.py > head_quality.log   # last line: the JSON record
"""

import copy
import json

import torch

from evals.quality.perplexity import windows_perplexity
from quantize.fast_copy import INT8_HEAD, fast_quantized_copy, named_fast_copy
from runtime.data import load_text, token_windows
from runtime.decoding import generate
from runtime.loader import load_model, load_tokenizer
from runtime.sampling import SamplingParams
from tests.test_default_model import wiki_prompts


def main() -> None:
    torch.set_grad_enabled(False)
    base, _, path = load_model("smollm2-135m")
    tokenizer = load_tokenizer(str(path))
    windows = token_windows(tokenizer, load_text("wiki", "eval"), 512, 32)
    prompts = wiki_prompts(tokenizer)
    reference = generate(base, prompts, SamplingParams(max_tokens=64)).tokens
    variants = {
        "fp32": lambda: base,
        "bf16 (bf16 head)": lambda: copy.deepcopy(base).set_dtype(torch.bfloat16),
        "bf16 (fp32 head)": lambda: copy.deepcopy(base).set_dtype(torch.bfloat16, head_dtype=torch.float32),
        "bf16 (int8 head)": lambda: fast_quantized_copy(base, INT8_HEAD),  # codes from the fp32 table
        "int4 g64 (bf16 head)": lambda: named_fast_copy(base, "int4"),
        "int4 g64 (int8 head)": lambda: named_fast_copy(base, "int4-int8head"),
    }
    out = {}
    for name, make in variants.items():
        model = make()
        ppl = windows_perplexity(model, windows, 4).perplexity
        tokens = generate(model, prompts, SamplingParams(max_tokens=64)).tokens
        pairs = [(a, b) for ra, rb in zip(tokens, reference) for a, b in zip(ra, rb)]
        out[name] = {"perplexity": ppl, "greedy_match_vs_fp32": sum(a == b for a, b in pairs) / len(pairs)}
        print(name, out[name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
