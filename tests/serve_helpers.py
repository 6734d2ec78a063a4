"""Shared by the HTTP server tests: a tiny random checkpoint with the real tokenizer, and the server as a
real subprocess on 127.0.0.1 with one planted fault (a request with seed PLANTED_SEED raises inside its
own logit processing from its third token on), so tests can check that an internal error fails only
the request it belongs to; and one planted hang-up (a request with the header PLANTED_HANGUP: N sees its
client's connection close at its (N+1)-th stream write, the moment that race-prone disconnects hit)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.config import ModelConfig
from runtime.loader import resolve, save_checkpoint
from runtime.model import random_model
from runtime.server import parse_metrics
from tests.tiny_models import tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
PLANTED_SEED = 666013
PLANTED_HANGUP = "X-Planted-Hangup"
MODEL_NAME = "tiny"

LAUNCH = f"""
import sys
import runtime.engine as engine
real = engine.process_logits
def planted(logits, params, prompt_ids, output_ids, stop_ids):
    if params.seed == {PLANTED_SEED} and len(output_ids) >= 2:
        raise RuntimeError("planted fault")
    return real(logits, params, prompt_ids, output_ids, stop_ids)
engine.process_logits = planted
from aiohttp import web
real_write = web.StreamResponse.write
async def hangup_write(self, data):
    request = self._req
    limit = request.headers.get("{PLANTED_HANGUP}") if request is not None else None
    if limit is not None:
        request["planted_writes"] = request.get("planted_writes", 0) + 1
        if request["planted_writes"] > int(limit):
            request.transport.close()  # as if the client had gone: aiohttp's write now raises
    return await real_write(self, data)
web.StreamResponse.write = hangup_write
from runtime.server import main
main(sys.argv[1:])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_checkpoint(directory: Path, max_len: int = 256) -> Path:
    """A 2-layer random model with the real tokenizer's vocabulary, saved as a checkpoint directory."""
    source = resolve("smollm2-135m")
    real = ModelConfig.from_dir(source)
    cfg = tiny_model_config(
        vocab_size=real.vocab_size,
        eos_token_ids=real.eos_token_ids,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    return save_checkpoint(random_model(cfg, seed=3), directory, tokenizer_from=source)


@contextlib.contextmanager
def running_server(checkpoint: Path, *args: str, env: dict | None = None, log_path: Path | None = None):
    """Yields the base URL of `python -m runtime.server` (with the planted faults) on a free port; its log goes
    to log_path when given."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-c", LAUNCH, "--model", str(checkpoint), "--port", str(port), "--served-model-name",
           MODEL_NAME, "--kv-cache-gb", "0.002", "--block-size", "4", "--max-num-batched-tokens", "32",
           *args]  # fmt: skip
    # its log goes to a file: a pipe nobody reads fills up and blocks the server's next log line
    log = tempfile.TemporaryFile(mode="w+") if log_path is None else open(log_path, "w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read()[-5000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def metrics(session, url) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as r:
        return parse_metrics(await r.text())


async def wait_idle(session, url, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.time() + timeout_s
    while True:
        m = await metrics(session, url)
        idle = m["qspec_requests_running"] == 0 and m["qspec_requests_waiting"] == 0
        if idle and m["qspec_kv_blocks_used"] == 0 or time.time() > deadline:
            return m
        await asyncio.sleep(0.1)


async def sse_chunks(resp) -> tuple[list[dict], bool]:
    chunks, done = [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunks.append(json.loads(line[6:]))
    return chunks, done
