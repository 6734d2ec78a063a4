"""Decode speed at batch 1, wall clock: qspec's formats against HF ``generate`` and llama.cpp, in one run.

    python -m evals.bench_decode                                   # fp32, bf16, int8, int4 vs HF (+ llama.cpp)
    python -m evals.bench_decode --rows qspec:bf16,hf:bf16 --repeats 5 --out notes/results/bench_decode.json

Every runner is timed the same way, from outside: a whole call that generates 1 token (its wall time is the
TTFT) and a whole call that generates N; TPOT = (wall(N) - wall(1)) / (N - 1), decode tok/s = 1 / TPOT. Runners
alternate (A, B, C, A, B, C, ...) for ``--repeats`` rounds so load on a shared machine hits all alike, and each
figure is the median. For qspec's rows the loop's own clock (runtime.timing: whole steps) is printed beside
the external one as a check, and one profiled call splits a step into forward, lm_head and sampling. The
roofline share compares the weight bytes read per decoded token with a streaming bandwidth measured here.

Rows: ``qspec:fp32``, ``qspec:bf16`` (bf16 layers and head, fp32 residual stream), ``qspec:bf16-fp32head``,
``qspec:int8`` (per-channel), ``qspec:int4`` (group 64, asymmetric), ``qspec:int4-int8head`` (the tied head
int8 per-channel), ``qspec:fp8`` (e4m3 weight-only, per-channel scales), ``hf:fp32``, ``hf:bf16``,
``llama.cpp`` (llama-cpp-python on the GGUF the default model ships as, an optional peer: skipped with a note
when it is not installed). Quantized rows use round-to-nearest codes (speed does not depend on how codes are
chosen) with bf16 activations.

A qspec row takes options after its variant, ``:key=value`` each: ``kv=`` the KV cache format (auto, int8,
fp8_e4m3, int4; runtime.kv_quant) and ``ctx=`` a context length in tokens (``8k`` = 8000). A ctx= row measures
decoding at that context: its prompt's K/V are computed once (full precision, then stored in the row's format) and
every call decodes greedily from a copy of that cache, one model forward per token, so a call costs decode steps
only (prefilling 8k tokens into a quantized cache, chunk by chunk in Python, takes minutes here and would drown
the steps in noise). Ratios between ctx= rows are like for like; the ``x kv=auto`` column compares each kv= row
with its own variant and context at full precision. One run compares KV formats at two contexts, interleaved:

    python -m evals.bench_decode --reference qspec:bf16:ctx=256 --rows \
        qspec:bf16:ctx=256,qspec:bf16:kv=int8:ctx=256,qspec:bf16:kv=fp8_e4m3:ctx=256,qspec:bf16:kv=int4:ctx=256,\
qspec:bf16:ctx=8k,qspec:bf16:kv=int8:ctx=8k,qspec:bf16:kv=fp8_e4m3:ctx=8k,qspec:bf16:kv=int4:ctx=8k
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.config import QuantConfig
from quantize.fplinear import FPLinear, quantize_fp8
from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import QuantLinear, set_module
from quantize.rtn_weight import quantize_weight
from runtime.cliutil import ArgumentParser, UsageError, interrupted, run
from runtime.data import wiki_split
from runtime.decoding import generate
from runtime.kv_cache import KVCache
from runtime.kv_policy import KVCacheSpec
from runtime.kv_quant import KV_DTYPES
from runtime.loader import DEFAULT_MODEL, check_model_arg, gguf_source, load_model, load_tokenizer
from runtime.model import AttentionMetadata, decode_meta
from runtime.provenance import provenance
from runtime.sampling import SamplingParams

QSPEC_ROWS = ("fp32", "bf16", "bf16-fp32head", "int8", "int4", "int4-int8head", "fp8")
DEFAULT_ROWS = "qspec:fp32,hf:fp32,qspec:bf16,hf:bf16,qspec:int8,qspec:int4,llama.cpp"


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Streaming read bandwidth in bytes/s over a buffer far larger than cache: the best of a few passes of
    two readers, a sum and an fp32 matrix-vector product (the GEMV is what decode runs, and on some
    machines it streams faster than the reduction)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    matrix, vector = buf.view(-1, 1024), torch.ones(1024)
    best = float("inf")
    for _ in range(repeats):
        for read in (buf.sum, lambda: torch.mv(matrix, vector)):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decoded token: every parameter and buffer once, but not the embedding table's
    own (one row of it is read), while a tied head's table counts, as the matmul that reads it."""
    embed, head = model.get_submodule("embed_tokens"), model.get_submodule("lm_head")
    head_ids = {id(t) for t in list(head.parameters()) + list(head.buffers())}
    skip = {id(t) for t in list(embed.parameters()) + list(embed.buffers())} - head_ids
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or id(t) in skip or name.endswith("inv_freq"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def hf_decode_weight_bytes(hf_model) -> int:
    inner = hf_model.model
    total = sum(p.numel() * p.element_size() for n, p in inner.named_parameters() if not n.startswith("embed_tokens"))
    return total + hf_model.lm_head.weight.numel() * hf_model.lm_head.weight.element_size()


def qspec_model(base, variant: str):
    """The fp32 base model in a row's form: dense fp32 / bf16, or RTN codes on every decoder linear (and the
    tied head for -int8head) with bf16 activations and each layer on its automatic (fast) path."""
    if variant == "fp32":
        return base
    if variant == "bf16-fp32head":
        return copy.deepcopy(base).set_dtype(torch.bfloat16, head_dtype=torch.float32)
    model = copy.deepcopy(base).set_dtype(torch.bfloat16)
    if variant == "bf16":
        return model
    if variant == "fp8":
        for name in QuantConfig(bits=8, group_size=-1).targets(model):
            fw = quantize_fp8(base.get_submodule(name).weight)
            set_module(model, name, FPLinear(fw, compute_dtype=torch.bfloat16))
        return model
    bits, group = (8, -1) if variant == "int8" else (4, 64)
    cfg = QuantConfig(bits=bits, group_size=group, sym=bits == 8)
    head = variant.endswith("int8head")
    names = cfg.targets(model) + (["lm_head"] if head else [])
    for name in names:
        layer_cfg = QuantConfig(bits=8, group_size=-1, sym=True) if name == "lm_head" else cfg
        weight = base.get_submodule(name).weight  # codes from the fp32 weights
        layer = QuantLinear(quantize_weight(weight, layer_cfg, None, False, name), compute_dtype=torch.bfloat16)
        set_module(model, name, layer)
    if head:
        tie_quantized_embedding(model)
    return model


@dataclass
class Runner:
    """One row: call(n) generates n tokens from the prompt in a whole call and returns the loop's own timing
    (runtime.timing.LoopTiming) where it has one."""

    name: str
    call: Callable[[int], object]
    weight_bytes: int
    profile: Callable[[int], dict] | None = None  # qspec: seconds per phase of one call
    prompt_tokens: int = 0
    walls: dict[int, list[float]] = field(default_factory=lambda: {})
    own_tpot: list[float] = field(default_factory=list)


def qspec_runner(name: str, model, prompt: list[int], kv: KVCacheSpec | None = None) -> Runner:
    def call(n: int):
        return generate(model, [prompt], SamplingParams(max_tokens=n, ignore_eos=True), kv_cache=kv).timing

    def profile(n: int) -> dict:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        timing = generate(model, [prompt], params, profile=True, kv_cache=kv).timing
        return {k: v / timing.wall_s for k, v in timing.phase_s.items()}

    return Runner(name, call, decode_weight_bytes(model), profile, prompt_tokens=len(prompt))


def full_prefill(model, prompt: list[int]) -> tuple[KVCache, int]:
    """The prompt's K/V in a full-precision batch-1 cache, and the greedy first token."""
    n = len(prompt)
    full = KVCache(model.config, 1, n, model.compute_dtype)
    with torch.no_grad():  # not inference tensors: the runners copy what is built from them
        hidden = model(torch.tensor([prompt]), AttentionMetadata.contiguous(1, 0, n, "cpu"), full, hidden_only=True)
        return full, int(model.logits(hidden[:, -1:]).argmax(-1))


def stored_cache(model, full: KVCache, kv: KVCacheSpec, capacity: int):
    """A batch-1 cache of kv's format holding full's K/V (int4: its groups sealed as a prefill write seals them)."""
    n = full.max_seq_len
    cache = kv.build(model, 1, capacity)
    if kv.dtype == "auto":
        cache.k[:, :, :, :n], cache.v[:, :, :, :n] = full.k, full.v
        return cache
    slots = torch.arange(n)[None] + cache.row_base[:1]
    with torch.no_grad():
        for layer in range(model.config.num_layers):
            cache.pool.write(layer, full.k[layer], full.v[layer], slots, cache.tables[:1], [n])
    return cache


def context_runner(name: str, model, prompt: list[int], kv: KVCacheSpec, max_new: int, prefill) -> Runner:
    """A ctx= row: call(n) decodes n tokens greedily from a copy of the prefilled cache (module docstring).
    prefill: full_prefill's result for this model and prompt (shared by the rows of other KV formats)."""
    full, first = prefill
    base = stored_cache(model, full, kv, len(prompt) + max_new + 8)

    @torch.inference_mode()
    def call(n: int):
        cache, token = copy.deepcopy(base), first
        for pos in range(len(prompt), len(prompt) + n):
            logits = model(torch.tensor([[token]]), decode_meta(torch.tensor([pos])), cache)
            token = int(logits[0, -1].argmax())

    return Runner(name, call, decode_weight_bytes(model), prompt_tokens=len(prompt))


def hf_runner(name: str, hf_model, prompt: list[int]) -> Runner:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)

    @torch.inference_mode()
    def call(n: int):
        hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    return Runner(name, call, hf_decode_weight_bytes(hf_model), prompt_tokens=len(prompt))


