"""Speed and weight memory of quantized linear layers on this machine: fp32, bf16, int8, W8A8, int4.

    python -m evals.speed.bench_quant                                # default model, batch 1 and 16
    python -m evals.speed.bench_quant --batch-sizes 1 --repeats 5 --out results/bench_quant.json

Per-layer matmul time (each linear shape of decoder layer 0, and the lm_head) and whole-model decode
tokens/s through ``runtime.generate.generate`` with every decoder linear swapped for a QuantLinear on its
automatic path (cpu_int8, cpu_w8a8, cpu_int4 here); with --quantize-lm-head the lm_head too, and a tied
embedding then reads its rows from the quantized head (quantize.qembedding). Variants are timed interleaved,
repeat by repeat, and every ratio is against bf16 from the same run. The weight-memory table gives the whole
model's bytes of each quantized variant both ways (decoder linears only, and with the tied head/embedding).
Codes are the project's round-to-nearest (quantize.fast_copy): speed does not depend on how the codes were
chosen, and quality is measured elsewhere (quantize.*, evals.quality.perplexity).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from quantize.config import QuantConfig
from quantize.fast_copy import fast_quantized_copy
from quantize.qlinear import QuantLinear
from runtime.cliutil import ArgumentParser, run
from runtime.decoding import generate
from runtime.layout import decoder_linear_names
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.sampling import SamplingParams

VARIANTS = ("fp32", "bf16", "int8", "w8a8", "int4")
DESCRIPTIONS = {
    "fp32": "dense fp32",
    "bf16": "dense bf16 (all weights bf16, as transformers casts)",
    "int8": "int8 weight-only, per-channel symmetric, bf16 activations",
    "w8a8": "int8 weights x per-token int8 activations (torch._int_mm)",
    "int4": "int4 weight-only, group-wise asymmetric, bf16 activations",
}
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used for wine. Within fifty "
    "years presses were working in more than two hundred cities across Europe, and the number of books grew "
    "from thousands of hand-copied manuscripts to millions of printed volumes. Scholars argue about how much "
    "this changed the spread of ideas, but few doubt that it mattered for the Reformation and for science."
)


def decoder_linears(model) -> list[str]:
    return decoder_linear_names(model.config.num_layers)


def build_variant(base, variant: str, group_size: int, lm_head: bool):
    """A copy of the fp32 base model in the variant's form: bf16 (mixed: the runtime's bf16, which the CPU step
    runs), or RTN codes (quantize.fast_copy) with bf16 activations, each layer on its automatic path."""
    if variant == "fp32":
        return copy.deepcopy(base)
    if variant == "bf16":
        return copy.deepcopy(base).set_dtype(torch.bfloat16)
    bits, group, sym = (4, group_size, False) if variant == "int4" else (8, -1, True)
    grid = dict(bits=bits, group_size=group, sym=sym, act_quant=variant == "w8a8")
    head = QuantConfig(**grid, modules=(), lm_head=True) if lm_head else None
    model = fast_quantized_copy(base, QuantConfig(**grid), head=head)
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            layer(torch.zeros(1, layer.in_features, dtype=torch.bfloat16))  # pick the automatic path now
    return model


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def weight_bytes(model, names: list[str]) -> dict:
    """Bytes of the model's weights: all of them, and those of the layers a variant quantizes (names)."""
    persistent = [b for n, b in model.named_buffers() if not n.endswith("inv_freq")]
    total = tensor_bytes(list(model.parameters()) + persistent)
    linears = 0
    for name in names:
        module = model.get_submodule(name)
        linears += module.weight_bytes() if isinstance(module, QuantLinear) else tensor_bytes([module.weight])
    return {"total": total, "linears": linears}


def head_scope(config) -> str:
    return "+ tied head/embedding" if config.tie_word_embeddings else "+ lm_head"


def weight_memory(base, models: dict, group_size: int, lm_head: bool) -> list[dict]:
    """Whole-model weight bytes of every variant; quantized variants both ways, decoder linears only and with
    the lm_head (which a tied embedding shares), each against bf16 over the same layers. The way that is not
    being timed is built here for its bytes only."""
    decoder = decoder_linears(base)
    scopes = [("decoder linears", decoder, False), (head_scope(base.config), decoder + ["lm_head"], True)]
    bf16 = models["bf16"] if "bf16" in models else build_variant(base, "bf16", group_size, False)
    rows = []

    def row(variant: str, scope: str, model, names: list[str]) -> dict:
        mem, ref = weight_bytes(model, names), weight_bytes(bf16, names)
        return {
            "variant": variant,
            "quantized": scope,
            "total_bytes": mem["total"],
            "total_x_bf16": mem["total"] / ref["total"],
            "layer_bytes": mem["linears"],
            "layer_x_bf16": mem["linears"] / ref["linears"],
        }

    for variant, model in models.items():
        if variant in ("fp32", "bf16"):
            rows.append(row(variant, "none (dense)", model, decoder))
            continue
        for scope, names, with_head in scopes:
            built = model if with_head == lm_head else build_variant(base, variant, group_size, with_head)
            rows.append(row(variant, scope, built, names))
    return rows


