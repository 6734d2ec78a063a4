"""Plain decode step of the 1.5B (bf16) in the cost curve's setting (a random 256-token context, 24 steps) against
longer runs and HumanEval prompts, rounds interleaved in one process: ms per step, each round printed.

    PYTHONPATH=. python notes/issue-37/step_ctx.py
"""

import statistics

import torch

from evals.speculation.specbench_suite import humaneval_prompts, plain_decode
from runtime.loader import load_model, load_tokenizer
from runtime.sampling import SamplingParams

torch.set_num_threads(2)
model, cfg, path = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
tok = load_tokenizer(str(path))
he = [ids for _, ids in humaneval_prompts(tok, 4)]
rand = torch.randint(2, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0)).tolist()
cases = {
    "random256 x24": (rand, SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)),
    "humaneval x24": (he[:1], SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)),
    "humaneval x256 eos": (he[:1], SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=False)),
    "random256 x96": (rand, SamplingParams(temperature=0.0, max_tokens=97, ignore_eos=True)),
    "random256 x256": (rand, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)),
}
res = {k: [] for k in cases}
for _ in range(4):
    for k, (rows, p) in cases.items():
        out, dec = plain_decode(model, rows, p)
        res[k].append(dec / max(len(out.timing.step_times_s), 1))
for k, v in res.items():
    print(
        f"{k:20s} {statistics.median(v[1:]) * 1e3:6.1f} ms/step  (rounds {[round(x * 1e3, 1) for x in v]})", flush=True
    )
