"""Long-context quality and capacity of a KV cache (runtime.kv_policy: format and eviction policy).

``python -m evals.long_context`` measures, for each cache against the full-precision one, on shipped data:

- perplexity at 2k / 4k / 8k tokens: the wiki eval split's documents joined in order with blank lines and
  tokenized once (the evals.perplexity text), cut into non-overlapping windows of `length` tokens; each window
  is fed through the cache `chunk` tokens per forward and every predicted token's NLL summed (teacher-forced).
  A chunk's queries read what the cache stores (quantized keys and values; an int4 query reads its own
  still-open key group in full precision, exactly as token-by-token decoding would, so the figure does not
  depend on the chunk size); a sink-window query attends to the sinks and to its own window.
- retrieval (passkey, Mohtashami & Jaggi 2023): a five-digit key planted at a chosen depth of `length` tokens of
  wiki text ("The pass key is K. Remember it. K is the pass key."), asked for at the end by starting the
  sentence again ("The pass key is": the model retrieves by copying; with "What is the pass key?" before it the
  135M default model fails even with the full-precision cache); greedy answer of 8 tokens through the cache;
  exact match of the key's digits.
- greedy agreement: greedy continuations of long wiki prompts through the cache vs through the full-precision
  cache (tokens before the first divergence, evals.fidelity.token_match).
- memory: the cache's bytes at each length (a sink-window cache's stay flat), and the serving engine's maximum
  concurrent sequences of a given length under a fixed KV memory budget (its own block sizing, int4's residual
  included), checked by running the engine: that many sequences run at once without preemption, one more does not.

Every cache but the full-precision one is APPROXIMATE; the records say so.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from evals.fidelity import token_match
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES
from runtime.data import token_windows, wiki_text
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_policy import MAX_CHUNK, KVCacheSpec
from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer
from runtime.model import AttentionMetadata
from runtime.paged_cache import PagedKVCache
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nThe pass key is"  # completed by copying: "What is the pass key?" first defeats this model at any cache
FILLER_START = 100_000  # retrieval filler comes from later in the eval text than the perplexity windows


def log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


def parse_spec(text: str) -> KVCacheSpec:
    """'auto', 'int8', 'fp8_e4m3', 'int4', 'sink-window' (4 + 1020), 'sink-window:0+1024', 'int8+sink-window:4+252'."""
    dtype, policy = "auto", text
    if "+sink-window" in text:
        dtype, policy = text.split("+", 1)
    if not policy.startswith("sink-window"):
        return KVCacheSpec(text)
    sizes = policy.partition(":")[2] or "4+1020"
    try:
        sinks, window = (int(x) for x in sizes.split("+"))
    except ValueError:
        raise ValueError(f"{text!r}: sink-window sizes are SINKS+WINDOW, e.g. sink-window:4+1020") from None
    return KVCacheSpec(dtype, "sink-window", sinks, window)


# ---- perplexity --------------------------------------------------------------------------------------


@torch.inference_mode()
def stream_nll(model, window: list[int], kv: KVCacheSpec, chunk: int = 256) -> tuple[float, int, int]:
    """(summed NLL of window[1:], tokens predicted, cache bytes) with the window fed through kv's cache."""
    device = model.inv_freq.device
    tokens = torch.tensor([window], device=device)
    cache = kv.build(model, 1, len(window))
    chunk = min(chunk, getattr(cache, "max_chunk", chunk))
    total = 0.0
    for start in range(0, len(window) - 1, chunk):
        n = min(chunk, len(window) - start)
        meta = AttentionMetadata.contiguous(1, start, n, device)
        logits = model(tokens[:, start : start + n], meta, cache)[0]  # [n, V]
        targets = tokens[0, start + 1 : start + n + 1]
        total += float(F.cross_entropy(logits[: targets.numel()].float(), targets, reduction="sum"))
    return total, len(window) - 1, cache.nbytes()


def cache_perplexity(model, windows: list[list[int]], kv: KVCacheSpec, chunk: int = 256) -> dict:
    nll = tokens = 0
    cache_bytes = 0
    for w in windows:
        s, n, cache_bytes = stream_nll(model, w, kv, chunk)
        nll, tokens = nll + s, tokens + n
    return {"perplexity": math.exp(nll / tokens), "mean_nll": nll / tokens, "windows": len(windows),
            "tokens": tokens, "cache_bytes": cache_bytes}  # fmt: skip


