"""Paged decode attention on CUDA: the Triton paged kernel vs gather + SDPA, op by op and through the engine.

The two paths are the ones ``PagedKVCache.attend`` chooses between for a decode step. One command on a GPU
machine checks that they agree and times them:

    python -m evals.speed.bench_paged_decode --out notes/results/bench_paged_decode.json

1. Op level: random pools at model attention shapes, ragged context lengths (each row in [ctx/2, ctx]),
   fp32/fp16/bf16. Agreement: max |error| of each path against an fp32 reference; the kernel must stay
   within a per-dtype tolerance. Timing: CUDA-event median of the kernel vs gather_blocks + SDPA (the
   k/v write is the same in both and left out).
2. Engine level: a model (``--model``; default: random weights with SmolLM2-135M's shape, so nothing is
   downloaded) decodes the same greedy batch with decode_kernel="torch" and "triton". Checks: the kernel
   was launched once per layer per decode step, and fp32 greedy tokens agree (token match rate); reports
   decode tokens/s of both.

Exit status 1 when a check fails. --smoke: tiny shapes and no timing; also runs on CPU under
TRITON_INTERPRET=1 (tests/test_serve_paged_decode.py does that, so the script cannot rot unnoticed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from evals.speed.paged_decode_ops import DTYPES, SHAPES, OpCase, op_case
from runtime.cliutil import ArgumentParser, run
from runtime.config import ModelConfig
from runtime.engine import EngineConfig, LLMEngine
from runtime.loader import check_model_arg, load_model
from runtime.model import random_model
from runtime.provenance import provenance
from runtime.sampling import SamplingParams

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, eos_token_ids=[2],
)  # fmt: skip
TINY = ModelConfig(
    architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=[1],
)  # fmt: skip


def engine_run(model, prompts, max_tokens: int, mode: str, block_size: int) -> dict:
    config = EngineConfig(
        block_size=block_size, kv_cache_bytes=1 << 30, max_num_seqs=len(prompts), decode_kernel=mode,
        max_num_batched_tokens=max(512, sum(map(len, prompts))),
    )  # fmt: skip
    engine = LLMEngine(model, config=config)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, params)  # step 1 prefills every prompt; the rest are decode-only steps
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    ids = [engine.add_request(p, params) for p in prompts]
    sync()
    engine.step()  # prefill, not timed
    sync()
    start, steps, launches = time.perf_counter(), 0, engine.cache.kernel_launches
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    sync()
    elapsed = time.perf_counter() - start
    return {
        "tokens": [final[i].output_ids for i in ids],
        "decode_steps": steps,
        "kernel_launches": engine.cache.kernel_launches - launches,
        "decode_tok_s": steps * len(prompts) / elapsed,
        "resolved": engine.cache.decode_kernel,
    }


def match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens inside each row's common prefix (everything after a first divergence counts
    as mismatched, since the rows then continue from different text)."""
    agree = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        agree += n
    return agree / sum(len(x) for x in a)


def engine_check(args, device: torch.device) -> list[dict]:
    if args.model:
        base, cfg, _ = load_model(args.model, dtype=torch.float32, device=device)
    else:
        cfg = TINY if args.smoke else SMOLLM2_135M
        base = random_model(cfg, seed=args.seed).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = (3, 20) if args.smoke else (64, 512)
    prompts = [
        torch.randint(3, cfg.vocab_size, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(args.engine_batch)
    ]
    rows = []
    for dtype in args.engine_dtypes:
        model = base.set_dtype(DTYPES[dtype])
        t, k = (engine_run(model, prompts, args.max_tokens, mode, args.block_size) for mode in ("torch", "triton"))
        row = {
            "dtype": dtype,
            "resolved": [t["resolved"], k["resolved"]],
            "kernel_launches": k["kernel_launches"],
            "expected_launches": cfg.num_layers * k["decode_steps"],
            "token_match_rate": match_rate(k["tokens"], t["tokens"]),
            "decode_tok_s_torch": t["decode_tok_s"] if device.type == "cuda" else None,
            "decode_tok_s_triton": k["decode_tok_s"] if device.type == "cuda" else None,
        }
        row["ok"] = (
            t["kernel_launches"] == 0
            and row["kernel_launches"] == row["expected_launches"] > 0
            and (dtype != "fp32" or row["token_match_rate"] >= args.min_fp32_match)
        )
        rows.append(row)
        print(
            f"engine {dtype}: launches {row['kernel_launches']}/{row['expected_launches']}, token match "
            f"{row['token_match_rate']:.4f}, decode tok/s torch {row['decode_tok_s_torch']} triton "
            f"{row['decode_tok_s_triton']} -> {'ok' if row['ok'] else 'FAIL'}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m evals.speed.bench_paged_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU: needs TRITON_INTERPRET=1)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16", "fp32"])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2-135m", "llama-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50, help="timed repetitions per op case")
    ap.add_argument("--model", default=None, help="model spec for the engine check (default: random SmolLM2 shape)")
    ap.add_argument("--engine-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--engine-batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-fp32-match", type=float, default=0.99, help="fp32 greedy token match rate bar")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON record path")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    device = torch.device(args.device)
    if args.smoke:
        args.shapes, args.batches, args.contexts, args.block_size = ["tiny"], [3], [21], 4
        args.engine_batch, args.max_tokens, args.engine_dtypes = 3, 4, ["fp32"]
    elif device.type != "cuda":
        ap.error("the full run needs CUDA (use --smoke on CPU under TRITON_INTERPRET=1)")

    ops = []
    for shape in args.shapes:
        for dtype in args.dtypes:
            for batch in args.batches:
                for ctx in args.contexts:
                    row = op_case(OpCase(shape, dtype, batch, ctx), args.block_size, device, args.iters, args.seed)
                    ops.append(row)
                    timing = (
                        f"kernel {row['ms_kernel']:.3f} ms vs gather+SDPA {row['ms_gather_sdpa']:.3f} ms "
                        f"({row['speedup']:.2f}x, {row['kernel_gb_s']:.0f} GB/s)"
                        if row["ms_kernel"]
                        else "untimed"
                    )
                    print(
                        f"op {shape:<12} {dtype} B={batch:<4} ctx={ctx:<5} err kernel {row['err_kernel']:.1e} "
                        f"sdpa {row['err_gather_sdpa']:.1e}  {timing}  {'ok' if row['ok'] else 'FAIL'}",
                        flush=True,
                    )
    engine = engine_check(args, device)
    ok = all(r["ok"] for r in ops + engine)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        record = {**provenance(args.seed), "config": config, "ops": ops, "engine": engine, "ok": ok}
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    if not ok:
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
