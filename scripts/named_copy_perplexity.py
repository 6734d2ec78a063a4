"""Perplexity of a model's named fast copies (quantize.fast_copy: bf16, int4-int8head, w4a8-int8head, ...) on the
first wiki eval windows: what an opt-in approximation such as W4A8 costs beside the rows it is timed against.

    PYTHONPATH=. python scripts/named_copy_perplexity.py --model qwen2.5-coder-1.5b bf16 int4-int8head w4a8-int8head
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from evals.quality.perplexity import windows_perplexity
from quantize.fast_copy import named_fast_copy
from runtime.data import load_text, token_windows
from runtime.loader import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("copies", nargs="+")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base, _, path = load_model(args.model, torch.float32)
    windows = token_windows(load_tokenizer(str(path)), load_text("wiki", "eval"), 512, args.windows)
    results = {}
    for name in args.copies:
        model = named_fast_copy(base, name)
        start = time.perf_counter()
        res = windows_perplexity(model, windows, 4)
        seconds = time.perf_counter() - start
        results[name] = {"perplexity": res.perplexity, "windows": len(windows), "seqlen": 512, "seconds": seconds}
        print(name, f"{res.perplexity:.4f}", f"{seconds:.0f} s", flush=True)
        del model
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
