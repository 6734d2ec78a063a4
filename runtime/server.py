"""OpenAI-compatible HTTP server over the serving engine: ``python -m runtime.server --model smollm2-135m``.

Endpoints: POST /v1/completions and /v1/chat/completions (chat template from the tokenizer), both with
SSE streaming (``"stream": true``) and ``usage`` counts; GET /v1/models, /v1/models/{id}, /health,
/metrics (Prometheus text: queue length, running requests, KV blocks used, prefix-cache hit rate, tokens/s).

Parameters (vLLM's meanings): n, best_of, temperature, top_p, top_k (-1 or 0 = off), seed (choice i uses
seed + i), stop, stop_token_ids, min_tokens, ignore_eos, max_tokens (chat default: the rest of the context),
presence / frequency / repetition penalties, logit_bias, logprobs (+ top_logprobs in chat), echo. All of
them go through the engine's one sampler, with or without --speculator, and logprobs are always the target
model's own log-softmax. A parameter the server cannot honour is a 400 naming it; an unknown model a 404.

The engine runs in one background thread that owns it; HTTP handlers talk to it only through a queue of
commands (add, abort) and per-request mailboxes that hold only the newest output of each choice (every
output carries all tokens so far), so a client that reads slowly costs O(its tokens) memory, never more.
A client that disconnects has its request aborted and its KV blocks freed at the next engine iteration.
An exception raised for one request fails that request alone (a 500, or an error event in its stream);
the engine serves on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, replace

from aiohttp import web

from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPE_CHOICES, cli_dtype, dtype_name
from runtime.engine import EngineConfig, LLMEngine, RequestOutput
from runtime.grammar import Grammar, GrammarError, ResponseFormats
from runtime.kv_quant import KV_DTYPES
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.sampling import SamplingParams, TokenLogprob
from runtime.scheduler import RequestRejectedError
from speculate.cli import (  # entry point: composes the layers
    add_speculator_args,
    check_speculator_args,
    speculator_from_args,
)

log = logging.getLogger("qspec.server")

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n and best_of
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default limit)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_BODY_BYTES = 1 << 20  # a request body, before and after its Content-Encoding is undone (aiohttp's default)
# a client that hangs up before its response is complete: counted under nginx's 499, never as a 500
CLIENT_CLOSED_REQUEST = 499
CLIENT_GONE = "qspec_client_gone"  # request key set when a stream write found the client gone
CONTENT_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # zlib wbits

# what each endpoint reads; anything else is a 400 naming it (never silently ignored)
COMMON_PARAMS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
    "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids",
    "min_tokens", "ignore_eos", "logprobs", "user", "response_format",
}  # fmt: skip
COMPLETION_PARAMS = COMMON_PARAMS | {"prompt", "echo"}
CHAT_PARAMS = COMMON_PARAMS | {"messages", "max_completion_tokens", "top_logprobs"}
# known OpenAI / vLLM parameters this server does not implement, and the values that mean "not used"
UNSUPPORTED = {
    "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "prompt_logprobs": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,), "store": (None, False),
    "metadata": (None,), "service_tier": (None, "auto", "default"), "top_a": (None,), "min_p": (None, 0, 0.0),
}  # fmt: skip


class BadRequest(ValueError):
    """A client error: becomes a 4xx (400 by default) with this message and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# ---- the engine thread -------------------------------------------------------------------------------


class Mailbox:
    """The newest output of each choice of one HTTP request, filled from the engine thread (through the
    event loop). A reader that falls behind finds only the latest state of each choice: memory is bounded
    by the request's tokens however slowly its client reads."""

    def __init__(self):
        self.latest: dict[int, RequestOutput | BaseException] = {}
        self.event = asyncio.Event()

    def put(self, index: int, item: RequestOutput | BaseException) -> None:
        self.latest[index] = item
        self.event.set()

    async def get(self) -> dict[int, RequestOutput | BaseException]:
        await self.event.wait()
        self.event.clear()
        items, self.latest = self.latest, {}
        return items


