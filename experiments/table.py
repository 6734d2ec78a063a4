"""A table config's rows: the context they share (the reference model, its tokenizer, the eval and bench
prompts) and one row's measurements (experiments/rows.py builds the variant; fidelity, greedy match, per-text
perplexity, tasks and a timed speed ratio against its own baseline). The serial runner and the Ray workers
(experiments/cluster.py) both run rows through run_row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals.quality.fidelity import FidelityAccumulator, compare_teacher_forced, model_scorer, token_match
from evals.quality.humaneval_eval import Cache, GenSettings, checkpoint_identity, evaluate
from evals.quality.humaneval_problems import load_problems, score_line, select
from evals.quality.humaneval_sandbox import Limits
from evals.quality.lm_eval_tasks import run_tasks
from evals.speculation.lossless import TwoTokenTest, deterministic_class, speculator_verdict
from experiments.bench import bench_section, log
from experiments.config import ConfigError, ExperimentConfig, Row
from experiments.rows import (
    ROWS,
    RowSkipped,
    RowUnavailable,
    Variant,
    linear_bytes_per_weight,
    plain_generate,
    weight_bytes,
)
from quantize.cli import CachedTokenizer
from runtime.config import DTYPES, ModelConfig
from runtime.data import load_text, token_windows, wiki_split, wiki_text
from runtime.loader import load_model, load_tokenizer
from runtime.model import random_model
from runtime.paths import qspec_home


@dataclass
class Context:
    cfg: ExperimentConfig
    model: object
    tokenizer: object | None
    path: Path | None
    fidelity_seqs: list[list[int]]
    greedy_prompts: list[list[int]]
    bench_prompts: list[list[int]]
    cache: dict = field(default_factory=dict)  # lazily computed reference results
    spec_stats: dict | None = None
    store: Path = field(default_factory=qspec_home)  # where artifacts (quantized checkpoints, heads) are kept

    def ref_greedy(self) -> list[list[int]]:
        if "greedy" not in self.cache:
            self.cache["greedy"] = plain_generate(self.model)(self.greedy_prompts, self.cfg.evals.greedy_tokens)
        return self.cache["greedy"]


def load_context(cfg: ExperimentConfig) -> Context:
    torch.manual_seed(cfg.seed)
    if cfg.model.spec == "tiny-random":
        try:
            mcfg = ModelConfig(**cfg.model.tiny)
        except TypeError as err:
            raise ConfigError(f"model.tiny: {err}") from err
        model, tokenizer, path = random_model(mcfg, seed=cfg.seed).to(cfg.model.device), None, None
        gen = torch.Generator().manual_seed(cfg.seed)

        def windows(n, length):
            return torch.randint(2, mcfg.vocab_size, (n, length), generator=gen).tolist()

        ev, bench = cfg.evals, cfg.bench
        fidelity = windows(ev.fidelity_sequences, ev.fidelity_seqlen)
        greedy = [
            w[: max(2, ev.greedy_prompt_tokens - 3 * i)]
            for i, w in enumerate(windows(ev.greedy_prompts, ev.greedy_prompt_tokens))
        ]
        prompts = windows(max(bench.prompts, 16), bench.prompt_tokens)
        return Context(cfg, model, tokenizer, path, fidelity, greedy, prompts)

    if cfg.kind == "concurrency" and cfg.sweep.series and all(s.get("url") for s in cfg.sweep.series):
        # every series is an external server: the spec only supplies the tokenizer that builds the prompts
        return Context(cfg, None, load_tokenizer(cfg.model.spec), None, [], [], [])
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} not in {sorted(DTYPES)}")
    model, _, path = load_model(cfg.model.spec, DTYPES[cfg.model.dtype], cfg.model.device)
    tokenizer = load_tokenizer(str(path))
    ev, bench = cfg.evals, cfg.bench
    text = wiki_text("eval")
    cached = CachedTokenizer(tokenizer)  # the split is tokenized once per machine, not once per process
    fidelity = token_windows(cached, text, ev.fidelity_seqlen, ev.fidelity_sequences)
    # greedy prompts: openings of eval documents (natural, varied lengths); bench prompts: later windows
    docs = wiki_split("eval")[1000 : 1000 + ev.greedy_prompts]
    greedy = [tokenizer(d.extract, add_special_tokens=False).input_ids[: ev.greedy_prompt_tokens] for d in docs]
    n_bench = max(bench.prompts, 16)
    later = token_windows(cached, text, bench.prompt_tokens, n_bench + 200)[-n_bench:]
    return Context(cfg, model, tokenizer, path, fidelity, greedy, later)


def engine_fidelity(ctx: Context, variant: Variant) -> tuple[dict, list[list[int]]]:
    """Teacher-forced stats along the engine's own greedy outputs: its sampled-from logits vs the reference
    forward over prompt + output."""
    outputs, logits = variant.engine_logits(ctx.greedy_prompts, ctx.cfg.evals.greedy_tokens)
    acc = FidelityAccumulator()
    with torch.inference_mode():
        for prompt, out, test in zip(ctx.greedy_prompts, outputs, logits):
            seq = torch.tensor([prompt + out[:-1]], device=ctx.cfg.model.device)
            ref = ctx.model(seq)[0, len(prompt) - 1 :].cpu()
            acc.add(ref, test[: ref.shape[0]].cpu(), torch.tensor(out[: ref.shape[0]]))
    return acc.result().to_dict(), outputs


def time_pair(ctx: Context, variant: Variant) -> dict:
    """Median wall time of baseline and variant over the bench prompts, alternating order each repeat."""
    b = ctx.cfg.bench
    prompts = ctx.bench_prompts[: max(b.prompts, variant.bench_batch)]
    base = variant.baseline_timed or plain_generate(ctx.model)
    times: dict[str, list[float]] = {"baseline": [], "variant": []}
    with bench_section():
        threads = torch.get_num_threads()
        for _ in range(b.warmup):
            base(prompts[: variant.bench_batch], 2)
            variant.timed(prompts[: variant.bench_batch], 2)
        for r in range(b.repeats):
            order = [("baseline", base), ("variant", variant.timed)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fn(prompts, b.new_tokens)
                times[name].append(time.perf_counter() - t0)
    tokens = len(prompts) * b.new_tokens
    base_s, var_s = statistics.median(times["baseline"]), statistics.median(times["variant"])
    return {
        "baseline": variant.baseline_name,
        "baseline_s": base_s,
        "variant_s": var_s,
        "speedup": base_s / var_s,
        "baseline_tokens_per_s": tokens / base_s,
        "variant_tokens_per_s": tokens / var_s,
        "prompts": len(prompts),
        "prompt_tokens": b.prompt_tokens,
        "new_tokens": b.new_tokens,
        "repeats": b.repeats,
        "times_s": times,
        "threads": threads,
    }


def check_claim(claim: str, fid: dict | None, greedy: dict | None) -> str:
    """Whether the measurements are consistent with the claimed lossless class (a claim that fails shows)."""
    if fid is None or greedy is None:
        return "not measured"
    ident, match = fid["bit_identical"], greedy["match_rate"]
    if claim == "exact":
        return "verified: bit-identical logits" if ident and match == 1 else "REFUTED: logits differ"
    if claim == "same math":
        if ident:
            return "bit-identical here (exact)"
        ok = fid["max_abs_dlogprob"] < 1e-3 and fid["top1_agreement"] >= 0.999
        return "consistent: float-order noise" if ok else "CHECK: differences exceed float noise"
    if claim == "same distribution":
        return "greedy identical" if match == 1 else "REFUTED: greedy outputs differ"
    return "changes the model"


def on_device(scorer, device: str):
    """A scorer fed token batches built on the CPU (evals.quality.fidelity builds them there) that runs on the model's
    device and returns its logits to the CPU."""
    return scorer if device == "cpu" else lambda tokens: scorer(tokens.to(device)).cpu()


def text_windows(ctx: Context, text: str) -> list[list[int]]:
    """evals.text_windows windows of evals.text_seqlen tokens from the eval split of a text, tokenized once."""
    key = f"text:{text}"
    if key not in ctx.cache:
        ev = ctx.cfg.evals
        text_ids = CachedTokenizer(ctx.tokenizer)
        ctx.cache[key] = token_windows(text_ids, load_text(text, "eval"), ev.text_seqlen, ev.text_windows)
    return ctx.cache[key]


def quality(ctx: Context, row: Row, variant: Variant, res: dict) -> tuple[dict, dict]:
    """The evaluation columns into res: teacher-forced fidelity (and per-text perplexity), greedy match, tasks.
    Returns (fidelity, greedy match)."""
    cfg = ctx.cfg
    if variant.scorer is not None:
        ref, test = (on_device(s, cfg.model.device) for s in (model_scorer(ctx.model), variant.scorer))
        fid = compare_teacher_forced(ref, test, ctx.fidelity_seqs).to_dict()
        if cfg.evals.texts:
            res["texts"] = {
                t: compare_teacher_forced(ref, test, text_windows(ctx, t)).to_dict() for t in cfg.evals.texts
            }
        outputs = variant.greedy(ctx.greedy_prompts, cfg.evals.greedy_tokens)
    else:
        fid, outputs = engine_fidelity(ctx, variant)
    fid["sequences"] = "wiki eval windows" if variant.scorer is not None else "engine greedy outputs"
    greedy = token_match(ctx.ref_greedy(), outputs).to_dict()
    if ctx.spec_stats:
        res["speculation"] = ctx.spec_stats
        ctx.spec_stats = None
    res["fidelity"], res["greedy"] = fid, greedy
    if cfg.evals.tasks and variant.lm_factory is not None and ctx.tokenizer is not None:
        log(f"row {row.name}: tasks {cfg.evals.tasks}")
        res["tasks"] = run_tasks(
            variant.lm_factory(),
            cfg.evals.tasks,
            limit=cfg.evals.task_limit,
            n_docs=cfg.evals.task_docs,
            bootstrap_iters=cfg.evals.bootstrap_iters,
            seed=cfg.seed,
        )["results"]
    return fid, greedy


def humaneval(ctx: Context, row: Row, variant: Variant, res: dict) -> dict:
    """HumanEval pass@1 with its 95% Wilson interval (evals.quality.humaneval) of the row's own model, where it is one
    checkpoint-backed model run by plain decoding; completions and results are cached per checkpoint, in-memory
    recipe and settings, so a rerun recomputes nothing. Other rows: why they carry the reference's figure or none."""
    if variant.source is None:
        return humaneval_by_claim(row, res)
    section, src = ctx.cfg.evals.humaneval, variant.source
    problems = select(load_problems(), section.subset, section.limit)
    settings = GenSettings(
        section.max_new_tokens, dtype=src.dtype, device=ctx.cfg.model.device, batch_size=section.batch_size
    )
    limits = Limits()
    checkpoint = checkpoint_identity(src.path)
    if src.recipe:  # an in-memory change after loading: its own cache entries
        checkpoint += "-" + hashlib.sha256(src.recipe.encode()).hexdigest()[:8]
    cache = Cache.for_run(checkpoint, settings, limits)
    log(f"row {row.name}: HumanEval pass@1 on {len(problems)} problems ({cache.root})")
    model = variant.model if variant.humaneval_model is None else variant.humaneval_model
    ev = evaluate(problems, cache, lambda: (model, ctx.tokenizer), settings, limits, log=lambda m: log(f"  {m}"))
    log(f"row {row.name}: HumanEval {score_line(ev.passed, len(ev.results))}")
    return {
        **ev.summary(),
        "subset": section.subset,
        "limit": section.limit,
        "checkpoint": checkpoint,
        "recipe": src.recipe,
        "settings": dataclasses.asdict(settings),
        "limits": dataclasses.asdict(limits),
        "generated": ev.generated,
        "executed": ev.executed,
        "cache": str(cache.root),
        "results": {r.task_id: r.status for r in ev.results},
    }


