"""Load generator for OpenAI-compatible servers: ``python -m evals.loadgen --url http://127.0.0.1:8000``.

Any OpenAI-compatible server works: qspec's own, vLLM (``vllm serve``), SGLang, llama.cpp's ``llama-server``,
or the stub in evals.stub_server; the served model name is read from /v1/models unless given. Metrics follow
``vllm bench serve`` (see evals.metrics): TTFT at the first chunk that carries output text, TPOT =
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

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from evals.metrics import SLO, RequestRecord, format_summary, summarize
from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.data import wiki_split
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_tokenizer
from runtime.provenance import provenance


@dataclass
class WorkItem:
    prompt_ids: list[int]
    output_tokens: int


def build_workload(
    tokenizer,
    num_requests: int,
    seed: int,
    prompt_tokens: int | None = None,
    max_prompt_tokens: int = 512,
    output_tokens: int | None = None,
    min_output_tokens: int = 8,
    max_output_tokens: int = 128,
    prefix_ids: list[int] | None = None,
) -> list[WorkItem]:
    """Prompts from eval-split wiki extracts (each cut to max_prompt_tokens, or to exactly prompt_tokens
    from the running text); output lengths from other extracts' token lengths clipped to the range."""

    rng = random.Random(seed)
    docs = wiki_split("eval")
    picks = rng.sample(range(len(docs)), min(len(docs), 2 * num_requests))
    encoded = [tokenizer(docs[i].extract, add_special_tokens=False).input_ids for i in picks]
    items = []
    for n in range(num_requests):
        ids = encoded[n % len(encoded)]
        if prompt_tokens is not None:
            stream = [t for e in encoded for t in e]
            start = rng.randrange(0, max(1, len(stream) - prompt_tokens))
            ids = stream[start : start + prompt_tokens]
        else:
            ids = ids[:max_prompt_tokens]
        if output_tokens is not None:
            out = output_tokens
        else:
            out = min(max(len(encoded[(n + num_requests) % len(encoded)]), min_output_tokens), max_output_tokens)
        items.append(WorkItem((prefix_ids or []) + list(ids), out))
    return items


def arrival_offsets(n: int, mode: str, rate: float | None, seed: int) -> list[float] | None:
    """Send times relative to the start (None for closed-loop concurrency)."""
    if mode == "concurrency":
        return None
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if mode == "poisson" else 1.0 / rate
    return out


