"""Load generator for OpenAI-compatible servers: ``python -m evals.serving.loadgen --url http://127.0.0.1:8000``.

Any OpenAI-compatible server works: qspec's own, vLLM (``vllm serve``), SGLang, llama.cpp's ``llama-server``,
or the stub in evals.serving.stub_server; the served model name is read from /v1/models unless given. Metrics follow
``vllm bench serve`` (see evals.serving.metrics): TTFT at the first chunk that carries output text, TPOT =
(E2E - TTFT) / (output tokens - 1), ITL between chunks, output tokens from usage or, where a server sends
none, from tokenizing the streamed text; goodput only with SLOs.

A real HTTP client (aiohttp, streaming SSE). Arrivals: Poisson at --rate, fixed-interval at --rate, or a
closed loop of --concurrency requests in flight. Prompts are Wikipedia extracts from the eval split (or
fixed-length token windows of it), sent as token ids to /v1/completions (exact prompt lengths) or as text to
/v1/chat/completions; output lengths follow the wiki extracts' token lengths clipped to a range (or are
fixed), enforced with ignore_eos. Prints TTFT, TPOT (first token excluded), ITL and E2E (mean, P50, P90,
P99), request and token throughput and goodput under SLOs, and writes a JSON record with provenance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from evals.serving.metrics import SLO, RequestRecord, format_summary, summarize
from evals.serving.serving_load import WorkItem, build_workload, run_load
from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_tokenizer
from runtime.provenance import provenance


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m evals.serving.loadgen", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model spec whose tokenizer builds the prompts")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument(
        "--prompt-format", choices=["ids", "text"], default="ids",
        help="completions prompts as token ids (exact lengths) or as decoded text (servers without id prompts)",
    )  # fmt: skip
    ap.add_argument("--served-model-name", default=None, help="the request's model field (default: /v1/models)")
    ap.add_argument("--api-key", default=None, help="sent as a Bearer token (vllm serve --api-key)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--arrival", choices=["poisson", "fixed", "concurrency"], default="concurrency")
    ap.add_argument("--rate", type=float, default=None, help="requests/s for poisson or fixed arrivals")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight for --arrival concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="fixed prompt length (default: wiki extracts)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=None, help="fixed output length (default: wiki lengths)")
    ap.add_argument("--min-output-tokens", type=int, default=8)
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-e2e-ms", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    ap.add_argument("--out", type=Path, default=None, help="JSON record path (default: print only)")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    if args.arrival in ("poisson", "fixed") and not (args.rate and args.rate > 0):
        ap.error(f"--arrival {args.arrival} needs --rate > 0 (requests per second)")
    if args.arrival == "concurrency" and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    for name in ("prompt_tokens", "output_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_output_tokens > args.max_output_tokens:
        ap.error("--min-output-tokens must be <= --max-output-tokens")
    return args


def slo_of(args) -> SLO | None:
    """The SLOs given in ms, in seconds; None when none is given (no goodput line: every request would count)."""
    limits = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    return SLO(*(None if v is None else v / 1e3 for v in limits)) if any(v is not None for v in limits) else None


def run_workload(args, items: list[WorkItem], tokenizer, slo: SLO | None) -> tuple[list[RequestRecord], float]:
    """run_load with the command's settings; on Ctrl-C, the summary of the requests that had finished."""
    finished: list[RequestRecord] = []
    start = time.perf_counter()
    try:
        return asyncio.run(
            run_load(args.url, items, tokenizer, args.endpoint, args.arrival, args.rate, args.concurrency, args.seed,
                     timeout_s=args.timeout_s, model_name=args.served_model_name, api_key=args.api_key,
                     prompt_as_text=args.prompt_format == "text", finished=finished)
        )  # fmt: skip
    except KeyboardInterrupt:
        if finished:
            print(f"\n[loadgen] partial summary: the {len(finished)} of {len(items)} requests that finished")
            print(format_summary(summarize(finished, time.perf_counter() - start, slo)))
        interrupted(f"{len(finished)} of {len(items)} requests had finished")


def write_record(args, summary: dict, records: list[RequestRecord]) -> None:
    record = {
        **provenance(args.seed),
        "config": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "requests": [asdict(r) for r in records],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    items = build_workload(
        tokenizer, args.num_requests, args.seed, args.prompt_tokens, args.max_prompt_tokens,
        args.output_tokens, args.min_output_tokens, args.max_output_tokens,
    )  # fmt: skip
    slo = slo_of(args)
    records, duration = run_workload(args, items, tokenizer, slo)
    summary = summarize(records, duration, slo)
    print(format_summary(summary))
    for e in sorted({r.error for r in records if not r.ok})[:5]:
        print(f"error: {e}", file=sys.stderr)
    if args.out:
        write_record(args, summary, records)
    if summary["completed"] == 0:
        sys.exit("no request completed")


if __name__ == "__main__":
    run(main)