def humaneval_by_claim(row: Row, res: dict) -> dict:
    """A row that changes how the reference decodes, not its model: a lossless one whose greedy output matched the
    reference's here has the reference's pass@1 (HumanEval is greedy), not recomputed; any other is not measured."""
    if row.lossless_class == "approximate":
        why = f"a {row.kind} row changes how the model decodes, not its checkpoint; "
        why += "evals.quality.humaneval decodes plainly"
        return {"not_measured": why}
    claim, match = res.get("claim_check", ""), (res.get("greedy") or {}).get("match_rate")
    if match != 1.0 or claim.startswith("REFUTED") or res.get("suite_not_identical"):
        seen = "not measured" if match is None else f"{100 * match:.1f}% greedy match"
        why = f"lossless ({row.lossless_class}) but its greedy output differed from the reference's here ({seen})"
        return {"not_measured": f"{why}: its pass@1 is not assumed equal to the reference's"}
    why = f"{row.lossless_class}: greedy output identical to the reference's on every greedy prompt ({claim})"
    return {"same_as_reference": True, "why": f"{why}; HumanEval is greedy, so its pass@1 is the reference's"}


def row_verdict(ctx: Context, row: Row, variant, fid: dict | None) -> dict | None:
    """The row's class as evals.speculation.verdict decides it (evals.speculation.lossless), for "lossless?": a
    speculator by the two-token distribution test of its sampled output (evals.verdict_samples runs; once per
    speculator, whatever the row's temperature); a model or decoding change by its teacher-forced logits against
    the reference (bit-identical / same math / approximate, "not lossless" where the row claims lossless).
    None: not tested."""
    claimed = row.lossless_class != "approximate"
    if variant.speculator is not None:
        samples = ctx.cfg.evals.verdict_samples
        if samples <= 0:
            return None
        key = "verdict:" + repr(sorted(variant.speculator.describe().items()))
        if key not in ctx.cache:
            log(f"row {row.name}: verdict (two-token test, {samples} runs)")
            test = TwoTokenTest(samples=samples, seed=ctx.cfg.seed)
            spec = variant.speculator
            ctx.cache[key] = speculator_verdict(ctx.model, spec, row.name, ctx.greedy_prompts, test).to_dict()
        return ctx.cache[key]
    if fid is None:
        return None
    verdict = deterministic_class(fid["bit_identical"], fid["max_abs_dlogprob"], claimed)
    return {"verdict": verdict, "claimed_lossless": claimed, "max_abs_dlogprob": fid["max_abs_dlogprob"]}