LLAMA_CPP_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_batch=64, verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4], top_k=1, top_p=1.0, temp=0.0, reset=True)):
    if i >= 2:
        break
"""


def llama_cpp_runner(gguf: Path, prompt: list[int], threads: int) -> Runner | str:
    """llama.cpp through llama-cpp-python (an optional peer, never a dependency), or why it cannot run."""
    try:
        from llama_cpp import Llama
    except ImportError as err:  # not installed, or installed without one of its own dependencies
        return f"llama-cpp-python does not import ({err}; pip install llama-cpp-python)"
    # a few tokens in a child process first: a llama.cpp build that crashes on this CPU (seen: its AMX Q4_1 path)
    # is reported and skipped instead of taking the whole benchmark down
    probe = subprocess.run(
        [sys.executable, "-c", LLAMA_CPP_PROBE, str(gguf), str(threads)], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        why = f"signal {-probe.returncode}" if probe.returncode < 0 else probe.stderr.strip().splitlines()[-1:]
        return f"llama.cpp failed a 3-token probe on this machine ({why}); rebuild llama-cpp-python for this CPU"
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)  # fmt: skip

    def call(n: int):
        llm.reset()  # no prefix reuse between calls: each call prefills the prompt, as the other runners do
        for i, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True)):
            if i + 1 >= n:
                break

    return Runner(f"llama.cpp {gguf.stem.rsplit('.', 1)[-1]}", call, gguf.stat().st_size, prompt_tokens=len(prompt))


def time_round(runners: list[Runner], new_tokens: int) -> None:
    """One interleaved round: every runner's 1-token call, then every runner's N-token call."""
    for n in (1, new_tokens):
        for r in runners:
            t = time.perf_counter()
            own = r.call(n)
            r.walls.setdefault(n, []).append(time.perf_counter() - t)
            if n > 1 and own is not None:
                r.own_tpot.append(own.tpot_s)


def summarize(r: Runner, new_tokens: int, bandwidth: float) -> dict:
    ttft = statistics.median(r.walls[1])
    wall_n = statistics.median(r.walls[new_tokens])
    tpot = max(wall_n - ttft, 1e-9) / (new_tokens - 1)
    roofline_tpot = r.weight_bytes / bandwidth
    out = {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tok_per_s": 1 / tpot,
        "end_to_end_tok_per_s": new_tokens / wall_n,
        "weight_bytes_per_token": r.weight_bytes,
        "roofline_tok_per_s": 1 / roofline_tpot,
        "roofline_share": roofline_tpot / tpot,
        "walls_s": r.walls,
        "prompt_tokens": r.prompt_tokens,
    }
    if r.own_tpot:  # the loop's own clock against the external one: they must agree (whole steps)
        out["own_clock_tpot_ms"] = statistics.median(r.own_tpot) * 1e3
        out["own_over_external"] = out["own_clock_tpot_ms"] / out["tpot_ms"]
    return out


ROW_OPTIONS = ("kv", "ctx")


def parse_rows(spec: str) -> list[str]:
    rows = [r.strip() for r in spec.split(",") if r.strip()]
    for r in rows:
        kind, _, rest = r.partition(":")
        variant, *options = rest.split(":")
        ok = (kind == "qspec" and variant in QSPEC_ROWS) or (
            kind == "hf" and variant in ("fp32", "bf16") and not options
        )
        if not ok and r != "llama.cpp":
            raise UsageError(
                f"unknown row {r!r}: qspec:{{{','.join(QSPEC_ROWS)}}}[:kv=..][:ctx=..], hf:{{fp32,bf16}} or llama.cpp"
            )
        if kind == "qspec":
            row_options(r, options)
    return rows


def row_options(row: str, options: list[str]) -> dict:
    """A qspec row's ``key=value`` options -> {"kv": KV format, "ctx": prompt tokens or None}."""
    out = {"kv": "auto", "ctx": None}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ROW_OPTIONS or not value:
            raise UsageError(f"row {row!r}: options are {', '.join(k + '=' for k in ROW_OPTIONS)}, got {option!r}")
        if key == "kv" and value not in KV_DTYPES:
            raise UsageError(f"row {row!r}: kv= takes one of {', '.join(KV_DTYPES)}, got {value!r}")
        if key == "ctx":
            value = value.lower().replace("k", "000")
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"row {row!r}: ctx= takes a token count (e.g. 256, 8k), got {option!r}")
            value = int(value)
        out[key] = value
    return out