class EngineThread:
    """Owns the LLMEngine; steps it whenever there is work and routes outputs to request mailboxes."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, Mailbox, int]] = {}
        self.metrics = engine.metrics()
        self.error: BaseException | None = None
        self.num_step_failures = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qspec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(("wake",))
        self.thread.join(timeout=10)

    async def add(
        self,
        request_ids: list[str],
        prompt_ids: list[int],
        params: list[SamplingParams],
        grammar: Grammar | None = None,
    ) -> Mailbox:
        """Queue one engine request per choice (each with its own matcher of the grammar); raises what the
        engine's admission control raised."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        mailbox = Mailbox()
        self.commands.put(("add", request_ids, prompt_ids, params, loop, mailbox, accepted, grammar))
        await accepted
        return mailbox

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
                except Exception as err:  # not attributable to one request (the engine isolates those)
                    self._fail_all(err)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
            self.metrics = self.engine.metrics()

    def _fail_all(self, err: Exception) -> None:
        """A step failed outside any one request: fail every request in flight, free their blocks, serve on;
        if even that fails, the engine is broken: report it on /health and end the thread."""
        log.error("engine step failed: %r; failing the %d requests in flight", err, len(self.routes), exc_info=err)
        self.num_step_failures += 1
        try:
            for rid in list(self.engine.seqs):
                self.engine.abort_request(rid)
        except Exception as fatal:
            self.error = fatal
            raise
        finally:
            for rid in list(self.routes):
                self._deliver(rid, err)

    def _handle(self, cmd) -> None:
        if cmd is None or cmd[0] == "wake":
            return
        if cmd[0] == "add":
            _, rids, prompt_ids, params, loop, mailbox, accepted, grammar = cmd
            added = []
            try:
                for rid, p in zip(rids, params):
                    self.engine.add_request(prompt_ids, p, request_id=rid, grammar=grammar)
                    added.append(rid)
            except Exception as err:  # admission control, or a failure for this request alone
                for rid in added:
                    self.engine.abort_request(rid)
                loop.call_soon_threadsafe(_set_exception, accepted, err)
                return
            for i, rid in enumerate(rids):
                self.routes[rid] = (loop, mailbox, i)
            loop.call_soon_threadsafe(_set_result, accepted, rids)
        elif cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            self.routes.pop(cmd[1], None)

    def _deliver(self, rid: str, item) -> None:
        route = self.routes.get(rid)
        if route is None:
            return
        loop, mailbox, index = route
        if isinstance(item, BaseException) or item.finished:
            self.routes.pop(rid, None)
        loop.call_soon_threadsafe(mailbox.put, index, item)


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


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = _typed(body, name, (int, float), default, "a number")
    # compared before float(): an integer of 309+ digits has no float (OverflowError)
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
        big = isinstance(value, int) and abs(value) >= 10**20
        shown = f"an integer of {len(str(abs(value)))} digits" if big else value
        raise BadRequest(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {shown}", name)
    return float(value)


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    value = _typed(body, name, (int,), default, "an integer")
    if value is not None and (value < lo or hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"'{name}' must be an integer {bound}, got {value}", name)
    return value


def _token_ids(value, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"'{name}' must be a list of token ids", name)
    if any(t < 0 or t >= vocab_size for t in value):
        raise BadRequest(f"token ids in '{name}' must be in [0, {vocab_size})", name)
    return value


def check_params(body: dict, chat: bool) -> None:
    allowed = CHAT_PARAMS if chat else COMPLETION_PARAMS
    for name, value in body.items():
        if name in allowed:
            continue
        if name in UNSUPPORTED:
            if any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[name]):
                continue
            raise BadRequest(f"'{name}' is not supported by this server", name)
        where = "/v1/chat/completions" if chat else "/v1/completions"
        raise BadRequest(f"unrecognized request argument '{name}' for {where}", name[:100])


