"""Decode speed at batch 1, wall clock: qspec's formats against HF ``generate`` and llama.cpp, in one run.

    python -m evals.speed.bench_decode                                   # fp32, bf16, int8, int4 vs HF (+ llama.cpp)
    python -m evals.speed.bench_decode --rows qspec:bf16,hf:bf16 --repeats 5 --out notes/results/bench_decode.json

Every runner is timed the same way, from outside: a whole call that generates 1 token (its wall time is the
TTFT) and a whole call that generates N; TPOT = (wall(N) - wall(1)) / (N - 1), decode tok/s = 1 / TPOT. Runners
alternate (A, B, C, A, B, C, ...) for ``--repeats`` rounds so load on a shared machine hits all alike, and each
figure is the median. ``--prompt-tokens 128,512,2048`` adds a TTFT table: each row's 1-token call at every
prompt length (interleaved the same way) and its ratio to the reference row; the decode table uses the first length.
For qspec's rows the loop's own clock (runtime.timing: whole steps) is printed beside
the external one as a check, and one profiled call splits a step into forward, lm_head and sampling. The
roofline share compares the bytes read per decoded token (the weights, and the KV cache at the decode's mean
context: codes and scales of a quantized cache) with a streaming bandwidth measured here.

Rows: ``qspec:fp32``, ``qspec:bf16`` (bf16 layers and head, fp32 residual stream), ``qspec:bf16-fp32head``,
``qspec:int8`` (per-channel), ``qspec:int4`` (group 64, asymmetric), ``qspec:int4-int8head`` (the tied head
int8 per-channel), ``qspec:fp8`` (e4m3 weight-only, per-channel scales), ``qspec:w8a8`` (int8 per-channel
symmetric with int8 per-token activations), ``qspec:w4a8`` (int4 group 64 with int8 activations: an opt-in
approximation of int4; ``qspec:w4a8-int8head`` with the head int8 too, ``qspec:w4a8-w8a8head`` with int8 inputs
into that head as well: llama.cpp Q4_K_M's shape, whose output layer takes Q8_K activations),
``hf:fp32``, ``hf:bf16``,
``llama.cpp`` (llama-cpp-python on the GGUF the default model ships as, an optional peer: skipped with a note
when it is not installed). Quantized rows use round-to-nearest codes (speed does not depend on how codes are
chosen) with bf16 activations. A qspec row may name its KV cache format: ``qspec:bf16:kv=int8`` (``auto``,
``int8``, ``fp8_e4m3``, ``int4``; runtime.kv_policy), the same model as the row without it, and on a CPU with AMX
its AMX row policy: ``qspec:bf16:amx=off`` (``exact``, ``dense``, ``off``, ``approximate``; runtime.kernels.cpu_step),
set around each of its calls.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.fast_copy import NAMED_COPIES, named_fast_copy
from runtime.cliutil import ArgumentParser, UsageError, interrupted, run
from runtime.data import wiki_split
from runtime.decoding import generate
from runtime.kernels.cpu_step import AMX_POLICIES, amx_policy, isa_supported
from runtime.kv_policy import KVCacheSpec
from runtime.kv_quant import KV_DTYPES, bytes_per_token_head
from runtime.loader import DEFAULT_MODEL, check_model_arg, gguf_source, load_model, load_tokenizer
from runtime.provenance import provenance
from runtime.sampling import SamplingParams

QSPEC_ROWS = NAMED_COPIES
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


@dataclass
class Runner:
    """One row: call(n) generates n tokens from the prompt in a whole call and returns the loop's own timing
    (runtime.timing.LoopTiming) where it has one."""

    name: str
    call: Callable[[list[int], int], object]  # (prompt, new tokens)
    weight_bytes: int
    kv_bytes_per_position: float  # K and V bytes of one cached position, every layer (a token reads each position)
    profile: Callable[[int], dict] | None = None  # qspec: seconds per phase of one call
    walls: dict[int, list[float]] = field(default_factory=lambda: {})
    ttft_by_length: dict[int, list[float]] = field(default_factory=lambda: {})  # prompt length -> 1-token walls
    own_tpot: list[float] = field(default_factory=list)


def qspec_runner(name: str, model, prompt: list[int], kv: KVCacheSpec | None = None, amx: str | None = None) -> Runner:
    """amx: the CPU step's AMX row policy for this row's calls (runtime.kernels.cpu_step.amx_policy), else the
    process's."""

    def call(ids: list[int], n: int):
        with amx_policy(amx):
            return generate(model, [ids], SamplingParams(max_tokens=n, ignore_eos=True), kv_cache=kv).timing

    def profile(n: int) -> dict:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        with amx_policy(amx):
            timing = generate(model, [prompt], params, profile=True, kv_cache=kv).timing
        return {k: v / timing.wall_s for k, v in timing.phase_s.items()}

    kv_dtype = "auto" if kv is None else kv.dtype
    kv_bytes = kv_position_bytes(model.config, kv_dtype, model.compute_dtype.itemsize)
    return Runner(name, call, decode_weight_bytes(model), kv_bytes, profile)