def row_prompt_tokens(rows: list[str], default: int) -> int:
    """The longest prompt any row asks for."""
    lengths = [default]
    for r in rows:
        kind, _, rest = r.partition(":")
        if kind == "qspec":
            lengths.append(row_options(r, rest.split(":")[1:])["ctx"] or default)
    return max(lengths)


def build_runners(
    rows: list[str], model_spec: str, prompt: list[int], threads: int, prompt_tokens: int | None = None, max_new=0
) -> tuple[list[Runner], dict]:
    """One runner per row over the first prompt_tokens of `prompt` (default: all), or a qspec row's ctx= tokens."""
    from transformers import AutoModelForCausalLM

    base, _, path = load_model(model_spec)
    runners, skipped, variants, prefills = [], {}, {}, {}
    default_prompt = prompt[:prompt_tokens]
    for row in rows:
        kind, _, rest = row.partition(":")
        variant, *options = rest.split(":")
        print(f"[bench_decode] building {row}", file=sys.stderr, flush=True)
        if kind == "qspec":
            opts = row_options(row, options)
            if variant not in variants:  # rows of one variant share its model (the KV cache is per call)
                variants[variant] = qspec_model(base, variant)
            kv = KVCacheSpec(dtype=opts["kv"])
            if opts["ctx"]:
                key = (variant, opts["ctx"])
                if key not in prefills:
                    prefills[key] = full_prefill(variants[variant], prompt[: opts["ctx"]])
                model, row_prompt = variants[variant], prompt[: opts["ctx"]]
                runners.append(context_runner(row, model, row_prompt, kv, max_new, prefills[key]))
            else:
                runners.append(qspec_runner(row, variants[variant], default_prompt, kv))
        elif kind == "hf":
            dtype = torch.float32 if variant == "fp32" else torch.bfloat16
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            runners.append(hf_runner(row, hf, default_prompt))
        else:
            gguf = gguf_source(model_spec)
            made = (
                llama_cpp_runner(gguf, default_prompt, threads) if gguf is not None else "the model has no GGUF source"
            )
            if isinstance(made, str):
                skipped[row] = made
                print(f"[bench_decode] skipping {row}: {made}", file=sys.stderr)
            else:
                runners.append(made)
    return runners, skipped