# ---- retrieval ---------------------------------------------------------------------------------------


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: str) -> list[int]:
    """`length` tokens: filler with the needle inserted at `depth` (0 = start, 1 = just before the question)."""
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    room = length - len(needle) - len(question)
    if room < 1 or len(filler) < room:
        raise ValueError(f"no room for {length} tokens of passkey prompt")
    at = round(depth * room)
    return filler[:at] + needle + filler[at:room] + question


def retrieval(
    model, tokenizer, kv: KVCacheSpec, length: int, depths: list[float], trials: int, seed: int = 0
) -> dict[str, dict]:
    """Per depth: exact-match accuracy of the greedy answer (8 tokens) over `trials` keys and filler texts."""
    ids = tokenizer(wiki_text("eval"), add_special_tokens=False).input_ids
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for depth in depths:
        hits, answers = 0, []
        for t in range(trials):
            key = str(rng.randrange(10_000, 100_000))
            filler = ids[FILLER_START + t * length : FILLER_START + (t + 1) * length]
            prompt = passkey_prompt(tokenizer, filler, length, depth, key)
            answer = tokenizer.decode(generate(model, [prompt], params, kv_cache=kv).tokens[0])
            hits += key in answer
            answers.append(answer)
        out[f"{depth:g}"] = {"accuracy": hits / trials, "trials": trials, "answers": answers}
    return out


# ---- greedy agreement --------------------------------------------------------------------------------


