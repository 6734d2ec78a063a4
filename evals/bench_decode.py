"""Decode speed at batch 1: ours against HF ``generate`` on the same weights, measured in the same run.

For each dtype, the two runtimes alternate (ours, HF, ours, HF, ...) for ``--repeats`` rounds so that load
on a shared machine hits both alike; the ratio of medians is the result. TTFT is the time to the first
token (prefill + one sample); TPOT is the mean time of each later token. The roofline share compares the
weight bytes read per decoded token with a streaming bandwidth measured here.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.config import DTYPES
from runtime.data import wiki_split
from runtime.decoding import generate
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.provenance import provenance
from runtime.sampling import SamplingParams


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Streaming read bandwidth in bytes/s over a buffer far larger than cache: the best of a few passes of
    two readers, a sum and an fp32 matrix-vector product (the GEMV is what decode runs, and on some
    machines it streams faster than the reduction)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    matrix, vector = buf.view(-1, 1024), torch.ones(1024)
    best = float("inf")
    for _ in range(repeats):
        for read in (buf.sum, lambda: torch.mv(matrix, vector)):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decoded token: every parameter/buffer but the embedding table (one row is
    read), counting a tied lm_head once, as the matmul that reads it."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or name.startswith("embed_tokens") or name == "inv_freq":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    embed = model.get_submodule("embed_tokens").weight if hasattr(model, "embed_tokens") else None
    lm_head = getattr(model, "lm_head", None)
    if embed is not None and lm_head is not None and lm_head.weight is embed:
        total += embed.numel() * embed.element_size()
    return total


def hf_decode_weight_bytes(hf_model) -> int:
    inner = hf_model.model
    total = sum(p.numel() * p.element_size() for n, p in inner.named_parameters() if not n.startswith("embed_tokens"))
    return total + hf_model.lm_head.weight.numel() * hf_model.lm_head.weight.element_size()


@torch.inference_mode()
def time_ours(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    out = generate(model, [prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return out.ttft_s, out.tpot_s


@torch.inference_mode()
def time_hf(hf_model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """TTFT from a 1-token generate; TPOT from the extra time of a full generate over that."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, attention_mask=mask, pad_token_id=0)
    t = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    total = time.perf_counter() - t
    return ttft, (total - ttft) / (new_tokens - 1)


OP_CATEGORIES = {
    "matmul (weight reads)": ("aten::mm", "aten::addmm", "aten::mv", "aten::addmv", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
}


@torch.inference_mode()
def profile_decode(model, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Where decode time goes: self CPU time of matmuls, attention, the other ops, and the rest of the wall
    time (Python and dispatch overhead between ops), as shares of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        generate(model, [prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        wall = time.perf_counter() - t
    totals = dict.fromkeys([*OP_CATEGORIES, "other ops (norms, rope, elementwise, copies)"], 0.0)
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        category = next((c for c, names in OP_CATEGORIES.items() if event.key.startswith(names)), None)
        totals[category or "other ops (norms, rope, elementwise, copies)"] += seconds
    totals["python + dispatch overhead"] = max(wall - sum(totals.values()), 0.0)
    return {k: v / wall for k, v in totals.items()}


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    ap = ArgumentParser(prog="python -m evals.bench_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write a JSON record here")
    ap.add_argument("--profile", action="store_true", help="also break our decode time down by op category")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    torch.set_num_threads(args.threads)

    _, _, path = load_model(args.model)  # resolves/converts once
    tokenizer = load_tokenizer(str(path))
    text = " ".join(d.extract for d in wiki_split("eval")[:20])
    prompt = tokenizer(text, add_special_tokens=False).input_ids[: args.prompt_tokens]
    bandwidth = measure_bandwidth()
    print(f"[bench_decode] streaming bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads", file=sys.stderr)
    record = {"run": provenance(), "bandwidth_GBps": bandwidth / 1e9, "args": vars(args), "results": {}}
    rows = []
    try:
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            print(f"[bench_decode] {dtype_name}: loading ours and HF, warming up", file=sys.stderr)
            ours, _, _ = load_model(args.model, dtype=dtype)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            time_ours(ours, prompt, 8), time_hf(hf, prompt, 8)  # warm up both
            samples: dict[str, list[tuple[float, float]]] = {"ours": [], "hf": []}
            for r in range(args.repeats):
                samples["ours"].append(time_ours(ours, prompt, args.new_tokens))
                samples["hf"].append(time_hf(hf, prompt, args.new_tokens))
                print(f"[bench_decode] {dtype_name}: repeat {r + 1}/{args.repeats} (ours, then HF)", file=sys.stderr)
            res = {}
            for name, bytes_per_token in (("ours", decode_weight_bytes(ours)), ("hf", hf_decode_weight_bytes(hf))):
                ttft = statistics.median(s[0] for s in samples[name])
                tpot = statistics.median(s[1] for s in samples[name])
                roofline_tpot = bytes_per_token / bandwidth
                res[name] = {
                    "ttft_ms": ttft * 1e3,
                    "tpot_ms": tpot * 1e3,
                    "tok_per_s": 1 / tpot,
                    "weight_bytes_per_token": bytes_per_token,
                    "roofline_tok_per_s": 1 / roofline_tpot,
                    "roofline_share": roofline_tpot / tpot,
                }
            res["speedup_tok_per_s"] = res["ours"]["tok_per_s"] / res["hf"]["tok_per_s"]
            res["ttft_ratio_hf_over_ours"] = res["hf"]["ttft_ms"] / res["ours"]["ttft_ms"]
            record["results"][dtype_name] = res
            for name in ("ours", "hf"):
                r = res[name]
                rows.append(
                    f"| {dtype_name} | {name} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.1f} | {r['tok_per_s']:.1f} | "
                    f"{r['weight_bytes_per_token'] / 1e6:.0f} | {100 * r['roofline_share']:.0f}% |"
                )
            rows.append(
                f"| {dtype_name} | ours/HF | {res['ttft_ratio_hf_over_ours']:.2f}x faster TTFT | | "
                f"**{res['speedup_tok_per_s']:.2f}x** | | |"
            )
            if args.profile:
                res["ours"]["time_shares"] = profile_decode(ours, prompt, min(args.new_tokens, 32))
                shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in res["ours"]["time_shares"].items())
                print(f"[bench_decode] {dtype_name} decode time: {shares}", file=sys.stderr)
            del ours, hf
    except KeyboardInterrupt:
        if rows:
            print("[bench_decode] partial summary: the dtypes that finished", file=sys.stderr)
            print("\n".join(rows))
        interrupted(f"{len(rows) // 3} of {len(args.dtypes.split(','))} dtypes had finished")
    print(
        f"batch 1, {len(prompt)}-token prompt, {args.new_tokens} new tokens, median of {args.repeats} interleaved runs"
    )
    print("| dtype | runtime | TTFT ms | TPOT ms | tok/s | weight MB/token | roofline share |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    run(main)