def full_precision_row(name: str) -> str:
    """The row a kv= row compares with: the same variant and context, full-precision KV."""
    return ":".join(part for part in name.split(":") if not part.startswith("kv="))


def table(results: dict, reference: str | None) -> list[str]:
    lines = [
        "| row | prompt | TTFT ms | TPOT ms | decode tok/s | x "
        + (reference or "-")
        + " | x kv=auto | own clock / wall | "
        "weight MB/token | roofline share | lm_head / sampling share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = results.get(reference, {}).get("decode_tok_per_s") if reference else None
    for name, r in results.items():
        shares = r.get("time_shares")
        share_text = f"{100 * shares.get('lm_head', 0):.0f}% / {100 * shares.get('sampling', 0):.0f}%" if shares else ""
        ratio = f"{r['decode_tok_per_s'] / ref:.2f}x" if ref else ""
        own = f"{r['own_over_external']:.3f}" if "own_over_external" in r else ""
        base = results.get(full_precision_row(name), {}).get("decode_tok_per_s") if ":kv=" in name else None
        vs_auto = f"{r['decode_tok_per_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {name} | {r['prompt_tokens']} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | "
            f"{r['decode_tok_per_s']:.1f} | {ratio} | {vs_auto} | {own} | "
            f"{r['weight_bytes_per_token'] / 1e6:.0f} | {100 * r['roofline_share']:.0f}% | {share_text} |"
        )
    return lines


