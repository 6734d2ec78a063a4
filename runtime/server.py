"""OpenAI-compatible HTTP server over the serving engine: ``python -m runtime.server --model smollm2-135m``.

Endpoints: POST /v1/completions and /v1/chat/completions (chat template from the tokenizer), both with
SSE streaming (``"stream": true``) and ``usage`` counts; GET /v1/models, /health, /metrics (Prometheus
text: queue length, running requests, KV blocks used, prefix-cache hit rate, tokens/s, ...).

The engine runs in one background thread that owns it; HTTP handlers talk to it only through a queue of
commands (add, abort) and per-request asyncio queues of outputs, so a forward never blocks the event
loop. A client that disconnects, mid-stream or while waiting for a full response, has its request aborted
and its KV blocks freed at the next engine iteration. Bad requests get a 4xx with an OpenAI-style error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from runtime.engine import EngineConfig, LLMEngine, RequestOutput
from runtime.grammar import GrammarError, ResponseFormats
from runtime.sampling import SamplingParams
from runtime.scheduler import RequestRejectedError

MAX_STOP_STRINGS = 4


class BadRequest(ValueError):
    """A client error: becomes a 400 with this message (and the offending parameter)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- the engine thread -------------------------------------------------------------------------------


class EngineThread:
    """Owns the LLMEngine; steps it whenever there is work and routes outputs to request queues."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.metrics = engine.metrics()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qspec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(("wake",))
        self.thread.join(timeout=10)

    async def add(self, prompt_ids: list[int], params: SamplingParams, grammar=None) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.commands.put(("add", request_id, prompt_ids, params, loop, outputs, accepted, grammar))
        await accepted  # raises RequestRejectedError from the engine's admission control
        return request_id, outputs

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.engine.has_unfinished():  # idle: sleep until a command arrives
                    self._handle(self.commands.get(timeout=0.5))
                while True:
                    self._handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except BaseException as err:  # a bug: fail the open requests, report on /health
                    self.error = err
                    for rid in list(self.routes):
                        self._deliver(rid, err)
                    raise
                for out in outputs:
                    self._deliver(out.request_id, out)
            self.metrics = self.engine.metrics()

    def _handle(self, cmd) -> None:
        if cmd is None or cmd[0] == "wake":
            return
        if cmd[0] == "add":
            _, rid, prompt_ids, params, loop, outputs, accepted, grammar = cmd
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, grammar=grammar)
            except (RequestRejectedError, ValueError) as err:
                loop.call_soon_threadsafe(_set_exception, accepted, RequestRejectedError(str(err)))
                return
            self.routes[rid] = (loop, outputs)
            loop.call_soon_threadsafe(_set_result, accepted, rid)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            self.routes.pop(cmd[1], None)

    def _deliver(self, rid: str, item) -> None:
        route = self.routes.get(rid)
        if route is None:
            return
        loop, outputs = route
        if isinstance(item, BaseException) or item.finished:
            self.routes.pop(rid, None)
        loop.call_soon_threadsafe(outputs.put_nowait, item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


# ---- request parsing ---------------------------------------------------------------------------------


def _typed(body: dict, name: str, types: tuple, default, what: str):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; JSON true is not a number
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise BadRequest(f"'{name}' must be {what}, got {type(value).__name__} {json.dumps(value)[:40]}", name)
    return value


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str


def parse_sampling(body: dict, max_tokens_default: int, chat: bool) -> tuple[SamplingParams, bool, bool]:
    max_tokens = _typed(body, "max_tokens", (int,), None, "an integer")
    if chat:
        max_tokens = _typed(body, "max_completion_tokens", (int,), max_tokens, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    n = _typed(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise BadRequest("only n = 1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _typed(body, name, (int, float), 0, "a number") != 0:
            raise BadRequest(f"'{name}' is not supported (must be 0)", name)
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("'logprobs' is not supported", "logprobs")
    if not chat and _typed(body, "echo", (bool,), False, "a boolean"):
        raise BadRequest("'echo' is not supported", "echo")
    stream = _typed(body, "stream", (bool,), False, "a boolean")
    options = _typed(body, "stream_options", (dict,), {}, "an object")
    include_usage = _typed(options, "include_usage", (bool,), False, "a boolean")
    try:
        params = SamplingParams(
            temperature=float(_typed(body, "temperature", (int, float), 1.0, "a number")),
            top_p=float(_typed(body, "top_p", (int, float), 1.0, "a number")),
            top_k=_typed(body, "top_k", (int,), 0, "an integer"),
            seed=_typed(body, "seed", (int,), None, "an integer"),
            max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
            stop=stop,
            ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
        )
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return params, stream, include_usage


def parse_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        return tokenizer(prompt, add_special_tokens=False).input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise BadRequest(f"token ids in 'prompt' must be in [0, {vocab_size})", "prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def parse_messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs a 'role' of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        clean.append({"role": m["role"], "content": content})
    ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- text assembly -----------------------------------------------------------------------------------


class TextAssembler:
    """Incremental detokenization with stop strings: releases only text that can no longer change
    (no trailing partial UTF-8 character, no possible start of a stop string)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.stopped = False

    def text(self, output_ids: list[int], final: bool) -> str:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                text, self.stopped = text[:at], True
        if not final and not self.stopped:
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
            text = text[: max(len(text) - self.hold, self.sent)]
        return text

    def delta(self, output_ids: list[int], final: bool) -> str:
        text = self.text(output_ids, final)
        new, self.sent = text[self.sent :], max(self.sent, len(text))
        return new


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