async def served_model(session, url: str) -> str | None:
    """The first model id of GET /v1/models (vLLM and SGLang reject requests naming another), or None."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models") as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else {}
        return (data.get("data") or [{}])[0].get("id")
    except Exception:  # a server without /v1/models: send no model name
        return None


async def send(
    session, url: str, endpoint: str, item: WorkItem, tokenizer, extra: dict, prompt_as_text: bool = False
) -> RequestRecord:
    """One streamed request; extra holds more body fields; prompt_as_text sends completions prompts as text."""
    body = {"max_tokens": item.output_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0, **extra}  # fmt: skip
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": tokenizer.decode(item.prompt_ids)}]
    else:
        path = "/v1/completions"
        body["prompt"] = tokenizer.decode(item.prompt_ids) if prompt_as_text else item.prompt_ids
    rec = RequestRecord(send_time=time.perf_counter(), prompt_tokens=len(item.prompt_ids))
    try:
        async with session.post(url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                rec.ok, rec.error = False, f"HTTP {resp.status}: {(await resp.text())[:200]}"
                rec.end_time = time.perf_counter()
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("error"):
                    rec.ok, rec.error = False, str(chunk["error"])
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if endpoint != "chat" else choice.get("delta", {}).get("content")
                    if text:
                        rec.token_times.append(time.perf_counter())
                        rec.generated_text += text
        rec.end_time = time.perf_counter()
        if rec.ok and not rec.token_times:
            rec.ok, rec.error = False, "no output tokens received"
    except Exception as err:  # network errors are results, not crashes
        rec.ok, rec.error, rec.end_time = False, f"{type(err).__name__}: {err}", time.perf_counter()
    return rec


async def run_load(
    url: str,
    items: list[WorkItem],
    tokenizer,
    endpoint: str = "completions",
    mode: str = "concurrency",
    rate: float | None = None,
    concurrency: int = 1,
    seed: int = 0,
    extra: dict | None = None,
    timeout_s: float = 600.0,
    model_name: str | None = None,
    api_key: str | None = None,
    prompt_as_text: bool = False,
    finished: list[RequestRecord] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every item; model_name None asks the server's /v1/models ("" sends none). `finished` (the caller's
    list) receives each record as its request ends, so a Ctrl-C'd run can still summarize what finished. One
    progress line per finished request goes to stderr."""
    import aiohttp

    finished = [] if finished is None else finished

    def done(rec: RequestRecord) -> RequestRecord:
        finished.append(rec)
        elapsed = time.perf_counter() - start
        eta = elapsed / len(finished) * (len(items) - len(finished))
        print(
            f"\r[loadgen] {len(finished)}/{len(items)} requests, {elapsed:.0f} s, ETA {eta:.0f} s ",
            end="\n" if len(finished) == len(items) else "",
            file=sys.stderr,
            flush=True,
        )
        return rec

    extra = dict(extra or {})
    offsets = arrival_offsets(len(items), mode, rate, seed)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        if model_name is None:
            model_name = await served_model(session, url)
        if model_name and "model" not in extra:
            extra["model"] = model_name
        start = time.perf_counter()
        if offsets is None:
            queue = list(enumerate(items))
            records: list[RequestRecord | None] = [None] * len(items)

            async def worker():
                while queue:
                    i, item = queue.pop(0)
                    records[i] = done(await send(session, url, endpoint, item, tokenizer, extra, prompt_as_text))

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
        else:

            async def delayed(offset: float, item: WorkItem) -> RequestRecord:
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                return done(await send(session, url, endpoint, item, tokenizer, extra, prompt_as_text))

            records = await asyncio.gather(*(delayed(o, it) for o, it in zip(offsets, items)))
        duration = time.perf_counter() - start
    for r in records:  # no usage from the server: count the streamed text's tokens (vllm bench serve does)
        if r.ok and not r.output_tokens and r.generated_text and tokenizer is not None:
            r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False).input_ids)
    return list(records), duration


def main(argv: list[str] | None = None) -> None:

    ap = ArgumentParser(prog="python -m evals.loadgen", description=__doc__.splitlines()[0])
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

    tokenizer = load_tokenizer(args.model)
    items = build_workload(
        tokenizer, args.num_requests, args.seed, args.prompt_tokens, args.max_prompt_tokens,
        args.output_tokens, args.min_output_tokens, args.max_output_tokens,
    )  # fmt: skip
    limits = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    # no SLO given: no goodput line (every request would count as "good")
    slo = SLO(*(None if v is None else v / 1e3 for v in limits)) if any(v is not None for v in limits) else None
    finished: list[RequestRecord] = []
    start = time.perf_counter()
    try:
        records, duration = asyncio.run(
            run_load(args.url, items, tokenizer, args.endpoint, args.arrival, args.rate, args.concurrency, args.seed,
                     timeout_s=args.timeout_s, model_name=args.served_model_name, api_key=args.api_key,
                     prompt_as_text=args.prompt_format == "text", finished=finished)
        )  # fmt: skip
    except KeyboardInterrupt:
        if finished:
            print(f"\n[loadgen] partial summary: the {len(finished)} of {len(items)} requests that finished")
            print(format_summary(summarize(finished, time.perf_counter() - start, slo)))
        interrupted(f"{len(finished)} of {len(items)} requests had finished")
    summary = summarize(records, duration, slo)
    print(format_summary(summary))
    errors = sorted({r.error for r in records if not r.ok})
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    if args.out:
        record = {
            **provenance(args.seed),
            "config": vars(args) | {"out": str(args.out)},
            "summary": summary,
            "requests": [asdict(r) for r in records],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str))
        print(f"wrote {args.out}")
    if summary["completed"] == 0:
        sys.exit("no request completed")


if __name__ == "__main__":
    run(main)
