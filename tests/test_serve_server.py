"""The HTTP server as a real subprocess on 127.0.0.1, with a tiny random model that uses the default
model's tokenizer: OpenAI response shapes, streaming, 4xx validation, and a bounded fuzz of malformed
requests and client disconnects with correct answers in between and no leaked KV blocks afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

aiohttp = pytest.importorskip("aiohttp")

from runtime.decoding import generate  # noqa: E402
from runtime.loader import load_model, load_tokenizer  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from tests.serve_helpers import running_server, wait_idle  # noqa: E402
from tests.serve_helpers import sse_chunks as sse_texts  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint) as url:
        yield url


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    model, _, _ = load_model(str(tiny_checkpoint))
    tokenizer = load_tokenizer(str(tiny_checkpoint))

    def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
        toks = generate(model, [prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True)).tokens[0]
        return tokenizer.decode(toks, skip_special_tokens=True)

    return expected_text, tokenizer


def test_completions_chat_streaming_and_usage(server, oracle):
    expected_text, tokenizer = oracle

    async def run():
        async with aiohttp.ClientSession() as s:
            prompt = tokenizer("The history of Rome", add_special_tokens=False).input_ids
            body = {"model": "tiny", "prompt": "The history of Rome", "max_tokens": 7, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            async with s.post(f"{server}/v1/completions", json=body) as r:
                assert r.status == 200
                data = await r.json()
            assert data["object"] == "text_completion"
            assert data["choices"][0]["text"] == expected_text(prompt, 7)
            assert data["choices"][0]["finish_reason"] == "length"
            assert data["usage"]["prompt_tokens"] == len(prompt) and data["usage"]["completion_tokens"] == 7
            assert data["usage"]["total_tokens"] == len(prompt) + 7

            body.update(stream=True, stream_options={"include_usage": True})
            async with s.post(f"{server}/v1/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                chunks, done = await sse_texts(r)
            assert done and chunks[-1]["usage"]["completion_tokens"] == 7
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected_text(prompt, 7)

            messages = [{"role": "user", "content": "Name a color."}]
            chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
            chat = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
            async with s.post(f"{server}/v1/chat/completions", json=chat) as r:
                chunks, done = await sse_texts(r)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert done and text == expected_text(chat_ids, 5)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            async with s.get(f"{server}/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"

    asyncio.run(run())


BAD_REQUESTS = [
    (b"{not json", "malformed JSON"),
    (b"[1, 2, 3]", "JSON object"),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), "temperature"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": "hi", "top_p": 1.5}).encode(), "top_p"),
    (json.dumps({"prompt": "hi", "top_k": -3}).encode(), "top_k"),
    (json.dumps({"prompt": "hi", "seed": "abc"}).encode(), "seed"),
    (json.dumps({"prompt": "hi", "stop": 5}).encode(), "stop"),
    (json.dumps({"prompt": "hi", "n": 0}).encode(), "'n'"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"prompt": 42}).encode(), "prompt"),
    (json.dumps({"prompt": ""}).encode(), "empty"),
    (json.dumps({"prompt": [1, -5]}).encode(), "token ids"),
    (json.dumps({"prompt": [10**9]}).encode(), "token ids"),
    (json.dumps({"prompt": ["a", "b"]}).encode(), "batched"),
    (json.dumps({"prompt": "word " * 400, "max_tokens": 4}).encode(), "maximum context length"),
    (json.dumps({"prompt": "hi", "max_tokens": 10**6}).encode(), "maximum context length"),
    (json.dumps({"model": 7, "prompt": "hi"}).encode(), "model"),
]
BAD_CHAT = [
    (json.dumps({"messages": "hello"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
]


def test_server_latency_metrics_match_what_the_client_sees(server):
    """The engine's clock, reported in /metrics, covers the request: its TTFT is no later than the client's first
    chunk, TTFT + TPOT * (n - 1) is its end-to-end time, and that lies within the client's wall time."""

    async def run():
        async with aiohttp.ClientSession() as s:
            before = await wait_idle(s, server)
            body = {"model": "tiny", "prompt": "The history of Rome", "max_tokens": 96, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            sent = time.perf_counter()
            first = None
            async with s.post(f"{server}/v1/completions", json=body) as r:
                assert r.status == 200
                async for raw in r.content:
                    if first is None and raw.startswith(b"data: {"):
                        first = time.perf_counter() - sent
            client_wall = time.perf_counter() - sent
            after = await wait_idle(s, server)
        delta = {n: after[f"qspec_request_{n}_seconds_sum"] - before[f"qspec_request_{n}_seconds_sum"]
                 for n in ("ttft", "tpot", "e2e")}  # fmt: skip
        assert after["qspec_request_e2e_seconds_count"] - before["qspec_request_e2e_seconds_count"] == 1
        assert 0 < delta["ttft"] <= first
        assert delta["ttft"] + 95 * delta["tpot"] == pytest.approx(delta["e2e"], rel=0.03)
        assert 0.5 * client_wall <= delta["e2e"] <= client_wall

    asyncio.run(run())


def test_bad_requests_get_400_with_a_message(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            for path, cases in (("/v1/completions", BAD_REQUESTS), ("/v1/chat/completions", BAD_CHAT)):
                for body, needle in cases:
                    async with s.post(server + path, data=body, headers={"Content-Type": "application/json"}) as r:
                        data = await r.json()
                        assert r.status == 400, (body, data)
                        assert needle in data["error"]["message"], (body, data)
            async with s.get(f"{server}/v1/nothing") as r:
                assert r.status == 404

    asyncio.run(run())


def test_bounded_fuzz_of_malformed_requests_and_disconnects(server, oracle):
    """Random interleaving (fixed seed) of bad bodies, mid-stream disconnects, abandoned non-streaming
    requests and well-formed requests whose answers must be right; afterwards no KV block is in use."""
    expected_text, tokenizer = oracle
    rng = random.Random(1234)
    prompts = [torch.randint(3, 1000, (rng.randrange(2, 40),), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(6)]  # fmt: skip
    expected = {i: expected_text(p, 6) for i, p in enumerate(prompts)}
    stats = {"bad": 0, "stream_dropped": 0, "abandoned": 0, "good": 0}

    async def good(s, i):
        body = {"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        async with s.post(f"{server}/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == expected[i]
        stats["good"] += 1

    async def bad(s):
        body, _ = rng.choice(BAD_REQUESTS)
        async with s.post(f"{server}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        stats["bad"] += 1

    async def drop_stream(s):
        body = {"prompt": prompts[rng.randrange(6)], "max_tokens": 200, "stream": True, "ignore_eos": True}
        resp = await s.post(f"{server}/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            if raw.startswith(b"data: "):
                break
        resp.close()  # hang up mid-stream
        stats["stream_dropped"] += 1

    async def abandon(s):
        body = {"prompt": prompts[rng.randrange(6)], "max_tokens": 200, "ignore_eos": True}
        try:
            await asyncio.wait_for(s.post(f"{server}/v1/completions", json=body), timeout=0.05)
        except asyncio.TimeoutError:
            pass
        stats["abandoned"] += 1

    async def run():
        async with aiohttp.ClientSession() as s:
            for _round in range(8):
                tasks = []
                for _ in range(6):
                    kind = rng.random()
                    if kind < 0.35:
                        tasks.append(bad(s))
                    elif kind < 0.55:
                        tasks.append(drop_stream(s))
                    elif kind < 0.7:
                        tasks.append(abandon(s))
                    else:
                        tasks.append(good(s, rng.randrange(6)))
                await asyncio.gather(*tasks)
            await good(s, 0)
            m = await wait_idle(s, server)
            assert m["qspec_kv_blocks_used"] == 0, m
            assert m["qspec_requests_running"] == 0 and m["qspec_requests_waiting"] == 0, m
            # the hang-ups went through the abort path (not just ran to completion)
            assert m["qspec_requests_aborted_total"] >= stats["stream_dropped"], (m, stats)
            async with s.get(f"{server}/health") as r:
                assert r.status == 200

    asyncio.run(run())
    assert min(stats.values()) > 0, stats


def test_loadgen_cli_against_the_server(server, tiny_checkpoint, tmp_path, capsys):
    from evals.serving import loadgen

    out = tmp_path / "load.json"
    loadgen.main(["--url", server, "--model", str(tiny_checkpoint), "--num-requests", "6", "--arrival", "poisson",
                  "--rate", "50", "--max-prompt-tokens", "32", "--min-output-tokens", "3", "--max-output-tokens", "9",
                  "--slo-ttft-ms", "60000", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert all(3 <= r["output_tokens"] <= 9 for r in record["requests"])  # lengths enforced with ignore_eos
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in record["requests"])
    assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"] and summary["goodput"] > 0
    for key in ("git_sha", "versions", "device", "command", "seed", "config"):
        assert key in record