def kv_position_bytes(config, kv_dtype: str, dtype_bytes: float) -> float:
    """K and V bytes of one cached position over every layer (runtime.kv_quant.bytes_per_token_head): codes and
    scales of a quantized cache, else dtype_bytes per element (the full-precision cache's dtype)."""
    per_head = bytes_per_token_head(kv_dtype, config.head_dim, dtype_bytes)
    return config.num_layers * config.num_kv_heads * per_head


def hf_runner(name: str, hf_model, config) -> Runner:
    @torch.inference_mode()
    def call(prompt_ids: list[int], n: int):
        ids = torch.tensor([prompt_ids])
        kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
        hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    kv = kv_position_bytes(config, "auto", hf_model.dtype.itemsize)
    return Runner(name, call, hf_decode_weight_bytes(hf_model), kv)


LLAMA_CPP_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_batch=64, verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4], top_k=1, top_p=1.0, temp=0.0, reset=True)):
    if i >= 2:
        break
"""


def llama_cpp_runner(gguf: Path, longest: int, threads: int, config) -> Runner | str:
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
    n_ctx = max(1024, longest + 256)  # the longest prompt and its new tokens
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)  # fmt: skip

    def call(ids: list[int], n: int):
        llm.reset()  # no prefix reuse between calls: each call prefills the prompt, as the other runners do
        for i, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True)):
            if i + 1 >= n:
                break

    print(f"[bench_decode] llama.cpp reads {gguf}", file=sys.stderr)
    kv = kv_position_bytes(config, "auto", 2)  # llama.cpp's default KV cache: f16
    return Runner("llama.cpp", call, gguf.stat().st_size, kv)  # the row's own name: --reference llama.cpp finds it


def time_round(runners: list[Runner], prompt: list[int], new_tokens: int) -> None:
    """One interleaved round: every runner's 1-token call, then every runner's N-token call."""
    for n in (1, new_tokens):
        for r in runners:
            t = time.perf_counter()
            own = r.call(prompt, n)
            r.walls.setdefault(n, []).append(time.perf_counter() - t)
            if n > 1 and own is not None:
                r.own_tpot.append(own.tpot_s)


def time_ttft_round(runners: list[Runner], prompts: list[list[int]]) -> None:
    """One interleaved TTFT round: at each prompt length, every runner's 1-token call."""
    for prompt in prompts:
        for r in runners:
            t = time.perf_counter()
            r.call(prompt, 1)
            r.ttft_by_length.setdefault(len(prompt), []).append(time.perf_counter() - t)


