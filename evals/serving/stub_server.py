"""A stub OpenAI-compatible server with known latencies:
``python -m evals.serving.stub_server --ttft-ms 200 --itl-ms 40``.

It runs no model. Each request streams ``max_tokens`` tokens (the word " tok" each, so a tokenizer counts
them) on a fixed schedule measured from the request's arrival: the first chunk at TTFT, chunk i at
TTFT + i * ITL (absolute deadlines, so delays do not accumulate), then a ``usage`` chunk when
``stream_options.include_usage`` is set, then ``[DONE]``. Every request is served concurrently (no queueing),
so a client that measures TTFT, TPOT and ITL should get back the configured values at any concurrency.
``--tokens-per-chunk`` bundles tokens as speculative or batching servers do (ITL then counts chunks, TPOT
tokens); ``--no-usage`` omits usage counts, as some llama.cpp builds do. Endpoints: /v1/completions,
/v1/chat/completions (streaming and not), /v1/models, /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

from aiohttp import web

TOKEN_TEXT = " tok"


@dataclass
class StubConfig:
    ttft_s: float = 0.2
    itl_s: float = 0.04
    tokens_per_chunk: int = 1
    default_max_tokens: int = 16
    usage: bool = True
    model: str = "stub-model"

    def __post_init__(self):
        if self.ttft_s < 0 or self.itl_s < 0:
            raise ValueError(f"latencies must be >= 0, got ttft {self.ttft_s}, itl {self.itl_s}")
        if self.tokens_per_chunk < 1:
            raise ValueError(f"tokens per chunk must be >= 1, got {self.tokens_per_chunk}")


def prompt_tokens_of(body: dict, chat: bool) -> int:
    """A rough prompt size: token ids count as given, text by whitespace words."""
    if chat:
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


def make_app(cfg: StubConfig) -> web.Application:
    async def completions(request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON", "type": "invalid_request_error"}}, 400)
        n = body.get("max_tokens", body.get("max_completion_tokens", cfg.default_max_tokens))
        if not isinstance(n, int) or n < 1:
            return web.json_response({"error": {"message": "max_tokens must be an integer >= 1"}}, status=400)
        usage = {"prompt_tokens": prompt_tokens_of(body, chat), "completion_tokens": n, "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": f"stub-{id(request)}", "created": int(time.time()), "model": cfg.model}
        chunks = [min(cfg.tokens_per_chunk, n - i) for i in range(0, n, cfg.tokens_per_chunk)]
        if not body.get("stream"):
            await asyncio.sleep(cfg.ttft_s + (len(chunks) - 1) * cfg.itl_s)
            text = TOKEN_TEXT * n
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({**base, "object": kind, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        for i, count in enumerate(chunks):
            await asyncio.sleep(max(0.0, arrival + cfg.ttft_s + i * cfg.itl_s - time.perf_counter()))
            last = i == len(chunks) - 1
            text = TOKEN_TEXT * count
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            await send({**base, "object": kind + (".chunk" if chat else ""), "choices": [choice]})
        if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "object": kind + (".chunk" if chat else ""), "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "stub"}]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", lambda r: completions(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: completions(r, chat=True))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evals.serving.stub_server", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--ttft-ms", type=float, default=200.0, help="time to the first chunk (default 200)")
    ap.add_argument("--itl-ms", type=float, default=40.0, help="time between chunks (default 40)")
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--no-usage", action="store_true", help="never send usage counts")
    ap.add_argument("--model-name", default="stub-model")
    args = ap.parse_args(argv)
    try:
        cfg = StubConfig(args.ttft_ms / 1e3, args.itl_ms / 1e3, args.tokens_per_chunk, usage=not args.no_usage,
                         model=args.model_name)  # fmt: skip
    except ValueError as err:
        ap.error(str(err))
    print(f"stub server on http://{args.host}:{args.port} (TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms)")
    web.run_app(make_app(cfg), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
