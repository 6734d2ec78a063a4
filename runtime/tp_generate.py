"""Tensor-parallel generation: ``torchrun --nproc-per-node N -m runtime.tp_generate --prompt "..."``.

Every rank loads the checkpoint's tensors, keeps its slice (runtime.tp) and runs the same batched
``runtime.generate.generate`` loop; o_proj and down_proj outputs are all-reduced, so all ranks see the same
logits and pick the same tokens. Backend: gloo on CPU, NCCL on CUDA (one GPU per rank, cuda:LOCAL_RANK).
Without torchrun it runs as a single rank. On a host without a routable interface set
``GLOO_SOCKET_IFNAME=lo`` and ``--master-addr 127.0.0.1``. Rank 0 prints the outputs (and writes --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import DTYPES, ModelConfig
from runtime.decoding import encode_prompt, generate
from runtime.loader import DEFAULT_MODEL, load_state_dict, load_tokenizer, resolve
from runtime.sampling import SamplingParams
from runtime.tp import TensorParallelError, build_shard


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("a --prompt-ids prompt needs at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m runtime.tp_generate", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name or checkpoint dir (unquantized)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    ap.add_argument("--prompt-ids", action="append", type=parse_ids, default=[], help="prompt as token ids: 1,2,3")
    ap.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=None, help="rank 0 writes the tokens and timings here (JSON)")
    return ap


def rank_device(kind: str) -> torch.device:
    """This rank's device: its LOCAL_RANK GPU (made current), or the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def load_rank(ap, args, world: int, rank: int, device: torch.device):
    """-> (config, this rank's shard, tokenizer or None, prompts as token ids)."""
    path = resolve(args.model) if rank == 0 else None  # a first run converts once, not once per rank
    if world > 1:
        dist.barrier()
    path = path or resolve(args.model)
    hf_config = json.loads((path / "config.json").read_text())
    if "quantization_config" in hf_config:
        ap.error("tensor parallelism shards dense checkpoints; quantized ones are not supported")
    config = ModelConfig.from_hf(hf_config)
    try:
        model = build_shard(config, load_state_dict(path), rank, world, DTYPES[args.dtype], device)
    except TensorParallelError as err:
        ap.error(str(err))
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    if args.prompt and not has_tokenizer:
        ap.error(f"{path} has no tokenizer: give --prompt-ids instead of --prompt")
    tokenizer = load_tokenizer(str(path)) if has_tokenizer else None
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompt] + args.prompt_ids
    return config, model, tokenizer, prompts


def generate_on_rank(args, model, prompts: list[list[int]], world: int):
    """-> (the generation, its wall seconds); every rank must produce the same tokens."""
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
    )
    started = time.perf_counter()
    out = generate(model, prompts, params)
    call_wall_s = time.perf_counter() - started  # outside the loop's own clock: what the tests compare it with
    if world > 1:  # every rank must have produced the same tokens (same logits after each all-reduce)
        gathered = [None] * world
        dist.all_gather_object(gathered, out.tokens)
        if any(g != out.tokens for g in gathered):
            raise RuntimeError("ranks disagree on the generated tokens")
    return out, call_wall_s


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.prompt and not args.prompt_ids:
        ap.error("give at least one --prompt or --prompt-ids")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = rank_device(args.device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        config, model, tokenizer, prompts = load_rank(ap, args, world, rank, device)
        out, call_wall_s = generate_on_rank(args, model, prompts, world)
        if rank == 0:
            report(args, out, tokenizer, world, config, model, call_wall_s)
    finally:
        if world > 1:
            dist.destroy_process_group()


def report(args, out, tokenizer, world: int, config: ModelConfig, model, call_wall_s: float) -> None:
    for i, toks in enumerate(out.tokens):
        text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else toks
        print(f"--- [{i}] {text}")
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"[qspec] TP={world}: TTFT {out.timing.ttft_s * 1e3:.1f} ms, TPOT {out.timing.tpot_s * 1e3:.1f} ms, "
        f"rank-0 weights {local_bytes / 1e6:.1f} MB ({model.config.num_heads}/{config.num_heads} heads, "
        f"{model.config.num_kv_heads}/{config.num_kv_heads} KV heads), {args.dtype}, {args.device}",
        file=sys.stderr,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "world_size": world,
            "tokens": out.tokens,
            "finish_reasons": out.finish_reasons,
            **out.timing.summary(),
            "call_wall_s": call_wall_s,
            "command": " ".join(sys.argv),
        }
        args.out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