# ---- the app -----------------------------------------------------------------------------------------


class Server:
    def __init__(self, engine: LLMEngine, tokenizer, model_name: str):
        self.engine_thread = EngineThread(engine)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.vocab_size = engine.model.config.vocab_size
        self.grammars = ResponseFormats(tokenizer, engine.model.config)  # response_format -> Grammar
        self.default_max_tokens = 16
        self.http_counts: dict[int, int] = {}
        self.started = time.time()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._start_engine)
        app.on_shutdown.append(self._stop_engine)
        return app

    async def _start_engine(self, app: web.Application) -> None:
        self.engine_thread.start()

    async def _stop_engine(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine_thread.stop)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except BadRequest as err:
            response = error_response(400, str(err), err.param)
        except GrammarError as err:
            response = error_response(400, str(err), "response_format")
        except RequestRejectedError as err:
            response = error_response(400, str(err), "prompt", code="context_length_exceeded")
        except web.HTTPException as err:
            response = error_response(err.status, err.reason or "error")
        self.http_counts[response.status] = self.http_counts.get(response.status, 0) + 1
        return response

    async def _json_body(self, request: web.Request) -> dict:
        try:
            body = json.loads(await request.read() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRequest(f"malformed JSON body: {err}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        _typed(body, "model", (str,), None, "a string")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        params, stream, include_usage = parse_sampling(body, self.default_max_tokens, chat=False)
        prompt_ids = parse_prompt(body, self.tokenizer, self.vocab_size)
        grammar = self.grammars.parse(body)
        return await self._serve(request, prompt_ids, params, stream, include_usage, chat=False, grammar=grammar)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        params, stream, include_usage = parse_sampling(body, self.default_max_tokens, chat=True)
        prompt_ids = parse_messages(body, self.tokenizer)
        grammar = self.grammars.parse(body)
        return await self._serve(request, prompt_ids, params, stream, include_usage, chat=True, grammar=grammar)

    async def _serve(self, request, prompt_ids, params, stream, include_usage, chat, grammar=None):
        if self.engine_thread.error is not None:
            return error_response(500, f"engine failed: {self.engine_thread.error!r}")
        rid, outputs = await self.engine_thread.add(prompt_ids, params, grammar)
        finished = False
        try:
            assembler = TextAssembler(self.tokenizer, params.stop)
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            if not stream:
                while True:
                    out = await outputs.get()
                    if isinstance(out, BaseException):
                        return error_response(500, f"engine failed: {out!r}")
                    if out.finished:
                        finished = True
                        break
                text = assembler.text(out.output_ids, final=True)
                choice = {"index": 0, "finish_reason": finish_reason(out, assembler)}
                if grammar is not None and (out.grammar_incomplete or assembler.stopped):
                    choice["grammar_incomplete"] = True  # cut (max_tokens, stop) before the grammar was satisfied
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice.update(text=text, logprobs=None)
                return web.json_response(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [choice],
                        "usage": usage(out),
                    }  # fmt: skip
                )
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            async def send(choice: dict | None, extra: dict | None = None) -> None:
                payload = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                           "choices": [choice] if choice else [], **(extra or {})}  # fmt: skip
                await response.write(f"data: {json.dumps(payload)}\n\n".encode())

            if chat:
                await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    await response.write(f"data: {json.dumps({'error': {'message': repr(out)}})}\n\n".encode())
                    break
                finished = out.finished
                delta = assembler.delta(out.output_ids, final=out.finished)
                reason = finish_reason(out, assembler) if out.finished else None
                if delta or reason:
                    flag = {"grammar_incomplete": True} if reason and grammar is not None and (
                        out.grammar_incomplete or assembler.stopped) else {}  # fmt: skip
                    if chat:
                        delta_obj = {"content": delta} if delta else {}
                        await send({"index": 0, "delta": delta_obj, "finish_reason": reason, **flag})
                    else:
                        await send({"index": 0, "text": delta, "logprobs": None, "finish_reason": reason, **flag})
                if out.finished:
                    if include_usage:
                        await send(None, {"usage": usage(out)})
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not finished:  # client went away (cancelled handler or failed write): free its blocks
                self.engine_thread.abort(rid)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "qspec"}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.engine_thread.error is not None or not self.engine_thread.thread.is_alive():
            return web.json_response({"status": "error", "error": repr(self.engine_thread.error)}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        m = self.engine_thread.metrics
        lines = []
        for name, value in m.items():
            kind = "counter" if name.endswith("_total") and name != "kv_blocks_total" else "gauge"
            lines += [f"# TYPE qspec_{name} {kind}", f"qspec_{name} {float(value):.6g}"]
        lines.append("# TYPE qspec_http_responses_total counter")
        lines += [f'qspec_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(self.http_counts.items())]
        lines += ["# TYPE qspec_uptime_seconds gauge", f"qspec_uptime_seconds {time.time() - self.started:.1f}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def finish_reason(out: RequestOutput, assembler: TextAssembler) -> str:
    return "stop" if assembler.stopped else FINISH_REASONS.get(out.finish_reason, out.finish_reason)


def usage(out: RequestOutput) -> dict:
    n_out = len(out.output_ids)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": out.num_prompt_tokens + n_out,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for unlabelled samples (used by tests and the load generator)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> None:
    import torch

    from runtime.generate import DTYPES
    from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m runtime.server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory budget of the KV block pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decode-kernel", choices=["auto", "triton", "torch"], default="auto",
                    help="decode attention: auto = Triton paged kernel on CUDA, gather + SDPA on CPU")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    ap.add_argument("--policy", choices=["continuous", "static"], default="continuous")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-chunked-prefill", action="store_true")
    ap.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens when a request omits it")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--speculator", choices=["ngram"], default=None, help="speculative decoding in the engine step (lossless)"
    )
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k: drafts per sequence and step")
    args = ap.parse_args(argv)
    names = (
        "port",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "default_max_tokens",
        "num_speculative_tokens",
    )
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_cache_gb <= 0:
        ap.error("--kv-cache-gb must be > 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, _, path = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    tokenizer = load_tokenizer(str(path))
    config = EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill,
        policy=args.policy,
        max_model_len=args.max_model_len,
        decode_kernel=args.decode_kernel,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    speculator = None
    if args.speculator == "ngram":
        from speculate.engine import EngineNgramSpeculator

        speculator = EngineNgramSpeculator()
    engine = LLMEngine(model, tokenizer, config, speculator=speculator)
    server = Server(engine, tokenizer, args.model)
    server.default_max_tokens = args.default_max_tokens
    bm = engine.block_manager
    print(
        f"[qspec] serving {args.model} on http://{args.host}:{args.port} ({args.dtype}, {args.device}); "
        f"KV pool {bm.num_usable_blocks} blocks x {bm.block_size} tokens = {engine.cache.nbytes() / 2**20:.0f} MiB, "
        f"max context {engine.scheduler.config.max_model_len}, decode attention {engine.cache.decode_kernel}",
        flush=True,
    )
    web.run_app(server.app(), host=args.host, port=args.port, handler_cancellation=True, print=None)


if __name__ == "__main__":
    main()