@dataclass
class ParsedRequest:
    params: SamplingParams  # of choice 0 (choice i: seed + i)
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top alternatives per token when logprobs were asked for
    zero_tokens: bool  # echo with max_tokens 0: the prompt only (one token is generated and dropped)


def parse_sampling(body: dict, chat: bool, vocab_size: int, max_tokens_default: int) -> ParsedRequest:
    """The sampling and response options of a request (the prompt is parsed separately)."""
    check_params(body, chat)
    stream = _typed(body, "stream", (bool,), False, "a boolean")
    options = _typed(body, "stream_options", (dict,), {}, "an object")
    include_usage = _typed(options, "include_usage", (bool,), False, "a boolean")
    echo = False if chat else _typed(body, "echo", (bool,), False, "a boolean")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 0 if echo else 1)
    zero_tokens = max_tokens == 0
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    best_of = _int(body, "best_of", n, 1, MAX_CHOICES)
    if best_of < n:
        raise BadRequest(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    if stream and best_of != n:
        raise BadRequest("'best_of' != 'n' cannot be streamed (the best are known only at the end)", "best_of")
    if chat:
        want = _typed(body, "logprobs", (bool,), False, "a boolean")
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    bias = _typed(body, "logit_bias", (dict,), {}, "an object of token id -> bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    logit_bias, name = {}, "logit_bias"
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) < 12 and int(key) < vocab_size):
            raise BadRequest(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key[:40]!r}", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {str(value)[:40]}", name)
        logit_bias[int(key)] = float(value)
    top_k = _int(body, "top_k", 0, -1)
    seed = _typed(body, "seed", (int,), None, "an integer")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise BadRequest("'seed' must be in [-2**63, 2**64)", "seed")
    if max_tokens is None:
        max_tokens = max_tokens_default
    min_tokens = _int(body, "min_tokens", 0, 0)
    if min_tokens > max(max_tokens, 1):
        raise BadRequest(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0, 1e6),
        top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True),
        top_k=max(top_k, 0),
        seed=seed,
        max_tokens=max(max_tokens, 1),
        stop=stop,
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab_size),
        ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
        min_tokens=min_tokens,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 100),
        logit_bias=logit_bias,
        # best_of ranks choices by their cumulative log-prob, so it needs them even when not asked for
        logprobs=logprobs if logprobs is not None or best_of == n else 0,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
    )
    return ParsedRequest(params, n, best_of, stream, include_usage, echo, logprobs, zero_tokens)


def choice_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """Choice i draws with seed + i (wrapped into torch's range), so choices differ yet reproduce."""
    if params.seed is None:
        return [params] * count
    return [params] + [replace(params, seed=(params.seed + i) % 2**64) for i in range(1, count)]


