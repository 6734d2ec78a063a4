"""Perplexity under the GPTQ-paper protocol.

Documents are joined with "\\n\\n" and tokenized once without special tokens (SmolLM2's tokenizer adds no
BOS, and none is prepended), cut into non-overlapping windows of ``seqlen`` tokens with the tail dropped;
each window is scored independently (positions 0..seqlen-1, every token but the first predicted), and
perplexity is exp of the mean token NLL over all windows.

``--kv-cache-dtype int8|fp8_e4m3|int4`` scores each window through a quantized KV cache (runtime.kv_quant): one
forward writes the window's keys and values in that format and every query attends over the stored codes (int4:
a query reads its own open key group in full precision, as token-by-token decoding does), so the perplexity is
the one decoding with that cache gives. ``auto`` (the default) runs without a cache.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.cliutil import ArgumentParser, UsageError
from runtime.config import DTYPES, ModelConfig
from runtime.data import load_text, token_windows
from runtime.kv_policy import KVCacheSpec
from runtime.kv_quant import KV_DTYPES
from runtime.loader import DEFAULT_MODEL, check_model_spec, load_model, load_tokenizer, resolve
from runtime.model import AttentionMetadata
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
    return windows_perplexity(model, windows, batch_size, progress)


def windows_perplexity(
    model, windows: list[list[int]], batch_size: int = 4, progress: bool = False, kv_cache_dtype: str = "auto"
):
    """Perplexity over already-cut windows of equal length (what perplexity() does after tokenizing); a quantized
    kv_cache_dtype scores them through that cache (qspec models only)."""
    seqlen = len(windows[0])
    total = 0.0
    start = time.perf_counter()
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        if kv_cache_dtype == "auto":
            total += sum(window_nlls(model, batch, batch_size))
        else:
            total += sum(cached_window_nlls(model, batch, KVCacheSpec(dtype=kv_cache_dtype)))
        if progress:
            done = min(i + batch_size, len(windows))
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (len(windows) - done)
            print(
                f"\r[qspec] perplexity: {done}/{len(windows)} windows, {elapsed:.0f} s, ETA {eta:.0f} s ",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    n_tokens = len(windows) * (seqlen - 1)
    mean = total / n_tokens
    return PerplexityResult(math.exp(mean), mean, len(windows), n_tokens, seqlen)


@torch.inference_mode()
def cached_window_nlls(model, windows: list[list[int]], kv: KVCacheSpec) -> list[float]:
    """Summed NLL of each window's predicted tokens, the windows written into (and read from) kv's cache."""
    device = model.inv_freq.device
    batch = torch.tensor(windows, device=device)
    B, T = batch.shape
    logits = model(batch, AttentionMetadata.contiguous(B, 0, T, device), kv.build(model, B, T))
    nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    return nll.view(B, -1).sum(-1).double().tolist()


def main(argv: list[str] | None = None) -> None:
    import json

    ap = ArgumentParser(prog="python -m evals.quality.perplexity", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default="wiki", help="text name (wiki, wiki-es, wiki-fr, wiki-desc, chat) or a text file")
    ap.add_argument("--split", default="eval", choices=["eval", "calib"])
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="score only the first N windows (default: all)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="score through a KV cache in this format (auto: no cache; quantized caches are approximate)",
    )
    args = ap.parse_args(argv)
    if args.max_windows is not None and args.max_windows < 1:
        ap.error(f"--max-windows must be >= 1 (or left out for every window), got {args.max_windows}")
    if args.seqlen < 2:
        ap.error(f"--seqlen must be >= 2 (one token predicted from another), got {args.seqlen}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        text = load_text(args.data, args.split)  # before the model: a bad --data costs nothing
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_model_spec(args.model)
    path = resolve(args.model)
    positions = ModelConfig.from_hf(json.loads((path / "config.json").read_text())).max_position_embeddings
    if args.seqlen > positions:
        raise UsageError(f"--seqlen {args.seqlen} is beyond the model's context of {positions} positions")
    tokenizer = load_tokenizer(str(path))
    windows = token_windows(tokenizer, text, args.seqlen, args.max_windows)
    if not windows:
        raise UsageError(f"--data {args.data}/{args.split} is shorter than one window of {args.seqlen} tokens")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, _, path = load_model(args.model, DTYPES[args.dtype], device)
    res = windows_perplexity(model, windows, args.batch_size, progress=True, kv_cache_dtype=args.kv_cache_dtype)
    print(
        f"perplexity {res.perplexity:.4f} (mean NLL {res.mean_nll:.5f}) over {res.windows} windows x "
        f"{args.seqlen} tokens = {res.tokens_scored} scored tokens; model {args.model}, data {args.data}/"
        f"{args.split}, {args.dtype}, KV cache {args.kv_cache_dtype}, no BOS"
    )


if __name__ == "__main__":
    from runtime.cliutil import run

    run(main)
