"""Load on an OpenAI-compatible server, as functions: the workload (wiki prompts and output lengths), arrival
times, and the streaming client that sends each request and records its clocks (evals.serving.metrics).
evals.serving.loadgen is the command; experiments.sweeps and evals.serving.bench_serving drive the same client.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

from evals.serving.metrics import RequestRecord
from runtime.data import wiki_split


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
