"""The CPU step's phases (its own clock: norm, qkv, rope_kv, attn, o, gate_up, act, down) for C++ builds side by side
in one process, alternated round by round as source_ab.py's c(T): per build and T the median over rounds of the
whole step (logits included) and of each phase, ms per step (5 steps a round after one warm-up).

    PYTHONPATH=notes/issue-39:. python notes/issue-39/phase_ab.py VERSIONS MODEL COPY TS ROUNDS [CONTEXT]
    PYTHONPATH=notes/issue-39:. python notes/issue-39/phase_ab.py HEAD~1,HEAD smollm2-135m int4 1,8 9
"""

import statistics
import sys
import time

import torch
from source_ab import arguments, build, primed, switcher

from quantize.fast_copy import load_named_copy
from runtime.provenance import provenance

PHASES = ["norm", "qkv", "rope_kv", "attn", "o", "gate_up", "act", "down"]
STEPS = 5


def main() -> None:
    versions, name, copy, Ts, rounds = arguments()
    context = int(sys.argv[6]) if len(sys.argv) > 6 else 256
    modules = [build(v) for v in versions]
    model, cfg, _ = load_named_copy(name, copy)
    use = switcher([model])
    rows: dict[tuple[int, int], list[list[float]]] = {}
    with torch.inference_mode():
        use(modules[0])
        cache, steps = primed(model, cfg, Ts, context)
        for r in range(rounds + 1):  # round 0 warms each build up
            for i, module in enumerate(modules):
                use(module)
                for T, (tokens, meta) in steps.items():
                    model(tokens, meta, cache)
                    module.profile(True)
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        model(tokens, meta, cache)
                    wall = time.perf_counter() - start
                    phases = module.profile(False)
                    if r:
                        rows.setdefault((i, T), []).append([wall, *phases])
    print(f"{name} {copy}, context {context}, {rounds} rounds x {STEPS} steps")
    print(provenance(seed=0, command="PYTHONPATH=notes/issue-39:. python " + " ".join(sys.argv)))
    for T in Ts:
        for i, version in enumerate(versions):
            med = [statistics.median(col) * 1e3 / STEPS for col in zip(*rows[(i, T)])]
            parts = " ".join(f"{p}={m:.3f}" for p, m in zip(PHASES, med[1:]))
            print(f"T={T} {version:>16}: step={med[0]:.2f} {parts}")


if __name__ == "__main__":
    main()
