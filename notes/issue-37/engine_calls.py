"""The engine's kernel calls by shape: C concurrent HumanEval requests, plain batching then with a draft, each CPU
step / linear call timed and grouped by (kind, rows x hidden), plus the step's phases for the target's 8-row decode
steps and 40-row verifications. Answers "where does a speculative engine step go".

    PYTHONPATH=. python notes/issue-37/engine_calls.py DRAFT C MAX_TOKENS
    PYTHONPATH=. python notes/issue-37/engine_calls.py "w4a8+qwen2.5-coder-0.5b,k=4,vocab=32768" 8 64
"""

import collections
import sys
import time

import torch

import runtime.kernels.cpu_step as cs
from evals.quality.humaneval_eval import draft_speculator
from evals.quality.humaneval_problems import load_problems, prompt_ids
from evals.speculation.bench_engine_spec import run_batch
from runtime.loader import load_model, load_tokenizer
from runtime.sampling import SamplingParams

PHASES = ["norm", "qkv", "rope_kv", "attn", "o", "gate_up", "act", "down"]
calls = collections.defaultdict(lambda: [0, 0.0])
phases = collections.defaultdict(lambda: [0.0] * len(PHASES))
real_extension = cs.extension


class Timed:
    """The extension with its step / linear calls timed (and the target's step phases summed)."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if name not in ("step", "step_quant", "linear"):
            return fn

        def timed(*args, **kwargs):
            x = args[1]
            target = name == "step" and x.shape[1] == HIDDEN and x.shape[0] in (8, 40)
            if target:
                self.module.profile(True)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            calls[(name, tuple(x.shape))][0] += 1
            calls[(name, tuple(x.shape))][1] += time.perf_counter() - start
            if target:
                for i, s in enumerate(self.module.profile(False)):
                    phases[x.shape[0]][i] += s
            return out

        return timed


cs.extension = lambda: None if real_extension() is None else Timed(real_extension())
draft, concurrency, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, _, path = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
HIDDEN = model.config.hidden_size
tokenizer = load_tokenizer(path)
prompts = [prompt_ids(tokenizer, p, "raw") for p in load_problems()[:concurrency]]
speculator = draft_speculator(model, draft, path)
run_batch(model, tokenizer, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), speculator)  # warm-up
for mode in ("plain", "draft"):
    calls.clear()
    phases.clear()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, seconds, engine = run_batch(model, tokenizer, prompts, params, speculator if mode == "draft" else None)
    print(f"{mode}: {seconds:.2f} s, {sum(map(len, tokens)) / seconds:.1f} tok/s, {engine.num_steps} engine steps")
    for (kind, shape), (n, s) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind} {shape}: {n} calls, {s:.2f} s, {1e3 * s / n:.1f} ms a call")
    for rows, sums in phases.items():
        n = calls[("step", (rows, HIDDEN))][0]
        print(f"  phases of the {rows}-row target steps (ms a call): "
              + " ".join(f"{p}={1e3 * s / max(n, 1):.1f}" for p, s in zip(PHASES, sums)))  # fmt: skip
