"""Serving benchmark: ``python -m evals.serving.bench_serving --model smollm2-135m``.

Drives the serving engine in-process (no HTTP, so the numbers are the scheduler's and the model's; the
HTTP path is measured by ``evals.serving.loadgen``) with a closed loop of C requests in flight: a new request is
added the moment one finishes. Two parts:

1. batching: continuous vs static batching at each concurrency (default 1, 4, 16) on wiki prompts with
   mixed output lengths: output-token throughput, TTFT P50/P99, TPOT. Bars: continuous batching at the
   highest concurrency reaches >= 3x the output-token throughput of concurrency 1, and beats static
   batching on TTFT P99.
2. prefix caching: requests sharing a ~1k-token system prompt, one at a time, with and without prefix
   caching. Bar: median TTFT cut >= 3x.

Modes are interleaved per concurrency level, and every claim is a ratio within this one run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from evals.serving.metrics import RequestRecord, distribution, summarize
from evals.serving.serving_load import WorkItem, build_workload
from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.config import DTYPE_CHOICES, cli_dtype
from runtime.data import wiki_text
from runtime.engine import EngineConfig, LLMEngine
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.provenance import provenance
from runtime.sampling import SamplingParams


def run_closed_loop(
    engine: LLMEngine, items: list[WorkItem], concurrency: int
) -> tuple[list[RequestRecord], float, list[RequestRecord]]:
    """Keep `concurrency` requests in flight until all items are served; records from engine timestamps.
    Also returns the records of requests sent after the initial burst (the steady state)."""
    pending = list(items)
    records: list[RequestRecord] = []
    initial: set[str] = set()
    steady: list[RequestRecord] = []
    start = time.perf_counter()

    def admit() -> str:
        item = pending.pop(0)
        return engine.add_request(item.prompt_ids, SamplingParams(max_tokens=item.output_tokens, ignore_eos=True))

    for _ in range(min(concurrency, len(pending))):
        initial.add(admit())
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                rec = RequestRecord(
                    send_time=out.arrival_time,
                    token_times=out.token_times,
                    end_time=out.token_times[-1],
                    prompt_tokens=out.num_prompt_tokens,
                    output_tokens=len(out.output_ids),
                )
                records.append(rec)
                if out.request_id not in initial:
                    steady.append(rec)
                if pending:
                    admit()
    return records, time.perf_counter() - start, steady


def bench_batching(model, tokenizer, args) -> dict:
    results: dict[str, dict] = {}
    for c in args.concurrency:
        n = args.num_requests or max(6, 2 * c)
        items = build_workload(
            tokenizer, n, args.seed, max_prompt_tokens=args.max_prompt_tokens,
            min_output_tokens=args.min_output_tokens, max_output_tokens=args.max_output_tokens,
        )  # fmt: skip
        for policy in args.policies:
            config = EngineConfig(
                max_num_seqs=c, max_num_batched_tokens=args.max_num_batched_tokens, policy=policy,
                kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), enable_prefix_caching=False,
                decode_kernel=args.decode_kernel,
            )  # fmt: skip
            engine = LLMEngine(model, tokenizer, config)
            print(f"[bench_serving] {policy} c={c}: {n} requests ...", file=sys.stderr, flush=True)
            records, duration, steady = run_closed_loop(engine, items, c)
            summary = summarize(records, duration)
            summary["ttft_s_after_initial_burst"] = distribution([r.ttft for r in steady])
            summary["loadavg_1m_after"] = os.getloadavg()[0]
            results[f"{policy}@{c}"] = summary
            print(
                f"{policy:<11} c={c:<3} n={n:<3} {summary['output_token_throughput']:7.1f} out tok/s   "
                f"TTFT P50 {summary['ttft_s']['p50'] * 1e3:8.1f} ms  P99 {summary['ttft_s']['p99'] * 1e3:8.1f} ms   "
                f"TPOT P50 {summary['tpot_s']['p50'] * 1e3:6.1f} ms   "
                f"steady-state TTFT P99 {summary['ttft_s_after_initial_burst']['p99'] * 1e3:8.1f} ms   "
                f"({duration:.1f} s, load {summary['loadavg_1m_after']:.1f})",
                flush=True,
            )
    return results


def bench_prefix(model, tokenizer, args) -> dict:

    text_ids = tokenizer(wiki_text("eval")[:20000], add_special_tokens=False).input_ids
    system = text_ids[: args.system_prompt_tokens]
    items = build_workload(
        tokenizer, args.prefix_requests, args.seed + 7, prompt_tokens=args.question_tokens,
        output_tokens=args.prefix_output_tokens, prefix_ids=system,
    )  # fmt: skip
    out = {}
    for enabled in (False, True):
        config = EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=enabled,
            kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), decode_kernel=args.decode_kernel,
        )  # fmt: skip
        engine = LLMEngine(model, tokenizer, config)
        state = "on" if enabled else "off"
        print(f"[bench_serving] prefix caching {state}: {len(items)} requests ...", file=sys.stderr)
        records, duration, _ = run_closed_loop(engine, items, 1)
        key = "prefix_caching_on" if enabled else "prefix_caching_off"
        out[key] = summarize(records, duration)
        out[key]["prefix_cache_hit_rate"] = engine.block_manager.prefix_hit_rate
        ttft = distribution([r.ttft for r in records])
        print(
            f"prefix caching {'on ' if enabled else 'off'}  system prompt {len(system)} tok, n={len(items)}: "
            f"TTFT P50 {ttft['p50'] * 1e3:8.1f} ms  mean {ttft['mean'] * 1e3:8.1f} ms   "
            f"hit rate {engine.block_manager.prefix_hit_rate:.1%}",
            flush=True,
        )
    return out


def parse_args(argv: list[str] | None):
    ap = ArgumentParser(prog="python -m evals.serving.bench_serving", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: fp32, or bf16 for a quantized checkpoint"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--num-requests", type=int, default=None, help="per level (default: max(6, 2 x concurrency))")
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--min-output-tokens", type=int, default=8)
    ap.add_argument("--max-output-tokens", type=int, default=96)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decode-kernel", choices=["auto", "triton", "torch"], default="auto",
                    help="decode attention: auto = Triton paged kernel on CUDA, gather + SDPA on CPU")  # fmt: skip
    ap.add_argument("--system-prompt-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--prefix-requests", type=int, default=6)
    ap.add_argument("--prefix-output-tokens", type=int, default=8)
    ap.add_argument("--policies", nargs="+", choices=["continuous", "static"], default=["continuous", "static"],
                    help="batching modes, run in this order at each concurrency")  # fmt: skip
    ap.add_argument("--skip", choices=["batching", "prefix"], action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON record path")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if any(c < 1 for c in args.concurrency):
        ap.error("--concurrency values must be >= 1")
    for name in ("max_prompt_tokens", "min_output_tokens", "max_output_tokens", "system_prompt_tokens",
                 "question_tokens", "prefix_requests", "prefix_output_tokens", "max_num_batched_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    return args


def batching_bars(batching: dict, concurrency: list[int]) -> dict:
    """Continuous batching's throughput from the lowest to the highest concurrency (bar >= 3x) and static over
    continuous TTFT P99 at each level (bar > 1 at the highest), printed and returned."""
    bars = {}
    lo, hi = min(concurrency), max(concurrency)
    speedup = (
        batching[f"continuous@{hi}"]["output_token_throughput"]
        / batching[f"continuous@{lo}"]["output_token_throughput"]
    )
    print(f"\ncontinuous throughput c={hi} / c={lo}: {speedup:.2f}x  (bar >= 3x)")
    bars["continuous_throughput_ratio"] = speedup
    for c in concurrency:
        s, cont = batching[f"static@{c}"], batching[f"continuous@{c}"]
        ratio = s["ttft_s"]["p99"] / cont["ttft_s"]["p99"]
        tput = cont["output_token_throughput"] / s["output_token_throughput"]
        print(f"c={c:<3} TTFT P99 static / continuous: {ratio:.2f}x   throughput continuous / static: {tput:.2f}x")
        bars[f"ttft_p99_static_over_continuous@{c}"] = ratio
    bars["throughput_bar_met"] = speedup >= 3
    bars["ttft_p99_bar_met"] = bars[f"ttft_p99_static_over_continuous@{hi}"] > 1
    return bars


def prefix_bars(prefix: dict) -> dict:
    """Median TTFT without over with prefix caching (bar >= 3x), printed and returned."""
    cut = prefix["prefix_caching_off"]["ttft_s"]["p50"] / prefix["prefix_caching_on"]["ttft_s"]["p50"]
    print(f"median TTFT without / with prefix caching: {cut:.2f}x  (bar >= 3x)")
    return {"prefix_ttft_median_ratio": cut, "prefix_bar_met": cut >= 3}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _, path = load_model(args.model, dtype=cli_dtype(args.dtype), device=args.device)
    tokenizer = load_tokenizer(str(path))
    record = {
        **provenance(args.seed),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    bars = {}
    if "batching" not in args.skip:
        record["batching"] = bench_batching(model, tokenizer, args)
        bars |= batching_bars(record["batching"], args.concurrency)
    if "prefix" not in args.skip:
        record["prefix"] = bench_prefix(model, tokenizer, args)
        bars |= prefix_bars(record["prefix"])
    record["bars"] = bars
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")
    if not all(v for k, v in bars.items() if k.endswith("_met")):
        print("some bars are not met (see above)", file=sys.stderr)


def main_or_partial(argv: list[str] | None = None) -> None:
    try:
        main(argv)
    except KeyboardInterrupt:
        interrupted("the lines printed above are the levels that finished")


if __name__ == "__main__":
    run(main_or_partial)
