"""Tensor parallelism: shards reassemble the model exactly, and greedy output at TP=2 (two gloo processes on
127.0.0.1 launched by torchrun) equals plain single-process decoding token for token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.config import ModelConfig
from runtime.decoding import generate
from runtime.loader import load_model, resolve, save_checkpoint
from runtime.model import random_model
from runtime.sampling import SamplingParams
from runtime.tp import TensorParallelError, plan_shard, shard_config, shard_hf_state_dict, split_range
from tests.tiny_models import tiny_model_config

ROOT = Path(__file__).resolve().parents[1]

EVEN = tiny_model_config(vocab_size=256, eos_token_ids=[], max_position_embeddings=256)
# 3 KV heads over 2 ranks (uneven, like SmolLM2's 9/3), q/k/v biases (Qwen2), tied embeddings
UNEVEN = ModelConfig(
    architecture="qwen2", vocab_size=256, hidden_size=48, intermediate_size=75, num_layers=3, num_heads=6,
    num_kv_heads=3, head_dim=8, attention_bias=True, tie_word_embeddings=True, max_position_embeddings=256,
)  # fmt: skip


def test_split_range_covers_everything_once():
    for n, parts in [(9, 2), (3, 2), (1536, 2), (75, 4), (8, 8)]:
        ranges = [split_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("config,world", [(EVEN, 2), (UNEVEN, 2), (UNEVEN, 3), (EVEN, 4)])
def test_shards_reassemble_the_checkpoint(config, world):
    state = random_model(config, seed=1).hf_state_dict()
    shards = [plan_shard(config, r, world) for r in range(world)]
    parts = [shard_hf_state_dict(state, config, s) for s in shards]
    D = config.head_dim
    for name, full in state.items():
        pieces = [p[name] for p in parts]
        if "q_proj" in name or "gate_proj" in name or "up_proj" in name:
            torch.testing.assert_close(torch.cat(pieces), full, rtol=0, atol=0)
        elif "o_proj" in name or "down_proj" in name:
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=0)
        elif "k_proj" in name or "v_proj" in name:  # each rank keeps the KV heads its query heads read
            for s, p in zip(shards, pieces):
                torch.testing.assert_close(p, full[s.kv_heads[0] * D : s.kv_heads[1] * D], rtol=0, atol=0)
            if config.num_kv_heads >= world:
                torch.testing.assert_close(torch.cat(pieces), full, rtol=0, atol=0)
        else:
            assert all(p is full or torch.equal(p, full) for p in pieces)  # replicated
    for s in shards:  # every query head's KV head is on its rank (GQA groups are never split)
        group = config.num_heads // config.num_kv_heads
        assert all(s.kv_heads[0] <= h // group < s.kv_heads[1] for h in range(*s.q_heads))
        sub = shard_config(config, s)
        q_rows = [p.shape[0] for n, p in parts[s.rank].items() if n.endswith("q_proj.weight")]
        assert q_rows == [sub.num_heads * D] * config.num_layers


def test_unsplittable_models_are_refused():
    with pytest.raises(TensorParallelError, match="cannot split 6 query / 3 KV heads over 4 ranks"):
        plan_shard(UNEVEN, 0, 4)
    with pytest.raises(TensorParallelError, match="rank 2 is not in a world of 2"):
        plan_shard(EVEN, 2, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], out: Path, timeout: int = 300) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    rendezvous = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    cmd = [*launcher, *rendezvous, "-m", "runtime.tp_generate", "--device", "cpu", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def prompts_for(config: ModelConfig, n: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, config.vocab_size, (3 + 4 * i,), generator=gen).tolist() for i in range(n)]


# the uneven split (biases, tied head) by default; the even one under -m slow (~7 s each on AVX2)
@pytest.mark.parametrize(
    "config", [pytest.param(EVEN, marks=pytest.mark.slow), UNEVEN], ids=["even", "uneven-bias-tied"]
)
def test_tp2_greedy_equals_single_process(config, tmp_path):
    ckpt = save_checkpoint(random_model(config, seed=5, std=0.3), tmp_path / "ckpt")
    prompts = prompts_for(config)
    model, _, _ = load_model(str(ckpt))
    expected = generate(model, prompts, SamplingParams(max_tokens=32, ignore_eos=True)).tokens
    assert len({tuple(t) for t in expected}) > 1  # the prompts lead to different outputs
    ids = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    got = torchrun(2, ["--model", str(ckpt), "--max-tokens", "32", "--ignore-eos", *ids], tmp_path / "tp2.json")
    assert got["world_size"] == 2
    assert got["tokens"] == expected
    # the loop's clock (whole steps, all-reduces included) covers the call
    assert abs(got["ttft_s"] + got["decode_s"] - got["call_wall_s"]) <= 0.03 * got["call_wall_s"]


PROMPTS = [
    "The capital of France is",
    "Speculative decoding works by",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.mark.integration
@pytest.mark.slow
def test_tp2_greedy_equals_single_process_default_model(tmp_path):
    """SmolLM2-135M: 9 query / 3 KV heads split 6+3 / 2+1 over two ranks."""
    from runtime.decoding import encode_prompt
    from runtime.loader import load_tokenizer

    path = resolve("smollm2-135m")
    tokenizer = load_tokenizer(str(path))
    model, _, _ = load_model(str(path))
    model.fast_decode = False
    prompts = [encode_prompt(tokenizer, p, chat=False) for p in PROMPTS]
    expected = generate(model, prompts, SamplingParams(max_tokens=32, ignore_eos=True)).tokens
    args = ["--model", str(path), "--max-tokens", "32", "--ignore-eos"]
    got = torchrun(2, args + [a for p in PROMPTS for a in ("--prompt", p)], tmp_path / "tp2.json", timeout=900)
    assert got["tokens"] == expected