def run_row(ctx: Context, row: Row) -> dict:
    cfg = ctx.cfg
    started = time.time()
    record = {"row": dataclasses.asdict(row), "status": "ok", "results": {}}
    log(f"row {row.name} ({row.kind})")
    try:
        variant = ROWS[row.kind](ctx, row.params)
    except RowUnavailable as err:
        status = "skipped" if isinstance(err, RowSkipped) else "wired, not run"
        log(f"row {row.name}: {status}: {err}")
        return {**record, "status": status, "reason": str(err)}
    res = record["results"]
    res["weight_bytes"] = weight_bytes(variant.model)
    res["bytes_per_weight"] = linear_bytes_per_weight(variant.model)
    res.update(variant.extra)
    fid = greedy = None
    if row.run_evals:
        fid, greedy = quality(ctx, row, variant, res)
    if row.run_bench:
        log(f"row {row.name}: timing against {variant.baseline_name}")
        res["speed"] = time_pair(ctx, variant)
        if ctx.spec_stats:  # acceptance at the timed temperature
            res["speculation_timed"] = ctx.spec_stats
            ctx.spec_stats = None
    res["claim_check"] = check_claim(row.lossless_class, fid, greedy)
    if row.run_evals:
        res["verdict"] = row_verdict(ctx, row, variant, fid)
    if row.run_evals and row.run_humaneval and cfg.evals.humaneval is not None:
        res["humaneval"] = humaneval(ctx, row, variant, res)
    res["row_seconds"] = time.time() - started
    return record