def ttft_table(runners: list[Runner], lengths: list[int], reference: str | None) -> list[str]:
    """Median TTFT per prompt length, each with its ratio to the reference row's."""
    head = "| row | " + " | ".join(f"TTFT {n} ms | x {reference or '-'}" for n in lengths) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(lengths)]
    medians = {r.name: {n: statistics.median(r.ttft_by_length[n]) for n in lengths} for r in runners}
    ref = medians.get(reference) if reference else None
    for name, by_length in medians.items():
        cells = [f"{1e3 * by_length[n]:.1f} | " + (f"{by_length[n] / ref[n]:.2f}x" if ref else "") for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def summarize(r: Runner, new_tokens: int, bandwidth: float, prompt_tokens: int) -> dict:
    """Decode figures of a row; the roofline reads its weights and, per token, its KV cache at the decode's mean
    context (prompt + half the new tokens)."""
    ttft = statistics.median(r.walls[1])
    wall_n = statistics.median(r.walls[new_tokens])
    # each round's two calls run back to back: the median of their differences moves less with the machine than
    # the difference of the medians; where a long prompt's TTFT varies by more than the decode takes, no external
    # TPOT can be read (NaN, said on stderr) and the loop's own clock (own_clock_tpot_ms) is the figure
    decode = statistics.median(n - one for one, n in zip(r.walls[1], r.walls[new_tokens]))
    tpot = decode / (new_tokens - 1) if decode > 0 else math.nan
    if math.isnan(tpot):
        print(f"[bench_decode] {r.name}: TTFT noise exceeds the decode time; read own_clock_tpot_ms", file=sys.stderr)
    kv_bytes = r.kv_bytes_per_position * (prompt_tokens + new_tokens / 2)
    roofline_tpot = (r.weight_bytes + kv_bytes) / bandwidth
    out = {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tok_per_s": 1 / tpot,
        "end_to_end_tok_per_s": new_tokens / wall_n,
        "weight_bytes_per_token": r.weight_bytes,
        "kv_bytes_per_token": kv_bytes,
        "roofline_tok_per_s": 1 / roofline_tpot,
        "roofline_share": roofline_tpot / tpot,
        "walls_s": r.walls,
    }
    if r.own_tpot:  # the loop's own clock against the external one: they must agree (whole steps)
        out["own_clock_tpot_ms"] = statistics.median(r.own_tpot) * 1e3
        out["own_over_external"] = out["own_clock_tpot_ms"] / out["tpot_ms"]
    return out


ROW_OPTIONS = ("kv", "amx")


def row_parts(row: str) -> tuple[str, str, dict[str, str]]:
    """``qspec:bf16:kv=int8:amx=off`` -> ("qspec", "bf16", {"kv": "int8", "amx": "off"})."""
    kind, _, rest = row.partition(":")
    variant, *options = rest.split(":") if rest else [""]
    parsed = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in ROW_OPTIONS or key in parsed:
            raise UsageError(f"row {row!r}: options are kv=FORMAT and amx=POLICY, each at most once (got {option!r})")
        parsed[key] = value
    return kind, variant, parsed


def parse_rows(spec: str) -> list[str]:
    rows = [r.strip() for r in spec.split(",") if r.strip()]
    for r in rows:
        kind, variant, options = row_parts(r)
        hf_ok = kind == "hf" and variant in ("fp32", "bf16") and not options
        ok = (kind == "qspec" and variant in QSPEC_ROWS) or hf_ok
        if not ok and r != "llama.cpp":
            raise UsageError(
                f"unknown row {r!r}: qspec:{{{','.join(QSPEC_ROWS)}}}[:kv=FORMAT][:amx=POLICY], hf:{{fp32,bf16}} or "
                "llama.cpp"
            )
        if options.get("kv", "auto") not in KV_DTYPES:
            raise UsageError(f"row {r!r}: kv= takes one of {', '.join(KV_DTYPES)}")
        if "amx" in options:
            if options["amx"] not in AMX_POLICIES:
                raise UsageError(f"row {r!r}: amx= takes one of {', '.join(AMX_POLICIES)}")
            if not isa_supported("amx"):
                raise UsageError(f"row {r!r}: amx= names an AMX row policy, and this CPU has no AMX")
    return rows


def parse_lengths(ap: ArgumentParser, spec: str) -> list[int]:
    try:
        lengths = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--prompt-tokens takes a length or a comma list of lengths, got {spec!r}")
    if not lengths or min(lengths) < 1:
        ap.error("--prompt-tokens lengths must be >= 1")
    return lengths


def prompt_ids(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per length, each a prefix of the same wiki text (eval split), long enough for the longest."""
    docs, ids = wiki_split("eval"), []
    for count in range(20, len(docs) + 20, 20):  # the first 20 extracts, more while too short
        ids = tokenizer(" ".join(d.extract for d in docs[:count]), add_special_tokens=False).input_ids
        if len(ids) >= max(lengths):
            break
    if len(ids) < max(lengths):
        raise UsageError(f"the eval text has {len(ids)} tokens; --prompt-tokens asks for {max(lengths)}")
    return [ids[:n] for n in lengths]


def build_runners(
    rows: list[str], model_spec: str, prompt: list[int], threads: int, longest: int
) -> tuple[list[Runner], dict]:
    from transformers import AutoModelForCausalLM

    base, _, path = load_model(model_spec)
    runners, skipped, copies = [], {}, {}
    for row in rows:
        kind, variant, options = row_parts(row)
        print(f"[bench_decode] building {row}", file=sys.stderr, flush=True)
        if kind == "qspec":  # rows of one variant share its model; each call builds its own KV cache
            if variant not in copies:
                copies[variant] = named_fast_copy(base, variant)
            kv = KVCacheSpec(dtype=options.get("kv", "auto"))
            runners.append(qspec_runner(row, copies[variant], prompt, kv, amx=options.get("amx")))
        elif kind == "hf":
            dtype = torch.float32 if variant == "fp32" else torch.bfloat16
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            runners.append(hf_runner(row, hf, base.config))
        else:
            gguf = gguf_source(model_spec)
            made = llama_cpp_runner(gguf, longest, threads, base.config) if gguf else "the model has no GGUF source"
            if isinstance(made, str):
                skipped[row] = made
                print(f"[bench_decode] skipping {row}: {made}", file=sys.stderr)
            else:
                runners.append(made)
    return runners, skipped


def table(results: dict, reference: str | None) -> list[str]:
    x = f"x {reference or '-'}"
    lines = [
        f"| row | TTFT ms | TPOT ms | decode tok/s | {x} | whole call tok/s | {x} (whole call) | own clock / wall | "
        "weight MB/token | KV MB/token | roofline share | lm_head / sampling share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = results.get(reference) if reference else None
    for name, r in results.items():
        shares = r.get("time_shares")
        share_text = f"{100 * shares.get('lm_head', 0):.0f}% / {100 * shares.get('sampling', 0):.0f}%" if shares else ""
        ratio = f"{r['decode_tok_per_s'] / ref['decode_tok_per_s']:.2f}x" if ref else ""
        whole = f"{r['end_to_end_tok_per_s'] / ref['end_to_end_tok_per_s']:.2f}x" if ref else ""
        own = f"{r['own_over_external']:.3f}" if "own_over_external" in r else ""
        lines.append(
            f"| {name} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | {r['decode_tok_per_s']:.1f} | {ratio} | "
            f"{r['end_to_end_tok_per_s']:.1f} | {whole} | {own} | {r['weight_bytes_per_token'] / 1e6:.0f} | "
            f"{r.get('kv_bytes_per_token', 0) / 1e6:.1f} | {100 * r['roofline_share']:.0f}% | {share_text} |"
        )
    return lines


def parse_args(argv):
    ap = ArgumentParser(prog="python -m evals.speed.bench_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list (default {DEFAULT_ROWS})")
    ap.add_argument("--reference", default="qspec:bf16", help="the row every ratio is against")
    ap.add_argument("--prompt-tokens", default="128", help="a length or a comma list (a TTFT table per length)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write a JSON record here")
    args = ap.parse_args(argv)
    check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.new_tokens < 2 or args.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")
    args.lengths = parse_lengths(ap, args.prompt_tokens)
    args.row_list = parse_rows(args.rows)
    return args


def measure(args) -> tuple[list[Runner], list[list[int]], dict, dict]:
    """(runners, prompts per length, results per row, skipped rows): every row warmed up, then --repeats
    interleaved rounds of decode (first prompt length) and, with several lengths, TTFT per length."""
    torch.set_num_threads(args.threads)
    _, _, path = load_model(args.model)
    prompts = prompt_ids(load_tokenizer(str(path)), args.lengths)
    prompt = prompts[0]
    runners, skipped = build_runners(args.row_list, args.model, prompt, args.threads, max(args.lengths))
    bandwidth = measure_bandwidth()
    print(f"[bench_decode] streaming bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads", file=sys.stderr)
    for r in runners:  # warm up every runner (first-call allocations, kernel choice, the compiled CPU step)
        r.call(prompt, 8)
    try:
        for i in range(args.repeats):
            time_round(runners, prompt, args.new_tokens)
            if len(prompts) > 1:
                time_ttft_round(runners, prompts)
            print(f"[bench_decode] repeat {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted("no summary: every row needs the same number of interleaved rounds")
    results = {r.name: summarize(r, args.new_tokens, bandwidth, len(prompt)) for r in runners if r.walls}
    for r in runners:
        if r.profile is not None:
            results[r.name]["time_shares"] = r.profile(args.new_tokens)
        if len(prompts) > 1 and r.name in results:
            results[r.name]["ttft_ms_by_prompt_tokens"] = {
                n: 1e3 * statistics.median(v) for n, v in r.ttft_by_length.items()
            }
    return runners, prompts, results, {"bandwidth_GBps": bandwidth / 1e9, "skipped": skipped}


def report(args, runners, prompts, results, extra) -> None:
    print(
        f"batch 1, {len(prompts[0])}-token prompt, {args.new_tokens} new tokens, greedy, {args.threads} threads, "
        f"median of {args.repeats} interleaved rounds; TPOT = (wall(N) - wall(1)) / (N - 1) from whole calls"
    )
    reference = args.reference if args.reference in results else None
    print("\n".join(table(results, reference)))
    if len(prompts) > 1:
        print(f"\nTTFT (a whole 1-token call) by prompt length, median of {args.repeats} interleaved rounds")
        print("\n".join(ttft_table(runners, args.lengths, reference)))
    for name, why in extra["skipped"].items():
        print(f"(skipped {name}: {why})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runners, prompts, results, extra = measure(args)
    report(args, runners, prompts, results, extra)
    if args.out:
        record = {"run": provenance(), **extra, "args": {k: v for k, v in vars(args).items() if k != "row_list"},
                  "prompt_tokens": len(prompts[0]), "results": results}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    run(main)