def parse_prompt(body: dict, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """-> (token ids, the prompt text when it was given as text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        return tokenizer(prompt, add_special_tokens=False).input_ids, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return _token_ids(prompt, "prompt", vocab_size), None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse_messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}] needs a 'role' of system, developer, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        clean.append({"role": CHAT_ROLES[m["role"]], "content": content})  # developer: OpenAI's new system
    ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def parse_json(raw: bytes) -> dict:
    """Strict JSON: a 400 (never a 500) for bad UTF-8, NaN/Infinity, integers past Python's 4300-digit
    limit, nesting deeper than the recursion limit, and lone UTF-16 surrogates (valid JSON escapes that
    no UTF-8 tokenizer can take)."""

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw or b"null", parse_constant=no_constants)
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, huge integers, NaN
        raise BadRequest(f"malformed JSON body: {str(err)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the body has a lone UTF-16 surrogate (e.g. \\ud800) in a string: not valid Unicode") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    return body


def decode_body(raw: bytes, content_encoding: str) -> bytes:
    """Undo a request's Content-Encoding (gzip, deflate, identity; listed in the order applied): a body that
    does not decode is a 400, another encoding a 415, and a body that decodes past MAX_BODY_BYTES a 413."""
    for coding in reversed([c.strip().lower() for c in content_encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding not in CONTENT_CODINGS:
            raise BadRequest(f"unsupported Content-Encoding {coding[:40]!r}; use gzip, deflate or identity", status=415)
        inflater = zlib.decompressobj(CONTENT_CODINGS[coding])
        try:
            out = inflater.decompress(raw, MAX_BODY_BYTES + 1)
            out += inflater.flush() if len(out) <= MAX_BODY_BYTES else b""
        except zlib.error as err:
            raise BadRequest(f"the body is not valid {coding} data: {err}") from None
        if len(out) > MAX_BODY_BYTES:
            raise BadRequest(f"the decoded body is larger than {MAX_BODY_BYTES} bytes", status=413)
        if not inflater.eof:
            raise BadRequest(f"the body is truncated {coding} data")
        raw = out
    return raw


# ---- text assembly -----------------------------------------------------------------------------------


class TextAssembler:
    """Incremental detokenization with stop strings: each call decodes only the tokens new since the last
    one (with the previous chunk as context, as vLLM does, so a leading space or a multi-token character
    comes out as in a full decode): O(n) over a stream. Releases only text that can no longer change (no
    trailing partial UTF-8 character, no possible start of a stop string)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.longest = max((len(s) for s in stop), default=0)
        self.decoded = ""  # text of ids[: self.read]
        self.prefix = self.read = 0
        self.sent = 0
        self.stopped = False

    def _advance(self, ids: list[int], final: bool) -> None:
        if self.stopped or len(ids) <= self.read:
            return
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(ids[self.prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") and not final:
            return  # a character still split across tokens: wait for the rest
        start = max(0, len(self.decoded) - self.longest + 1)
        self.decoded += after[len(before) :]
        self.prefix, self.read = self.read, len(ids)
        hits = [at for at in (self.decoded.find(s, start) for s in self.stop) if at != -1]
        if hits:  # the earliest stop string wins
            self.decoded, self.stopped = self.decoded[: min(hits)], True

    def text(self, output_ids: list[int], final: bool) -> str:
        self._advance(output_ids, final)
        text = self.decoded
        if not final and not self.stopped:
            text = text[: max(len(text) - self.hold, self.sent)]
        return text

    def delta(self, output_ids: list[int], final: bool) -> str:
        text = self.text(output_ids, final)
        new, self.sent = text[self.sent :], max(self.sent, len(text))
        return new


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


# ---- the app -----------------------------------------------------------------------------------------


class Server:
    def __init__(
        self,
        engine: LLMEngine,
        tokenizer,
        model_name: str,
        served_names: list[str] | None = None,
        api_key: str | None = None,
        allowed_hosts: list[str] | None = None,
    ):
        self.engine_thread = EngineThread(engine)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.served_names = served_names or [model_name]
        self.api_key = api_key or None
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None
        self.vocab_size = engine.model.config.vocab_size
        self.grammars = ResponseFormats(tokenizer, engine.model.config)  # response_format -> compiled Grammar
        bm = engine.block_manager
        # the longest sequence one request can have: the context, or what the whole KV pool holds
        self.max_len = min(engine.scheduler.config.max_model_len, bm.num_usable_blocks * bm.block_size)
        self.default_max_tokens = 16
        dtype = engine.model.compute_dtype
        self.fingerprint = "fp_" + hashlib.sha256(f"{model_name}|{dtype}|{engine.device}".encode()).hexdigest()[:10]
        self.http_counts: dict[int, int] = {}
        self.started = time.time()

    def app(self) -> web.Application:
        # bodies are decoded here (decode_body), not by aiohttp, whose decoding errors surface as 500s
        app = web.Application(
            middlewares=[self._errors, self._guard],
            client_max_size=MAX_BODY_BYTES,
            handler_args={"auto_decompress": False},
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
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
        except asyncio.CancelledError:  # the client hung up and aiohttp cancelled the handler
            self._count(CLIENT_CLOSED_REQUEST)
            raise
        except BadRequest as err:
            response = error_response(err.status, str(err), err.param, err.code)
        except GrammarError as err:
            response = error_response(400, str(err), "response_format")
        except RequestRejectedError as err:  # the scheduler's limits: context length and KV pool size
            response = error_response(400, str(err), "prompt", code="context_length_exceeded")
        except web.HTTPException as err:
            response = error_response(err.status, err.reason or "error")
        except Exception as err:  # a bug in request handling: still a JSON error, and the server serves on
            log.error("internal error handling %s %s", request.method, request.path, exc_info=err)
            response = error_response(500, f"internal error: {type(err).__name__}: {str(err)[:300]}")
        self._count(CLIENT_CLOSED_REQUEST if request.get(CLIENT_GONE) else response.status)
        return response

    def _count(self, status: int) -> None:
        self.http_counts[status] = self.http_counts.get(status, 0) + 1

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """--allowed-hosts (a DNS-rebinding page sends its own Host), --api-key on every /v1 route, and
        JSON-only bodies: a cross-origin text/plain POST needs no CORS preflight, application/json does."""
        if self.allowed_hosts is not None and "*" not in self.allowed_hosts:
            try:
                host = (request.url.host or "").strip("[]").lower()
            except ValueError:  # a Host header that is no host at all
                host = ""
            if host not in self.allowed_hosts:
                raise BadRequest(f"Host {request.host!r:.100} is not in --allowed-hosts", status=403, code="bad_host")
        if self.api_key is not None and request.path.startswith("/v1"):
            auth = request.headers.get("Authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                raise BadRequest("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                                 code="invalid_api_key")  # fmt: skip
        if request.method == "POST" and request.content_type != "application/json":
            raise BadRequest(f"Content-Type must be application/json, got {request.content_type!r}", status=415)
        return await handler(request)

    async def _json_body(self, request: web.Request) -> dict:
        body = parse_json(decode_body(await request.read(), request.headers.get("Content-Encoding", "")))
        model = _typed(body, "model", (str,), None, "a string")
        if model is not None and model not in self.served_names:
            raise BadRequest(f"The model `{model[:200]}` does not exist.", "model", 404, "model_not_found")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        req = parse_sampling(body, False, self.vocab_size, self.default_max_tokens)
        prompt_ids, prompt_text = parse_prompt(body, self.tokenizer, self.vocab_size)
        return await self._serve(request, prompt_ids, prompt_text, req, False, self.grammars.parse(body))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        req = parse_sampling(body, True, self.vocab_size, self.default_max_tokens)
        prompt_ids = parse_messages(body, self.tokenizer)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            rest = self.max_len - len(prompt_ids)  # vLLM: the rest of the context
            if rest < 1:
                raise BadRequest(
                    f"the messages take {len(prompt_ids)} tokens; the maximum context length is {self.max_len}",
                    "messages", code="context_length_exceeded",
                )  # fmt: skip
            req.params = replace(req.params, max_tokens=rest)
        return await self._serve(request, prompt_ids, None, req, True, self.grammars.parse(body))

    async def _serve(
        self, request, prompt_ids, prompt_text, req: ParsedRequest, chat: bool, grammar: Grammar | None
    ) -> web.StreamResponse:
        if self.engine_thread.error is not None:
            return error_response(503, f"engine failed: {self.engine_thread.error!r}")
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        rids = [f"{cid}-{i}" for i in range(req.best_of)]
        try:
            mailbox = await self.engine_thread.add(rids, prompt_ids, choice_params(req.params, req.best_of), grammar)
        except RequestRejectedError:
            raise
        except ValueError as err:  # the engine refused the request's values
            raise BadRequest(str(err)) from None
        final: dict[int, RequestOutput] = {}
        try:
            meta = {"id": cid, "created": int(time.time()), "model": self.model_name,
                    "system_fingerprint": self.fingerprint}  # fmt: skip
            if req.echo and prompt_text is None:
                prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
            if not req.stream:
                while len(final) < len(rids):
                    for i, out in (await mailbox.get()).items():
                        if isinstance(out, BaseException) or out.finish_reason == "error":
                            return error_response(500, f"internal error while generating: {_error_text(out)}")
                        if out.finished:
                            final[i] = out
                return web.json_response(self._full_response(meta, final, req, chat, prompt_ids, prompt_text))
            return await self._stream(request, meta, mailbox, final, req, chat, prompt_ids, prompt_text, len(rids))
        finally:
            for i, rid in enumerate(rids):
                if i not in final:  # client went away, or an error: free its blocks
                    self.engine_thread.abort(rid)

    def _full_response(self, meta, final, req: ParsedRequest, chat, prompt_ids, prompt_text) -> dict:
        order = sorted(final, key=lambda i: -final[i].cumulative_logprob) if req.best_of > req.n else sorted(final)
        choices = []
        for index, i in enumerate(order[: req.n]):
            out = final[i]
            ids = [] if req.zero_tokens else out.output_ids
            assembler = TextAssembler(self.tokenizer, req.params.stop)
            text = assembler.text(ids, final=True)
            lps = (out.logprobs or [])[: len(ids)]
            choice = {"index": index, "finish_reason": "length" if req.zero_tokens else finish_reason(out, assembler)}
            if out.grammar_incomplete or (assembler.stopped and out.constrained):
                choice["grammar_incomplete"] = True  # cut (max_tokens, stop) before the grammar was satisfied
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = None if req.logprobs is None else {"content": self._chat_logprobs(lps)}
            else:
                lp = None
                if req.logprobs is not None:
                    echoed = prompt_ids if req.echo else []
                    lp = self._completion_logprobs(out.prompt_logprobs if req.echo else [], echoed, lps)
                choice.update(text=(prompt_text if req.echo else "") + text, logprobs=lp)
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        return {"object": obj, **meta, "choices": choices, "usage": usage(list(final.values()), req.zero_tokens)}

    async def _stream(self, request, meta, mailbox, final, req, chat, prompt_ids, prompt_text, count):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await self._stream_events(request, response, meta, mailbox, final, req, chat, prompt_ids, prompt_text,
                                      count)  # fmt: skip
        except ConnectionError:  # the client hung up mid-stream: not a server error (_serve aborts the rest)
            log.info("client went away during a stream (%s %s)", request.method, request.path)
            request[CLIENT_GONE] = True
        return response

    async def _stream_events(self, request, response, meta, mailbox, final, req, chat, prompt_ids, prompt_text,
                             count) -> None:  # fmt: skip
        await response.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        async def send_choice(choice: dict | None, extra: dict | None = None) -> None:
            await send({"object": obj, **meta, "choices": [choice] if choice else [], **(extra or {})})

        assemblers = [TextAssembler(self.tokenizer, req.params.stop) for _ in range(count)]
        sent_tokens = [0] * count
        echoed = [not req.echo] * count
        if chat:
            for i in range(count):
                await send_choice({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})  # fmt: skip
        failed = False
        while len(final) < count and not failed:
            for i, out in sorted((await mailbox.get()).items()):
                if isinstance(out, BaseException) or out.finish_reason == "error":
                    await send({"error": {"message": f"internal error while generating: {_error_text(out)}",
                                          "type": "server_error", "param": None, "code": None}})  # fmt: skip
                    failed = True
                    break
                if not echoed[i]:  # the prompt first, with its log-probs from the engine's first output
                    lp = None
                    if req.logprobs is not None:
                        lp = self._completion_logprobs(out.prompt_logprobs, prompt_ids, [])
                    await send_choice({"index": i, "text": prompt_text, "logprobs": lp, "finish_reason": None})
                    echoed[i] = True
                ids = [] if req.zero_tokens else out.output_ids
                delta = assemblers[i].delta(ids, final=out.finished)
                reason = None
                if out.finished:
                    final[i] = out
                    reason = "length" if req.zero_tokens else finish_reason(out, assemblers[i])
                new_lps = (out.logprobs or [])[sent_tokens[i] : len(ids)] if req.logprobs is not None else []
                sent_tokens[i] = len(ids)
                if not (delta or reason or new_lps):
                    continue
                flag = {}
                if reason and (out.grammar_incomplete or (assemblers[i].stopped and out.constrained)):
                    flag = {"grammar_incomplete": True}
                if chat:
                    lp = {"content": self._chat_logprobs(new_lps)} if req.logprobs is not None else None
                    await send_choice({"index": i, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                                       "finish_reason": reason, **flag})  # fmt: skip
                else:
                    lp = self._completion_logprobs([], [], new_lps) if req.logprobs is not None else None
                    await send_choice({"index": i, "text": delta, "logprobs": lp, "finish_reason": reason, **flag})
        if not failed and req.include_usage:
            await send_choice(None, {"usage": usage(list(final.values()), req.zero_tokens)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    # ---- logprobs in the two OpenAI shapes ------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> list[dict]:
        def entry(token: int, logprob: float) -> dict:
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

        return [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps]

    def _completion_logprobs(self, prompt_lps: list | None, prompt_ids: list[int], lps: list[TokenLogprob]) -> dict:
        """OpenAI's legacy shape; with echo the prompt's tokens come first (the first has no log-prob)."""
        tokens, token_lps, tops, offsets, at = [], [], [], [], 0
        rows = [(t, p) for t, p in zip(prompt_ids, prompt_lps or [None] * len(prompt_ids))]
        rows += [(t.token, t) for t in lps]
        for token, lp in rows:
            text = self._token_text(token)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self._token_text(i): v for i, v in lp.top})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # ---- the other routes ----------------------------------------------------------------------------

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": int(self.started), "owned_by": "qspec",
                "max_model_len": self.max_len}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self.served_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.served_names:
            raise BadRequest(f"The model `{name[:200]}` does not exist.", "model", 404, "model_not_found")
        return web.json_response(self._model_card(name))

    async def health(self, request: web.Request) -> web.Response:
        if self.engine_thread.error is not None or not self.engine_thread.thread.is_alive():
            return web.json_response({"status": "error", "error": repr(self.engine_thread.error)}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        m = {**self.engine_thread.metrics, "engine_step_failures_total": self.engine_thread.num_step_failures}
        lines = []
        for name, value in m.items():
            kind = "counter" if name.endswith("_total") and name != "kv_blocks_total" else "gauge"
            lines += [f"# TYPE qspec_{name} {kind}", f"qspec_{name} {float(value):.6g}"]
        lines.append("# TYPE qspec_http_responses_total counter")
        lines += [f'qspec_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(self.http_counts.items())]
        lines += ["# TYPE qspec_uptime_seconds gauge", f"qspec_uptime_seconds {time.time() - self.started:.1f}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _error_text(out) -> str:
    return repr(out) if isinstance(out, BaseException) else str(out.error)


def finish_reason(out: RequestOutput, assembler: TextAssembler) -> str:
    return "stop" if assembler.stopped else FINISH_REASONS.get(out.finish_reason, out.finish_reason)


def usage(outs: list[RequestOutput], zero_tokens: bool = False) -> dict:
    """Prompt counted once; completion tokens summed over every choice generated (best_of included)."""
    n_out = 0 if zero_tokens else sum(len(o.output_ids) for o in outs)
    n_prompt = outs[0].num_prompt_tokens if outs else 0
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens if outs else 0},
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


def build_parser() -> ArgumentParser:
    import torch

    ap = ArgumentParser(prog="python -m runtime.server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: fp32, or bf16 for a quantized checkpoint"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory budget of the KV block pool")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16; int4 KV: 64)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                    help="KV storage: auto = the model dtype; int8 / fp8_e4m3 per token and head; int4 KIVI-style "
                    "(keys per channel over a block, values per token). Quantized KV is approximate")  # fmt: skip
    ap.add_argument("--decode-kernel", choices=["auto", "triton", "torch"], default="auto",
                    help="decode attention: auto = Triton paged kernel on CUDA, gather + SDPA on CPU")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    ap.add_argument("--policy", choices=["continuous", "static"], default="continuous")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-chunked-prefill", action="store_true")
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="max_tokens when a completions request omits it (chat: the rest of the context)",
    )
    ap.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may send as 'model' (default: the --model spec); others get 404",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("QSPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $QSPEC_API_KEY)",
    )
    ap.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names accepted (e.g. localhost,127.0.0.1); default: any",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_speculator_args(ap)  # --speculator {ngram,draft,medusa,quant-draft,eagle}: speculation in the engine step
    ap.add_argument(
        "--spec-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="with --speculator: speculate only while at most N requests are in the engine, plain batched steps above "
        "(default: always speculate; evals.speculation.bench_engine_spec measures where it stops paying)",
    )
    return ap


def check_args(ap: ArgumentParser, args) -> None:
    """Fill defaults that depend on other flags and reject bad values, before anything loads."""
    if args.block_size is None:
        args.block_size = 64 if args.kv_cache_dtype == "int4" else 16  # int4: one key scale per channel per block
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
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
    if args.spec_max_batch is not None and args.spec_max_batch < 1:
        ap.error("--spec-max-batch must be >= 1")
    check_speculator_args(ap, args)  # an unknown speculator, a broken plug-in or a bad option


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill,
        policy=args.policy,
        max_model_len=args.max_model_len,
        decode_kernel=args.decode_kernel,
        kv_cache_dtype=args.kv_cache_dtype,
        spec_max_batch=args.spec_max_batch,
    )


def build_server(args) -> tuple[Server, LLMEngine]:
    """Load the model (and speculator), build its engine, and wrap both in a Server."""
    model, _, path = load_model(args.model, dtype=cli_dtype(args.dtype), device=args.device)
    tokenizer = load_tokenizer(str(path))
    speculator = speculator_from_args(model, path, args) if args.speculator else None
    engine = LLMEngine(model, tokenizer, engine_config(args), speculator=speculator)
    hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None
    names = args.served_model_name or [args.model]
    server = Server(engine, tokenizer, names[0], names, api_key=args.api_key, allowed_hosts=hosts)
    server.default_max_tokens = args.default_max_tokens
    return server, engine


def banner(args, engine: LLMEngine, names: list[str]) -> str:
    """One line: what is served where, the KV pool, the context and the decode path."""
    model, speculator, bm = engine.model, engine.speculator, engine.block_manager
    return (
        f"[qspec] serving {args.model} as {', '.join(names)} on http://{args.host}:{args.port} "
        f"({dtype_name(model.compute_dtype)}, {args.device}); "
        f"KV pool {bm.num_usable_blocks} blocks x {bm.block_size} tokens = {engine.cache.nbytes() / 2**20:.0f} MiB "
        f"({args.kv_cache_dtype}{', approximate' if args.kv_cache_dtype != 'auto' else ''}), "
        f"max context {engine.scheduler.config.max_model_len}, decode attention {engine.cache.decode_kernel}"
        + (f", speculator {speculator.name} ({speculator.acceptance})" if speculator is not None else "")
        + (", API key required" if args.api_key else "")
    )


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.api_key is not None and not args.api_key.strip():
        ap.error("--api-key (or QSPEC_API_KEY) is empty")
    logging.basicConfig(level=logging.INFO, format="[qspec] %(levelname)s %(name)s: %(message)s")
    server, engine = build_server(args)
    print(banner(args, engine, server.served_names), flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, handler_cancellation=True, print=None)


if __name__ == "__main__":
    run(main)
