"""Versions of the CPU step's source side by side in one process: c(T) (a T-row step over a 256-token context, logits
included) for each build, the builds alternated round by round so host drift hits them alike (separate processes
on this shared host read the same c(1) 15 % apart). Each version is a git revision (its runtime/kernels/cpu_step.cpp)
or a file; each is compiled once into the cache. Prints the largest logit difference against the first version per
T (0: the same bits), then per version the median and the minimum over rounds of c(T) and c(T)/c(first T).

    PYTHONPATH=. python notes/issue-39/source_ab.py VERSIONS MODEL COPY TS ROUNDS
    PYTHONPATH=. python notes/issue-39/source_ab.py 0e0830b,HEAD smollm2-135m int4 1,8 9
"""

import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from quantize.fast_copy import load_named_copy
from runtime import backends
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata
from runtime.paths import qspec_home
from runtime.provenance import provenance

CONTEXT = 256
STEPS = 3  # steps per timing


def source_text(version: str) -> str:
    path = Path(version)
    if path.is_file():
        return path.read_text()
    return subprocess.run(
        ["git", "show", f"{version}:runtime/kernels/cpu_step.cpp"], check=True, capture_output=True, text=True
    ).stdout


def build(version: str):
    # module-local pybind types: two builds' Weight classes live side by side in one process
    text = source_text(version)
    for cls in ("Weight", "StepModel"):
        text = text.replace(f'(m, "{cls}")', f'(m, "{cls}", py::module_local())')
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = qspec_home() / "extensions" / f"source-ab-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu_step.cpp").write_text(text)
    module = load(
        name=f"source_ab_{key}",
        sources=[str(folder / "cpu_step.cpp")],
        extra_cflags=cpu_step.FLAGS,
        extra_ldflags=cpu_step.LDFLAGS,
        build_directory=str(folder),
    )
    module.set_amx("exact")
    return module


def switcher(models):
    """use(module): make one build the extension every kernel call goes to. Every cached handle (step models, dense
    handles, the models' kernel weights) belongs to one build: drop them all."""
    kernel_weights = [
        m.cpu_kernel_weight() for model in models for m in model.modules() if hasattr(m, "cpu_kernel_weight")
    ]

    def use(module) -> None:
        cpu_step._STATE["module"] = module
        cpu_step._STEP_MODELS.clear()
        backends._DENSE_HANDLES.clear()
        for kw in kernel_weights:
            if kw is not None:
                kw.__dict__.pop("_handle", None)

    return use


def arguments():
    """VERSIONS MODEL COPY COUNTS ROUNDS from the command line (COUNTS: comma-separated row counts), with torch on
    the machine's 2 threads."""
    torch.set_num_threads(2)
    counts = [int(c) for c in sys.argv[4].split(",")]
    return sys.argv[1].split(","), sys.argv[2], sys.argv[3], counts, int(sys.argv[5])


def primed(model, cfg, Ts, context):
    """A cache holding a random `context`-token prompt (run through the model, seed 0) and per T the tokens and
    metadata of a T-token step after it."""
    cache = KVCache(cfg, 1, context + max(Ts) + 16, model.compute_dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 1000, (1, context), generator=gen)
    if context:  # context 0: the step is a prompt's first chunk
        model(prompt, AttentionMetadata.contiguous(1, 0, context, "cpu"), cache)
    steps = {
        T: (torch.randint(2, 1000, (1, T), generator=gen), AttentionMetadata.contiguous(1, context, T, "cpu"))
        for T in Ts
    }
    return cache, steps


def main() -> None:
    versions, name, copy, Ts, rounds = arguments()
    modules = [build(v) for v in versions]
    model, cfg, _ = load_named_copy(name, copy)
    use = switcher([model])

    times = {(i, T): [] for i in range(len(versions)) for T in Ts}
    logits = {}
    with torch.inference_mode():
        use(modules[0])
        cache, steps = primed(model, cfg, Ts, CONTEXT)
        for r in range(rounds + 1):  # round 0 warms each build up and keeps its logits
            for i, module in enumerate(modules):
                use(module)
                for T, (tokens, meta) in steps.items():
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        out = model(tokens, meta, cache)
                    if r:
                        times[(i, T)].append((time.perf_counter() - start) / STEPS)
                    else:
                        logits[(i, T)] = out
    print(f"{name} {copy}, context {CONTEXT}, {rounds} rounds x {STEPS} steps, AMX policy exact")
    print(provenance(seed=0, command="PYTHONPATH=. python " + " ".join(sys.argv)))
    for T in Ts:
        diff = max(float((logits[(0, T)] - logits[(i, T)]).abs().max()) for i in range(len(versions)))
        print(f"T={T}: largest logit difference against {versions[0]}: {diff:.3g}")
    for i, version in enumerate(versions):
        for label, pick in (("median", statistics.median), ("min", min)):
            ms = {T: pick(times[(i, T)]) * 1e3 for T in Ts}
            curve = " ".join(f"c({T})={ms[T]:.2f} ms ({ms[T] / ms[Ts[0]]:.2f})" for T in Ts)
            print(f"{version:>12} {label:>6}: {curve}")


if __name__ == "__main__":
    main()