def greedy_outputs(model, prompts: list[list[int]], kv: KVCacheSpec, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [generate(model, [p], params, kv_cache=kv).tokens[0] for p in prompts]


# ---- capacity ----------------------------------------------------------------------------------------


@dataclass
class Capacity:
    kv_cache_dtype: str
    budget_bytes: int
    sequence_tokens: int
    block_size: int
    max_num_seqs: int  # the engine setting that holds the most sequences (int4's residual grows with it)
    blocks: int  # usable blocks of the pool
    bytes_per_block: int
    residual_bytes: int  # int4: full-precision open key groups of max_num_seqs sequences
    concurrent_sequences: int  # sequences of sequence_tokens that fit at once


def capacity(config, dtype: torch.dtype, kv_cache_dtype: str, budget: int, seq_tokens: int, block_size: int):
    """How many sequences of seq_tokens fit the budget at once, by the engine's own block sizing
    (PagedKVCache.blocks_for_budget). int4 sets its residual aside per admitted sequence (max_num_seqs), so the
    largest max_num_seqs whose sequences still fit the remaining blocks is the answer."""
    per_seq = -(-seq_tokens // block_size)
    per_block = PagedKVCache.bytes_per_block(config, block_size, dtype, kv_cache_dtype)

    def sized(seqs: int) -> Capacity:
        blocks = PagedKVCache.blocks_for_budget(config, budget, block_size, dtype, kv_cache_dtype, seqs)
        residual = PagedKVCache.residual_bytes(config, block_size, dtype, kv_cache_dtype, seqs)
        fits = blocks // per_seq if kv_cache_dtype != "int4" else min(seqs, blocks // per_seq)
        return Capacity(kv_cache_dtype, budget, seq_tokens, block_size, seqs, blocks, per_block, residual, fits)

    if kv_cache_dtype != "int4":  # no per-sequence memory
        return sized(sized(0).concurrent_sequences)
    best = sized(1)
    while (grown := sized(best.max_num_seqs + 1)).concurrent_sequences > best.concurrent_sequences:
        best = grown
    return best


def engine_holds(model, cap: Capacity, prompt_tokens: int, seqs: int, seed: int = 0) -> dict:
    """Run `seqs` requests of prompt_tokens + (sequence_tokens - prompt_tokens) through an engine with cap's budget,
    block size and KV dtype, max_num_seqs = seqs: the most sequences that ran at once and the preemptions it took."""
    config = EngineConfig(
        block_size=cap.block_size, kv_cache_bytes=cap.budget_bytes, max_num_seqs=seqs,  # int4: its residual too
        kv_cache_dtype=cap.kv_cache_dtype, max_num_batched_tokens=max(512, prompt_tokens), enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(model, None, config)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=cap.sequence_tokens - prompt_tokens, ignore_eos=True)
    for _ in range(seqs):
        engine.add_request(torch.randint(2, model.config.vocab_size, (prompt_tokens,), generator=gen).tolist(), params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return {"requests": seqs, "peak_running": peak, "preemptions": engine.scheduler.num_preemptions,
            "pool_blocks": engine.block_manager.num_usable_blocks}  # fmt: skip


# ---- one cache's summary (experiments rows) -----------------------------------------------------------


def scoring_chunk(kv: KVCacheSpec, chunk: int = 256) -> int:
    return min(chunk, MAX_CHUNK) if kv.policy == "sink-window" else chunk


def long_context_summary(
    model,
    tokenizer,
    kv: KVCacheSpec,
    reference: dict,
    lengths: tuple[int, ...] = (2048, 4096, 8192),
    windows: tuple[int, ...] = (8, 4, 2),
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    trials: int = 5,
    retrieval_length: int = 2048,
    greedy_prompts: int = 4,
    greedy_length: int = 2048,
    greedy_tokens: int = 64,
    seed: int = 0,
) -> dict:
    """Perplexity per length (with the full-precision cache's on the same windows and the change in %),
    retrieval per depth, and greedy agreement with the full-precision cache, for one cache. `reference` memoises
    the full-precision results across calls (one experiment run scores it once)."""
    text = wiki_text("eval")
    full = KVCacheSpec()
    out: dict = {"kv_cache": kv.label(), "approximate": kv.approximate, "perplexity": {}}
    for length, count in zip(lengths, windows):
        wins = token_windows(tokenizer, text, length, count)
        key = f"perplexity:{length}x{count}"
        if key not in reference:
            reference[key] = cache_perplexity(model, wins, full, scoring_chunk(full))
        res, ref = cache_perplexity(model, wins, kv, scoring_chunk(kv)), reference[key]
        delta = 100 * (res["perplexity"] / ref["perplexity"] - 1)
        out["perplexity"][str(length)] = {**res, "reference_perplexity": ref["perplexity"], "delta_pct": delta}
    if trials:
        found = retrieval(model, tokenizer, kv, retrieval_length, list(depths), trials, seed)
        out["retrieval"] = {"length": retrieval_length, "depths": found}
    if greedy_prompts:
        prompts = token_windows(tokenizer, text, greedy_length, greedy_prompts + 16)[16:]
        key = f"greedy:{greedy_length}x{greedy_prompts}+{greedy_tokens}"
        if key not in reference:
            reference[key] = greedy_outputs(model, prompts, full, greedy_tokens)
        match = token_match(reference[key], greedy_outputs(model, prompts, kv, greedy_tokens))
        out["greedy"] = {"prompt_tokens": greedy_length, **match.to_dict()}
    return out


# ---- the CLI -----------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m evals.long_context", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype for the quality measures")
    ap.add_argument("--kv", default="auto,int8,fp8_e4m3,int4,sink-window:4+1020,sink-window:0+1024",
                    help="caches to measure (the first is the reference): auto, int8, fp8_e4m3, int4, "
                    "sink-window[:SINKS+WINDOW], DTYPE+sink-window[:...]")  # fmt: skip
    ap.add_argument("--lengths", default="2048,4096,8192", help="perplexity window lengths (tokens)")
    ap.add_argument("--windows", default="8,4,2", help="windows per length")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per forward while scoring")
    ap.add_argument("--retrieval-length", type=int, default=2048)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--trials", type=int, default=5, help="passkeys per depth")
    ap.add_argument("--greedy-prompts", type=int, default=4, help="long prompts for greedy agreement (0: skip)")
    ap.add_argument("--greedy-length", type=int, default=2048)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="KV memory budget for the capacity figures")
    ap.add_argument("--capacity-lengths", default="512,2048,8192", help="sequence lengths for capacity")
    ap.add_argument("--capacity-dtype", default="bf16", choices=sorted(DTYPES), help="engine model dtype")
    ap.add_argument("--engine-check", default="256:192", help="SEQ:PROMPT run through the engine ('' to skip)")
    ap.add_argument("--engine-budget-mib", type=float, default=12.0)
    ap.add_argument("--block-size", type=int, default=64, help="engine block size (int4: the key group)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: perplexity,retrieval,greedy,capacity")
    ap.add_argument("--out", required=True, help="directory for records.jsonl and table.md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine stays usable)")
    ap.add_argument("--render", action="store_true", help="only re-render OUT/table.md from OUT/records.jsonl")
    args = ap.parse_args(argv)
    if args.render:
        print(write_table(Path(args.out) / "records.jsonl"))
        return
    try:
        specs = [parse_spec(s) for s in args.kv.split(",")]
    except ValueError as err:
        ap.error(f"--kv: {err}")
    lengths, counts = int_list(args.lengths), int_list(args.windows)
    if len(lengths) != len(counts):
        ap.error("--lengths and --windows need the same number of entries")
    skip = set(args.skip.split(",")) - {""}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "records.jsonl"
    command = module_command("evals.long_context", argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, _, path = load_model(args.model, DTYPES[args.dtype])
    tokenizer = load_tokenizer(str(path))
    positions = model.config.max_position_embeddings
    if max(lengths + [args.retrieval_length, args.greedy_length]) > positions:
        ap.error(f"lengths beyond the model's context of {positions} positions")
    text = wiki_text("eval")

    def emit(part: str, spec: KVCacheSpec | None, result: dict) -> None:
        rec = {"part": part, "kv": None if spec is None else {**asdict(spec), "label": spec.label(),
               "approximate": spec.approximate}, "model": args.model, "dtype": args.dtype, "results": result,
               **provenance(args.seed, command)}  # fmt: skip
        with records.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    started = time.time()
    if "perplexity" not in skip:
        for length, count in zip(lengths, counts):
            windows = token_windows(tokenizer, text, length, count)
            for spec in specs:
                chunk = min(args.chunk, MAX_CHUNK) if spec.policy == "sink-window" else args.chunk
                res = cache_perplexity(model, windows, spec, chunk)
                mib = res["cache_bytes"] / 2**20
                log(f"perplexity {length}: {spec.label()}: {res['perplexity']:.4f} ({mib:.1f} MiB)")
                emit("perplexity", spec, {"length": length, "chunk": chunk, **res})
    if "retrieval" not in skip:
        depths = [float(d) for d in args.depths.split(",")]
        for spec in specs:
            res = retrieval(model, tokenizer, spec, args.retrieval_length, depths, args.trials, args.seed)
            log(f"retrieval {args.retrieval_length}: {spec.label()}: " + ", ".join(
                f"depth {d}: {r['accuracy']:.2f}" for d, r in res.items()))  # fmt: skip
            emit("retrieval", spec, {"length": args.retrieval_length, "depths": res})
    if "greedy" not in skip and args.greedy_prompts:
        prompts = token_windows(tokenizer, text, args.greedy_length, args.greedy_prompts + 16)[16:]
        reference = greedy_outputs(model, prompts, specs[0], args.greedy_tokens)
        for spec in specs[1:]:
            match = token_match(reference, greedy_outputs(model, prompts, spec, args.greedy_tokens)).to_dict()
            log(
                f"greedy agreement {args.greedy_length}+{args.greedy_tokens}: {spec.label()}: {match['match_rate']:.3f}"
            )
            emit("greedy", spec, {"prompt_tokens": args.greedy_length, "new_tokens": args.greedy_tokens,
                                  "reference": specs[0].label(), **match})  # fmt: skip
    if "capacity" not in skip:
        engine_model = (
            model if args.capacity_dtype == args.dtype else load_model(args.model, DTYPES[args.capacity_dtype])[0]
        )
        cdtype = engine_model.compute_dtype
        dtypes = ["auto", "int8", "fp8_e4m3", "int4"]
        budget = int(args.budget_mib * 2**20)
        for seq in int_list(args.capacity_lengths):
            caps = {d: capacity(engine_model.config, cdtype, d, budget, seq, args.block_size) for d in dtypes}
            base = caps["auto"].concurrent_sequences
            for d, cap in caps.items():
                ratio = cap.concurrent_sequences / base if base else float("nan")
                log(f"capacity {seq} tokens, {args.budget_mib:g} MiB: {d}: {cap.concurrent_sequences} ({ratio:.2f}x)")
                emit("capacity", KVCacheSpec(d), {**asdict(cap), "ratio_vs_auto": ratio,
                                                   "kv_dtype_of_auto": str(cdtype)})  # fmt: skip
        if args.engine_check:
            seq, prompt = int_list(args.engine_check.replace(":", ","))
            ebudget = int(args.engine_budget_mib * 2**20)
            for d in dtypes:
                cap = capacity(engine_model.config, cdtype, d, ebudget, seq, args.block_size)
                fits = engine_holds(engine_model, cap, prompt, cap.concurrent_sequences, args.seed)
                over = engine_holds(engine_model, cap, prompt, cap.concurrent_sequences + 1, args.seed)
                log(f"engine check {seq} tokens, {args.engine_budget_mib:g} MiB: {d}: {fits} / one more: {over}")
                emit("engine_check", KVCacheSpec(d), {"capacity": asdict(cap), "fits": fits, "one_more": over})
    write_table(records)
    log(f"done in {(time.time() - started) / 60:.1f} min: {records}, {out_dir / 'table.md'}")


def write_table(records: Path) -> Path:
    return write_atomic(records.parent / "table.md", lambda tmp: tmp.write_text(render(records) + "\n"))


def render(records_path: Path) -> str:
    """Markdown tables from the records (the latest record per part, cache and setting)."""
    latest: dict[tuple, dict] = {}
    for line in records_path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            setting = [r["results"].get(k) for k in ("length", "sequence_tokens", "prompt_tokens")]
            latest[(r["part"], r["kv"]["label"] if r["kv"] else None, *setting)] = r  # a rerun replaces in place
    recs = list(latest.values())
    lines = ["# Long-context KV cache quality and capacity", ""]
    ppl = [r for r in recs if r["part"] == "perplexity"]
    if ppl:
        lengths = sorted({r["results"]["length"] for r in ppl})
        labels = list(dict.fromkeys(r["kv"]["label"] for r in ppl))
        best = {(r["kv"]["label"], r["results"]["length"]): r["results"] for r in ppl}
        ref = labels[0]
        lines += ["Perplexity (wiki eval, documents in order; Δ vs the first row) and cache memory per sequence:", ""]
        lines += ["| cache | " + " | ".join(f"ppl @ {n} (Δ %) | MiB @ {n}" for n in lengths) + " |"]
        lines += ["|---|" + "---:|---:|" * len(lengths)]
        for label in labels:
            cells = []
            for n in lengths:
                r, base = best.get((label, n)), best.get((ref, n))
                if r is None:
                    cells += ["—", "—"]
                    continue
                delta = 100 * (r["perplexity"] / base["perplexity"] - 1) if base else float("nan")
                cells += [f"{r['perplexity']:.4f} ({delta:+.2f} %)", f"{r['cache_bytes'] / 2**20:.1f}"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    ret = [r for r in recs if r["part"] == "retrieval"]
    if ret:
        depths = list(ret[0]["results"]["depths"])
        n = ret[0]["results"]["length"]
        lines += [f"Passkey retrieval at {n} tokens (exact match of the key in the greedy answer):", ""]
        lines += ["| cache | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---|" + "---:|" * len(depths)]
        for r in ret:
            cells = [f"{r['results']['depths'][d]['accuracy']:.2f}" for d in depths]
            lines.append(f"| {r['kv']['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    gr = [r for r in recs if r["part"] == "greedy"]
    if gr:
        res = gr[0]["results"]
        lines += [f"Greedy agreement with {res['reference']} ({res['sequences']} prompts of {res['prompt_tokens']} "
                  f"tokens, {res['new_tokens']} new tokens; tokens before the first divergence):", ""]  # fmt: skip
        lines += ["| cache | match rate | identical sequences |", "|---|---:|---:|"]
        for r in gr:
            x = r["results"]
            lines.append(
                f"| {r['kv']['label']} | {x['match_rate']:.3f} | {x['identical_sequences']}/{x['sequences']} |"
            )
        lines.append("")
    cap = [r for r in recs if r["part"] == "capacity"]
    if cap:
        c0 = cap[0]["results"]
        lines += [f"Engine capacity under a {c0['budget_bytes'] / 2**20:g} MiB KV budget (block size "
                  f"{c0['block_size']}, KV of the auto row in {c0['kv_dtype_of_auto']}; int4 includes its residual):",
                  ""]  # fmt: skip
        lines += ["| KV dtype | sequence tokens | bytes / block | residual MiB | sequences at once | vs auto |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in cap:
            x = r["results"]
            lines.append(f"| {x['kv_cache_dtype']} | {x['sequence_tokens']} | {x['bytes_per_block']:,} | "
                         f"{x['residual_bytes'] / 2**20:.1f} | {x['concurrent_sequences']} | "
                         f"{x['ratio_vs_auto']:.2f}x |")  # fmt: skip
        lines.append("")
    chk = [r for r in recs if r["part"] == "engine_check"]
    if chk:
        lines += ["Engine check (requests run through the engine; most running at once, preemptions):", ""]
        lines += ["| KV dtype | predicted | ran at once (preemptions) | one more: ran at once (preemptions) |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for r in chk:
            x = r["results"]
            f, o = x["fits"], x["one_more"]
            lines.append(f"| {r['kv']['dtype']} | {x['capacity']['concurrent_sequences']} | {f['peak_running']} "
                         f"({f['preemptions']}) | {o['peak_running']} ({o['preemptions']}) |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    run(main)
