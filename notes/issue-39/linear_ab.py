"""The CPU step's linear kernels for C++ builds side by side in one process: per layer kind (qkv_proj, o_proj,
gate_up_proj, down_proj: every layer's weight in turn, as a step streams them) and the bf16 head (as the model calls
it: linear_bf16_values), M rows of random activations, the builds alternated round by round. Prints whether each
build's outputs equal the first's (same bits) and per build and M the median over rounds, ms per pass over the
model's layers of that kind.

    PYTHONPATH=notes/issue-39:. python notes/issue-39/linear_ab.py VERSIONS MODEL COPY MS ROUNDS
    PYTHONPATH=notes/issue-39:. python notes/issue-39/linear_ab.py HEAD~1,HEAD smollm2-135m int4 1,8 9
"""

import statistics
import sys
import time

import torch
from source_ab import arguments, build, switcher

from quantize.fast_copy import load_named_copy
from runtime.kernels import cpu_step
from runtime.provenance import provenance


def handles(use, module, kernel_weights, head):
    """This build's handles (KernelWeight.handle and cpu_step.dense_handle on it): (kind, handle, in_features) per
    quantized layer, then the head's."""
    use(module)  # drops the handles another build made
    out = [(kind, kw.handle(), kw.in_features) for kind, kw in kernel_weights]
    out.append(("head", cpu_step.dense_handle(head), head.shape[1]))
    return out


def main() -> None:
    versions, name, copy, Ms, rounds = arguments()
    modules = [build(v) for v in versions]
    model, _, _ = load_named_copy(name, copy)
    kernel_weights = [
        (n.rsplit(".", 1)[-1], m.cpu_kernel_weight())
        for n, m in model.named_modules()
        if hasattr(m, "cpu_kernel_weight") and m.cpu_kernel_weight() is not None
    ]
    head = model.lm_head.weight.detach().contiguous()
    use = switcher([model])
    per_build = [handles(use, m, kernel_weights, head) for m in modules]
    kinds = list(dict.fromkeys(kind for kind, _, _ in per_build[0]))
    gen = torch.Generator().manual_seed(0)
    xs = {(M, K): torch.randn(M, K, generator=gen) for M in Ms for _, _, K in per_build[0]}
    first, same, times = {}, {}, {}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms each build up and keeps its outputs
            for i, module in enumerate(modules):
                for M in Ms:
                    spent = dict.fromkeys(kinds, 0.0)
                    for j, (kind, h, K) in enumerate(per_build[i]):
                        x = xs[(M, K)]
                        run = module.linear_bf16_values if kind == "head" else module.linear
                        start = time.perf_counter()
                        y = run(h, x)
                        spent[kind] += time.perf_counter() - start
                        if r == 0:
                            first.setdefault((M, j), y)
                            same[(i, M)] = same.get((i, M), True) and torch.equal(first[(M, j)], y)
                    if r:
                        for kind in kinds:
                            times.setdefault((i, M, kind), []).append(spent[kind])
    print(f"{name} {copy}, {rounds} rounds")
    print(provenance(seed=0, command="PYTHONPATH=notes/issue-39:. python " + " ".join(sys.argv)))
    for M in Ms:
        for i, version in enumerate(versions):
            med = {k: statistics.median(times[(i, M, k)]) * 1e3 for k in kinds}
            parts = " ".join(f"{k}={v:.3f}" for k, v in med.items())
            print(f"M={M} {version:>16} (same bits: {same[(i, M)]}): {parts} ms")


if __name__ == "__main__":
    main()