def activation_dtype(variant: str) -> torch.dtype:
    return torch.float32 if variant == "fp32" else torch.bfloat16


@torch.inference_mode()
def time_layer(module: nn.Module, x: torch.Tensor, iters: int) -> float:
    module(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        module(x)
    return (time.perf_counter() - t0) / iters


@torch.inference_mode()
def bench_layers(models: dict, batch_sizes: list[int], repeats: int, iters: int) -> list[dict]:
    names = ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj"]
    names += ["layers.0.mlp.down_proj", "lm_head"]
    rows = []
    for name in names:
        for m in batch_sizes:
            print(f"[bench_quant] layer {name} batch {m}", file=sys.stderr, flush=True)
            times = {v: [] for v in models}
            for _ in range(repeats):  # interleaved: one measurement of every variant per repeat
                for variant, model in models.items():
                    module = model.get_submodule(name)
                    x = torch.randn(m, module.in_features, generator=torch.Generator().manual_seed(0))
                    times[variant].append(time_layer(module, x.to(activation_dtype(variant)), iters))
            base = statistics.median(times["bf16"]) if "bf16" in times else None
            for variant, ts in times.items():
                module = models[variant].get_submodule(name)
                med = statistics.median(ts)
                rows.append(
                    {
                        "layer": name,
                        "shape": [module.out_features, module.in_features],
                        "batch": m,
                        "variant": variant,
                        "path": getattr(module, "path", "dense"),
                        "us": med * 1e6,
                        "speedup_vs_bf16": None if base is None else base / med,
                    }
                )
    return rows


def make_prompts(tokenizer, batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Windows of a fixed English paragraph (seeded random token ids when tokenizer is None)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(2, vocab_size, (batch, length), generator=gen).tolist()
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False).input_ids
    while len(ids) < length + batch:
        ids = ids + ids
    return [ids[b : b + length] for b in range(batch)]


def bench_decode(
    models: dict, tokenizer, batch_sizes: list[int], prompt_len: int, new_tokens: int, repeats: int, seed: int
):

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for batch in batch_sizes:
        vocab_size = next(iter(models.values())).config.vocab_size
        prompts = make_prompts(tokenizer, batch, prompt_len, vocab_size, seed)
        rates, ttfts, tokens = {v: [] for v in models}, {v: [] for v in models}, {}
        for v, model in models.items():  # warm-up (and the tokens for the agreement column)
            tokens[v] = generate(model, prompts, SamplingParams(max_tokens=4, ignore_eos=True)).tokens
            tokens[v] = generate(model, prompts, params).tokens
        for r in range(repeats):
            print(f"[bench_quant] decode batch {batch} repeat {r + 1}/{repeats}", file=sys.stderr, flush=True)
            for v, model in models.items():
                out = generate(model, prompts, params)
                rates[v].append(out.timing.decode_tokens_per_s)  # whole steps: forward, lm_head, sampling
                ttfts[v].append(out.timing.ttft_s)
        base = statistics.median(rates["bf16"]) if "bf16" in rates else None
        shares = {}
        for v, model in models.items():  # one profiled call each: the step's share in the lm_head and sampling
            timing = generate(model, prompts, params, profile=True).timing
            shares[v] = {k: round(s / timing.wall_s, 4) for k, s in timing.phase_s.items()}
        for v in models:
            ref = tokens.get("fp32")
            agree = None
            if ref is not None:
                pairs = [(a, b) for ra, rb in zip(tokens[v], ref) for a, b in zip(ra, rb)]
                agree = sum(a == b for a, b in pairs) / len(pairs)
            rate = statistics.median(rates[v])
            rows.append(
                {
                    "batch": batch,
                    "variant": v,
                    "decode_tok_s": rate,
                    "decode_tok_s_all": rates[v],
                    "ttft_ms": statistics.median(ttfts[v]) * 1e3,
                    "speedup_vs_bf16": None if base is None else rate / base,
                    "greedy_agreement_vs_fp32": agree,
                    "time_shares": shares[v],
                }
            )
    return rows


def provenance(argv: list[str], seed: int) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    import transformers
    import triton

    cpu = "unknown"
    if Path("/proc/cpuinfo").is_file():
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return {
        "command": "python -m evals.speed.bench_quant " + " ".join(argv),
        "seed": seed,
        "git_sha": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
        },
        "device": {"type": "cpu", "cpu": cpu, "torch_threads": torch.get_num_threads(), "cores": os.cpu_count()},
    }


