"""Perplexity under the GPTQ-paper protocol.

Documents are joined with "\\n\\n" and tokenized once without special tokens (SmolLM2's tokenizer adds no
BOS, and none is prepended), cut into non-overlapping windows of ``seqlen`` tokens with the tail dropped;
each window is scored independently (positions 0..seqlen-1, every token but the first predicted), and
perplexity is exp of the mean token NLL over all windows.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from runtime.data import load_text, token_windows
from runtime.scoring import window_nlls


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    windows: int
    tokens_scored: int
    seqlen: int


def perplexity(
    model,
    tokenizer,
    text: str,
    seqlen: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> PerplexityResult:
    windows = token_windows(tokenizer, text, seqlen, max_windows)
    if not windows:
        raise ValueError(f"text is shorter than one window of {seqlen} tokens")
    total = 0.0
    for i in range(0, len(windows), batch_size):
        total += sum(window_nlls(model, windows[i : i + batch_size], batch_size))
        if progress:
            print(
                f"\r[qspec] perplexity: {min(i + batch_size, len(windows))}/{len(windows)} windows",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    n_tokens = len(windows) * (seqlen - 1)
    mean = total / n_tokens
    return PerplexityResult(math.exp(mean), mean, len(windows), n_tokens, seqlen)


def main(argv: list[str] | None = None) -> None:
    from runtime.config import DTYPES
    from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m evals.perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default="wiki", help="text name (wiki, wiki-es, wiki-fr, wiki-desc, chat) or a text file")
    ap.add_argument("--split", default="eval", choices=["eval", "calib"])
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    model, _, path = load_model(args.model, DTYPES[args.dtype], args.device)
    tokenizer = load_tokenizer(str(path))
    try:
        text = load_text(args.data, args.split)
    except ValueError as err:
        ap.error(str(err))
    res = perplexity(
        model,
        tokenizer,
        text,
        args.seqlen,
        args.max_windows,
        args.batch_size,
        progress=True,
    )
    print(
        f"perplexity {res.perplexity:.4f} (mean NLL {res.mean_nll:.5f}) over {res.windows} windows x "
        f"{args.seqlen} tokens = {res.tokens_scored} scored tokens; model {args.model}, data {args.data}/"
        f"{args.split}, {args.dtype}, no BOS"
    )


if __name__ == "__main__":
    main()
