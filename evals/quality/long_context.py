"""Long-context quality and capacity of a KV cache (runtime.kv_policy: format and eviction policy).

``python -m evals.quality.long_context`` measures, for each cache against the full-precision one, on shipped data:

- perplexity at 2k / 4k / 8k tokens: the wiki eval split's documents joined in order with blank lines and
  tokenized once (the evals.quality.perplexity text), cut into non-overlapping windows of `length` tokens; each window
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
  cache (tokens before the first divergence, evals.quality.fidelity.token_match).
- memory: the cache's bytes at each length (a sink-window cache's stay flat), and the serving engine's maximum
  concurrent sequences of a given length under a fixed KV memory budget (its own block sizing, int4's residual
  included), checked by running the engine: that many sequences run at once without preemption, one more does not.

Every cache but the full-precision one is APPROXIMATE; the records say so.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from evals.quality.fidelity import token_match
from evals.quality.long_context_measures import (
    cache_perplexity,
    capacity,
    engine_holds,
    greedy_outputs,
    log,
    parse_spec,
    retrieval,
)
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES
from runtime.data import token_windows, wiki_text
from runtime.kv_policy import MAX_CHUNK, KVCacheSpec
from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance

KV_DTYPES = ("auto", "int8", "fp8_e4m3", "int4")  # the capacity table's rows


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


@dataclass
class Session:
    """One run: the model, the caches to measure (the first is the reference) and the records file."""

    args: argparse.Namespace
    model: object
    tokenizer: object
    specs: list[KVCacheSpec]
    records: Path
    command: str
    text: str = field(default_factory=lambda: wiki_text("eval"))

    def emit(self, part: str, spec: KVCacheSpec | None, result: dict) -> None:
        kv = None if spec is None else {**asdict(spec), "label": spec.label(), "approximate": spec.approximate}
        args = self.args
        rec = {"part": part, "kv": kv, "model": args.model, "dtype": args.dtype, "results": result,
               **provenance(args.seed, self.command)}  # fmt: skip
        with self.records.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def parse_args(argv: list[str] | None) -> tuple[ArgumentParser, argparse.Namespace]:
    ap = ArgumentParser(prog="python -m evals.quality.long_context", description=__doc__.splitlines()[0])
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
        return ap, args
    try:
        args.specs = [parse_spec(s) for s in args.kv.split(",")]
    except ValueError as err:
        ap.error(f"--kv: {err}")
    args.lengths, args.windows = int_list(args.lengths), int_list(args.windows)
    if len(args.lengths) != len(args.windows):
        ap.error("--lengths and --windows need the same number of entries")
    args.skip = set(args.skip.split(",")) - {""}
    return ap, args


def measure_perplexity(s: Session) -> None:
    args = s.args
    for length, count in zip(args.lengths, args.windows):
        windows = token_windows(s.tokenizer, s.text, length, count)
        for spec in s.specs:
            chunk = min(args.chunk, MAX_CHUNK) if spec.policy == "sink-window" else args.chunk
            res = cache_perplexity(s.model, windows, spec, chunk)
            mib = res["cache_bytes"] / 2**20
            log(f"perplexity {length}: {spec.label()}: {res['perplexity']:.4f} ({mib:.1f} MiB)")
            s.emit("perplexity", spec, {"length": length, "chunk": chunk, **res})


def measure_retrieval(s: Session) -> None:
    args = s.args
    depths = [float(d) for d in args.depths.split(",")]
    for spec in s.specs:
        res = retrieval(s.model, s.tokenizer, spec, args.retrieval_length, depths, args.trials, args.seed)
        log(f"retrieval {args.retrieval_length}: {spec.label()}: " + ", ".join(
            f"depth {d}: {r['accuracy']:.2f}" for d, r in res.items()))  # fmt: skip
        s.emit("retrieval", spec, {"length": args.retrieval_length, "depths": res})


def measure_greedy(s: Session) -> None:
    args, specs = s.args, s.specs
    prompts = token_windows(s.tokenizer, s.text, args.greedy_length, args.greedy_prompts + 16)[16:]
    reference = greedy_outputs(s.model, prompts, specs[0], args.greedy_tokens)
    for spec in specs[1:]:
        match = token_match(reference, greedy_outputs(s.model, prompts, spec, args.greedy_tokens)).to_dict()
        log(f"greedy agreement {args.greedy_length}+{args.greedy_tokens}: {spec.label()}: {match['match_rate']:.3f}")
        s.emit("greedy", spec, {"prompt_tokens": args.greedy_length, "new_tokens": args.greedy_tokens,
                                "reference": specs[0].label(), **match})  # fmt: skip


def measure_capacity(s: Session) -> None:
    """Engine capacity per KV dtype and sequence length under --budget-mib, then (--engine-check) the predicted
    capacity run through the engine: that many sequences at once, and one more."""
    args = s.args
    same = args.capacity_dtype == args.dtype
    engine_model = s.model if same else load_model(args.model, DTYPES[args.capacity_dtype])[0]
    cdtype = engine_model.compute_dtype
    budget = int(args.budget_mib * 2**20)
    for seq in int_list(args.capacity_lengths):
        caps = {d: capacity(engine_model.config, cdtype, d, budget, seq, args.block_size) for d in KV_DTYPES}
        base = caps["auto"].concurrent_sequences
        for d, cap in caps.items():
            ratio = cap.concurrent_sequences / base if base else float("nan")
            log(f"capacity {seq} tokens, {args.budget_mib:g} MiB: {d}: {cap.concurrent_sequences} ({ratio:.2f}x)")
            s.emit("capacity", KVCacheSpec(d), {**asdict(cap), "ratio_vs_auto": ratio,
                                                "kv_dtype_of_auto": str(cdtype)})  # fmt: skip
    if not args.engine_check:
        return
    seq, prompt = int_list(args.engine_check.replace(":", ","))
    ebudget = int(args.engine_budget_mib * 2**20)
    for d in KV_DTYPES:
        cap = capacity(engine_model.config, cdtype, d, ebudget, seq, args.block_size)
        fits = engine_holds(engine_model, cap, prompt, cap.concurrent_sequences, args.seed)
        over = engine_holds(engine_model, cap, prompt, cap.concurrent_sequences + 1, args.seed)
        log(f"engine check {seq} tokens, {args.engine_budget_mib:g} MiB: {d}: {fits} / one more: {over}")
        s.emit("engine_check", KVCacheSpec(d), {"capacity": asdict(cap), "fits": fits, "one_more": over})


def measure(s: Session) -> None:
    """Every part not in --skip, each appending its records."""
    if "perplexity" not in s.args.skip:
        measure_perplexity(s)
    if "retrieval" not in s.args.skip:
        measure_retrieval(s)
    if "greedy" not in s.args.skip and s.args.greedy_prompts:
        measure_greedy(s)
    if "capacity" not in s.args.skip:
        measure_capacity(s)


def main(argv: list[str] | None = None) -> None:
    ap, args = parse_args(argv)
    records = Path(args.out) / "records.jsonl"
    if args.render:
        print(write_table(records))
        return
    records.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, _, path = load_model(args.model, DTYPES[args.dtype])
    positions = model.config.max_position_embeddings
    if max(args.lengths + [args.retrieval_length, args.greedy_length]) > positions:
        ap.error(f"lengths beyond the model's context of {positions} positions")
    started = time.time()
    command = module_command("evals.quality.long_context", argv)
    measure(Session(args, model, load_tokenizer(str(path)), args.specs, records, command))
    write_table(records)
    log(f"done in {(time.time() - started) / 60:.1f} min: {records}, {records.parent / 'table.md'}")


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