def markdown(record: dict) -> str:
    lines = ["| variant | quantized | weight MB (whole model) | x bf16 | quantized-layer MB | x bf16 (same layers) |"]
    lines.append("|---|---|---|---|---|---|")
    for r in record["weight_memory"]:
        lines.append(
            f"| {r['variant']} | {r['quantized']} | {r['total_bytes'] / 1e6:.1f} | {r['total_x_bf16']:.3f} | "
            f"{r['layer_bytes'] / 1e6:.1f} | {r['layer_x_bf16']:.3f} |"
        )
    lines += ["", "| batch | variant | decode tok/s (whole steps) | x bf16 | TTFT ms | greedy agreement vs fp32 | "
              "lm_head / sampling share |"]  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|")
    for r in record["decode"]:
        ratio = "-" if r["speedup_vs_bf16"] is None else f"{r['speedup_vs_bf16']:.2f}"
        agree = "-" if r["greedy_agreement_vs_fp32"] is None else f"{r['greedy_agreement_vs_fp32']:.3f}"
        share = r.get("time_shares", {})
        lines.append(
            f"| {r['batch']} | {r['variant']} | {r['decode_tok_s']:.1f} | {ratio} | {r['ttft_ms']:.1f} | {agree} | "
            f"{100 * share.get('lm_head', 0):.0f}% / {100 * share.get('sampling', 0):.0f}% |"
        )
    lines += ["", "| layer [out, in] | batch | variant | path | us | x bf16 |", "|---|---|---|---|---|---|"]
    for r in record["layers"]:
        ratio = "-" if r["speedup_vs_bf16"] is None else f"{r['speedup_vs_bf16']:.2f}"
        lines.append(
            f"| {r['layer']} {r['shape']} | {r['batch']} | {r['variant']} | {r['path']} | {r['us']:.0f} | {ratio} |"
        )
    return "\n".join(lines)


def parse_list(ap: argparse.ArgumentParser, text: str, kind, what: str) -> list:
    try:
        values = [kind(v) for v in text.replace(",", " ").split()]
    except ValueError:
        ap.error(f"{what}: cannot parse {text!r}")
    if not values:
        ap.error(f"{what}: empty")
    return values


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[int]]:
    ap = ArgumentParser(prog="python -m evals.speed.bench_quant", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name or checkpoint dir (dense)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {','.join(VARIANTS)}")
    ap.add_argument("--batch-sizes", default="1,16", help="decode batch sizes (comma list)")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size (multiple of 32, or -1)")
    ap.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="time variants with the lm_head quantized too (tied: the embedding reads its rows); the memory "
        "table reports both scopes either way",
    )
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per generate call")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median reported)")
    ap.add_argument("--layer-iters", type=int, default=20, help="calls per per-layer timing")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--random-prompts", action="store_true", help="seeded random token ids instead of text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    variants = parse_list(ap, args.variants, str, "--variants")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    batch_sizes = parse_list(ap, args.batch_sizes, int, "--batch-sizes")
    if min(batch_sizes) < 1:
        ap.error(f"--batch-sizes must be >= 1, got {batch_sizes}")
    if args.group_size != -1 and (args.group_size <= 0 or args.group_size % 32):
        ap.error(f"--group-size must be a positive multiple of 32 or -1, got {args.group_size}")
    for name in ("prompt_len", "new_tokens", "repeats", "layer_iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args, variants, batch_sizes


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, variants, batch_sizes = parse_args(argv)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    base, _, path = load_model(args.model, dtype=torch.float32)
    tokenizer = None if args.random_prompts else load_tokenizer(str(path))
    quantized_names = decoder_linears(base) + (["lm_head"] if args.quantize_lm_head else [])
    models = {v: build_variant(base, v, args.group_size, args.quantize_lm_head) for v in variants}
    record = {
        **provenance(argv, args.seed),
        "model": args.model,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "variants": {v: DESCRIPTIONS[v] for v in variants},
        "weight_bytes": {v: weight_bytes(m, quantized_names) for v, m in models.items()},
        "weight_memory": weight_memory(base, models, args.group_size, args.quantize_lm_head),
    }
    print(f"[bench_quant] {args.model}: {', '.join(variants)}; load average {load_before}", file=sys.stderr)
    record["layers"] = [] if args.skip_layers else bench_layers(models, batch_sizes, args.repeats, args.layer_iters)
    record["decode"] = (
        []
        if args.skip_decode
        else bench_decode(models, tokenizer, batch_sizes, args.prompt_len, args.new_tokens, args.repeats, args.seed)
    )
    record["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(markdown(record))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"[bench_quant] wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    run(main)