def wiki_prompt(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of the evaluation documents joined (the first 20, more for long contexts)."""
    docs = wiki_split("eval")
    n = 20
    while True:
        ids = tokenizer(" ".join(d.extract for d in docs[:n]), add_special_tokens=False).input_ids
        if len(ids) >= tokens or n >= len(docs):
            return ids[:tokens]
        n *= 2


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m evals.bench_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list (default {DEFAULT_ROWS})")
    ap.add_argument("--reference", default="qspec:bf16", help="the row every ratio is against")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write a JSON record here")
    args = ap.parse_args(argv)
    check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.new_tokens < 2 or args.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")
    rows = parse_rows(args.rows)
    torch.set_num_threads(args.threads)

    _, _, path = load_model(args.model)
    tokenizer = load_tokenizer(str(path))
    prompt = wiki_prompt(tokenizer, row_prompt_tokens(rows, args.prompt_tokens))
    runners, skipped = build_runners(rows, args.model, prompt, args.threads, args.prompt_tokens, args.new_tokens)
    bandwidth = measure_bandwidth()
    print(f"[bench_decode] streaming bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads", file=sys.stderr)
    for r in runners:  # warm up every runner (first-call allocations, kernel choice, the compiled CPU step)
        r.call(8)
    try:
        for i in range(args.repeats):
            time_round(runners, args.new_tokens)
            print(f"[bench_decode] repeat {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted("no summary: every row needs the same number of interleaved rounds")
    results = {r.name: summarize(r, args.new_tokens, bandwidth) for r in runners if r.walls}
    for r in runners:
        if r.profile is not None:
            results[r.name]["time_shares"] = r.profile(args.new_tokens)
    record = {
        "run": provenance(),
        "bandwidth_GBps": bandwidth / 1e9,
        "args": vars(args),
        "prompt_tokens": min(len(prompt), args.prompt_tokens),
        "skipped": skipped,
        "results": results,
    }
    print(
        f"batch 1, {args.new_tokens} new tokens after each row's prompt, greedy, {args.threads} threads, median "
        f"of {args.repeats} interleaved rounds; TPOT = (wall(N) - wall(1)) / (N - 1) from whole calls"
    )
    print("\n".join(table(results, args.reference if args.reference in results else None)))
    for name, why in skipped.items():
        print(f"(skipped {name}: {why})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    run(main)
