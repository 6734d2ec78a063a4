"""Is a candidate lossless? The statistics behind ``python -m evals.speculation.verdict`` and
``evals.speculation.testing``'s asserts.

A candidate is compared with a baseline and put in one class:

- **bit-identical**: every logit equal, bit for bit;
- **same math**: every log-probability within ``SAME_MATH_NATS`` (1e-3 nats) of the baseline's: the float
  reassociation bound. A reassociation-sized change (one weight matrix scaled by 1 + 2e-7, tests/test_verdict.py)
  stays far inside it; int8 weights move SmolLM2-135M's log-probabilities by up to 2.3 nats (notes/issue-38.md);
- **same distribution** (speculators): sampled output passes an exact two-token chi-square test against the target's
  own distribution (``two_token_test``);
- **approximate**: none of these; the record carries mean KL, top-1 agreement and the perplexity delta;
- **inconclusive** (speculators): the test passed but the speculator proposed (almost) nothing in its sampled runs
  (fewer than ``MIN_DRAFT_RATE`` drafts per run): plain decoding passes the test, so it proves nothing.

A candidate that claims to be lossless (a speculator whose ``lossless`` is true, engine batching) and is classified
approximate is **not lossless**. Exit codes (``Verdict.exit_code``): 0 bit-identical, same math or same
distribution; 1 approximate (and not claimed lossless); 2 not lossless where claimed lossless; 3 inconclusive.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from evals.quality.fidelity import TeacherForcedStats, cached_scorer, compare_teacher_forced, engine_greedy_logits
from evals.quality.fidelity import model_scorer as plain_scorer
from evals.quality.lm_eval_tasks import run_tasks
from evals.speculation.chain_test import MAX_SUPPORT, chain_case, chi_square_pvalue, sharpened, simulate
from quantize.config import QuantConfig
from quantize.registry import build as build_quantizer
from quantize.registry import calibrated
from runtime.data import load_text, mixed_calibration_windows, token_windows
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_policy import KVCacheSpec
from runtime.sampling import SamplingParams, logits_to_probs
from speculate.generate import speculative_generate
from speculate.registry import BuildContext, check_method
from speculate.registry import build as build_speculator

SAME_MATH_NATS = 1e-3  # |Δ log p| bound for "same math" (module docstring)
ALPHA = 1e-3  # false-failure rate of the distribution test (asymptotic chi-square, one test per verdict)
SAMPLES = 2000  # speculative runs of the two-token test (the budget, when adaptive)
SAMPLE_LADDER = (500, 1000)  # the adaptive test's smaller budgets, tried in order
SHARPEN = 0.8  # the named bias the power is stated against: q reported at this temperature
CHUNK = 500  # speculative rows per batch
POWER_REPLICATES = 40  # simulated tests of that bias for the stated power
MIN_DRAFT_RATE = 0.05  # drafted tokens per sampled run below which a passed test is inconclusive
PROBE_ROWS = 8  # seeded runs that probe whether a speculator drafts at a candidate context
PROBE_LIMIT = 32  # candidate contexts probed, most uncertain first (each costs PROBE_ROWS one-step runs)
PROBE_BATCH = 8  # contexts probed per batched call (the first batch with an accepted draft ends the search)
PROBE_SEED = 1_000_000  # probe rows' seeds are offset from the test's, so choosing a context sees no test sample
EXIT_CODES = {
    "bit-identical": 0,
    "same math": 0,
    "same distribution": 0,
    "approximate": 1,
    "not lossless": 2,
    "inconclusive": 3,
}


@dataclass
class Verdict:
    candidate: str
    baseline: str
    verdict: str  # a key of EXIT_CODES
    claimed_lossless: bool
    figures: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict:
        return {
            "candidate": self.candidate,
            "baseline": self.baseline,
            "verdict": self.verdict,
            "claimed_lossless": self.claimed_lossless,
            "exit_code": self.exit_code,
            **self.figures,
        }


def deterministic_class(bit_identical: bool, max_dlogprob: float, claimed: bool, bound: float = SAME_MATH_NATS) -> str:
    if bit_identical:
        return "bit-identical"
    if max_dlogprob <= bound:
        return "same math"
    return "not lossless" if claimed else "approximate"


# ---- deterministic candidates: logits against the baseline's on the same tokens ----------------------------


def stats_figures(stats: TeacherForcedStats) -> dict:
    d = stats.to_dict()
    keep = (
        "positions",
        "max_abs_dlogprob_vocab",
        "mean_kl",
        "max_kl",
        "top1_agreement",
        "ref_perplexity",
        "test_perplexity",
    )
    return {**{k: d[k] for k in keep}, "perplexity_delta": d["test_perplexity"] - d["ref_perplexity"]}


def teacher_forced_verdict(name: str, baseline: str, ref, test, sequences, claimed: bool) -> Verdict:
    """ref / test: scorers [B, T] ids -> [B, T, V] logits (evals.quality.fidelity) on the same sequences."""
    stats = compare_teacher_forced(ref, test, sequences)
    figures = {**stats_figures(stats), "same_math_bound_nats": SAME_MATH_NATS}
    verdict = deterministic_class(stats.bit_identical, stats.max_abs_dlogprob_vocab, claimed)
    return Verdict(name, baseline, verdict, claimed, figures)


def quantizer_verdict(
    model, method: str, sequences, task: TaskProbe | None = None, calibration: torch.Tensor | None = None
) -> Verdict:
    """An in-memory quantizer of quantize.registry (reference path: the quantization error alone) vs the model;
    with ``task``, an approximate one also reports its task delta. A calibrated one (CalibratedQuantizer) learns
    from ``calibration`` tokens [N, T] (the wiki calibration split: no eval window among them)."""
    quantizer = build_quantizer(method)
    cfg = quantizer.config(QuantConfig(bits=4, group_size=64))
    if calibrated(quantizer):
        quantized = quantizer.quantize_model(copy.deepcopy(model), cfg, calibration)
    else:
        quantized = quantizer.quantize_model(copy.deepcopy(model), cfg)
    v = teacher_forced_verdict(
        f"quantizer {method}",
        "the unquantized model",
        plain_scorer(model),
        plain_scorer(quantized),
        sequences,
        claimed=False,
    )
    v.figures["quant_config"] = cfg.to_dict()
    if calibrated(quantizer):
        v.figures["calibration"] = {"text": "wiki", "windows": len(calibration), "seqlen": calibration.shape[1]}
    if task is not None and v.verdict in ("approximate", "not lossless"):
        v.figures.update(task_delta(model, quantized, task))
    return v


@dataclass
class TaskProbe:
    """One offline lm-eval task (evals.quality.wiki_tasks) scored on the baseline and the candidate: the task delta
    of an approximate verdict (a figure beside KL and perplexity, with both accuracies' standard errors)."""

    tokenizer: object
    name: str = "qspec_wiki_title"
    limit: int = 200  # documents
    seed: int = 0


def task_delta(model, candidate, task: TaskProbe) -> dict:
    """Accuracy of the model and of the candidate on task.name's first task.limit documents; their difference."""
    from evals.quality.lm_eval_adapter import QspecLM  # lm-eval is imported only when a task delta is asked for

    acc = {}
    for label, m in (("baseline", model), ("candidate", candidate)):
        res = run_tasks(QspecLM(m, task.tokenizer), [task.name], limit=task.limit, bootstrap_iters=100, seed=task.seed)
        acc[label] = res["results"][task.name]["acc"]
    return {
        "task": task.name,
        "task_documents": task.limit,
        "task_acc_baseline": acc["baseline"]["value"],
        "task_acc_candidate": acc["candidate"]["value"],
        "task_acc_stderr": acc["candidate"]["stderr"],
        "task_delta": acc["candidate"]["value"] - acc["baseline"]["value"],
    }


def kv_verdict(model, dtype: str, sequences) -> Verdict:
    """The model through a KV cache of `dtype` vs a full-precision one: half of each sequence prefilled, the rest
    decoded one token at a time, every token read back from the cache (evals.quality.fidelity.cached_scorer)."""
    test = cached_scorer(model, kv=KVCacheSpec(dtype))
    claimed = dtype == "auto"
    return teacher_forced_verdict(
        f"KV cache {dtype}", "the full-precision KV cache", cached_scorer(model), test, sequences, claimed
    )


def engine_batch_verdict(model, tokenizer, prompts, batch: int, max_tokens: int) -> Verdict:
    """Greedy in the serving engine: `batch` requests at once vs one at a time. Logits are compared step by step up
    to each request's first differing token (after it the sequences are unrelated). Claimed lossless."""
    runs = [
        engine_greedy_logits(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=n)), prompts, max_tokens, n > 1)
        for n in (1, batch)
    ]
    (ref_tokens, ref_logits), (test_tokens, test_logits) = runs
    identical, worst, same_tokens = True, 0.0, 0
    for r, t, lr, lt in zip(ref_tokens, test_tokens, ref_logits, test_logits):
        n = next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r))
        same_tokens += n
        steps = min(n + 1, len(lr), len(lt))  # the first differing token's logits are still comparable
        identical &= n == len(r) and torch.equal(lr, lt)
        worst = max(worst, float((lr[:steps].log_softmax(-1) - lt[:steps].log_softmax(-1)).abs().max()))
    total = sum(len(r) for r in ref_tokens)
    figures = {
        "prompts": len(prompts),
        "tokens": total,
        "greedy_token_match": same_tokens / total,
        "max_abs_dlogprob_vocab": worst,
        "same_math_bound_nats": SAME_MATH_NATS,
    }
    verdict = deterministic_class(identical, worst, claimed=True)
    return Verdict(f"engine batch {batch}", "engine batch 1", verdict, True, figures)


# ---- speculators: an exact two-token test of sampled output ------------------------------------------------


@dataclass
class TwoTokenTest:
    """n speculative runs on one fixed context, each row seeded (seed + row); their first two tokens are compared
    with the target's exact joint p(t1) p(t2 | t1) by chi-square (cells expected < 5 pooled). t1 is the prefill's
    sample and t2 the first speculative step's first token (its first draft accepted, or the verifier's
    residual / bonus draw in its place), so a run is one speculative step (``max_steps=1``): later tokens would
    not change t1 or t2. ``max_tokens`` only sizes that step's drafts: a chain is cut to the tokens left and a
    tree withdrawn where it is deeper, so runs are 3 tokens long, or 2 + a tree speculator's depth
    (``run_tokens``), and every speculator drafts in full."""

    samples: int = SAMPLES
    alpha: float = ALPHA
    temperature: float = 1.0
    top_k: int = 50  # a finite support (exact joint: one forward per first token); top-k is cheaper than top-p
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 3
    # adaptive: the fewest runs of SAMPLE_LADDER (up to ``samples``) at which all POWER_REPLICATES simulated tests
    # reject the named bias (power_at == 1): a context that tells distributions apart quickly needs fewer runs
    adaptive: bool = False

    def params(self, row: int) -> SamplingParams:
        t, k, p, n = self.temperature, self.top_k, self.top_p, self.max_tokens
        return SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=n, ignore_eos=True, seed=self.seed + row)


def run_tokens(speculator) -> int:
    """Tokens per run of the two-token test (TwoTokenTest): 3, or 2 + the tree's depth for a tree speculator
    (speculate.base.Speculator.proposes_trees / draft_depth), so that its trees are verified, not withdrawn."""
    if not getattr(speculator, "proposes_trees", False):
        return 3
    return max(3, 2 + speculator.draft_depth())


def candidate_contexts(target, prompts: list[list[int]], params: SamplingParams, min_tokens: int = 2) -> list:
    """Every prompt prefix of at least min_tokens whose top-k/top-p support is at most MAX_SUPPORT first tokens (the
    exact joint takes one forward per first token), most uncertain first: a near-deterministic context would pass
    any speculator."""
    scored = []
    for ids in prompts:
        with torch.no_grad():
            probs = logits_to_probs(target(torch.tensor([ids]))[0], params).double()  # [T, V]
        for pos in range(min_tokens - 1, len(ids)):
            p = probs[pos][probs[pos] > 0]
            if p.numel() <= MAX_SUPPORT:
                scored.append((float(-(p * p.log()).sum()), ids[: pos + 1]))
    if not scored:
        raise ValueError(f"no prompt prefix has a support of at most {MAX_SUPPORT} tokens: lower --top-k or --top-p")
    scored.sort(key=lambda c: -c[0])
    return [ctx for _, ctx in scored]


def probes(target, speculator, contexts: list[list[int]], test: TwoTokenTest) -> list[tuple[int, int]]:
    """(drafted, accepted) per context over PROBE_ROWS short seeded runs each (seeds apart from the test's), all
    in one batched call: a row's draws and drafts do not depend on its batch mates (speculate.generate)."""
    prompts = [ctx for ctx in contexts for _ in range(PROBE_ROWS)]
    params = [test.params(PROBE_SEED + i) for _ in contexts for i in range(PROBE_ROWS)]
    out = speculative_generate(target, prompts, params, speculator, max_steps=1)
    rows = range(0, len(prompts), PROBE_ROWS)
    return [(sum(out.row_drafted[r : r + PROBE_ROWS]), sum(out.row_accepted[r : r + PROBE_ROWS])) for r in rows]


def choose_context(target, prompts: list[list[int]], params: SamplingParams, speculator=None, test=None) -> list:
    """The most uncertain candidate context (candidate_contexts); with a speculator, the most uncertain one where it
    drafts (and has a draft accepted, if any does) among the first PROBE_LIMIT: a test where nothing was proposed
    tests only plain decoding (a prompt-lookup method drafts only where the context repeats itself)."""
    candidates = candidate_contexts(target, prompts, params)
    if speculator is None:
        return candidates[0]
    drafting = None
    for start in range(0, min(PROBE_LIMIT, len(candidates)), PROBE_BATCH):
        batch = candidates[start : min(start + PROBE_BATCH, PROBE_LIMIT)]
        counts = probes(target, speculator, batch, test or TwoTokenTest())
        accepting = [ctx for ctx, (drafted, accepted) in zip(batch, counts) if drafted and accepted]
        if accepting:
            return accepting[0]
        drafting = drafting or next((ctx for ctx, (drafted, _) in zip(batch, counts) if drafted), None)
    return drafting or candidates[0]


def power_at(case, samples: int, test: TwoTokenTest) -> float:
    """The fraction of POWER_REPLICATES simulated tests of ``samples`` runs (evals.chain_test.simulate, the test's
    alpha) that reject a draft equal to the target which reports its q at temperature SHARPEN."""
    rejected = 0
    for r in range(POWER_REPLICATES):
        counts = simulate(case, samples, test.seed + 7919 * (r + 1), lambda q: sharpened(q, SHARPEN))
        rejected += chi_square_pvalue(counts, case.exact_joint()) < test.alpha
    return rejected / POWER_REPLICATES


def two_token_test(target, speculator, context: list[int], test: TwoTokenTest) -> dict:
    """Run the test (class docstring); the figures, with `passed`. Power is stated against a draft equal to the
    target that reports its q at temperature SHARPEN: the fraction of POWER_REPLICATES simulated tests
    (evals.speculation.chain_test.simulate, same n, same alpha) that reject it."""
    params0 = test.params(0)
    case = chain_case(target, target, context, params0)  # p1, p2 exact (the "draft" here is the target itself)
    samples = test.samples
    if test.adaptive:  # the fewest runs of the ladder at which every simulated test rejects the named bias
        samples = next((n for n in SAMPLE_LADDER if n < samples and power_at(case, n, test) == 1.0), samples)
    tokens, drafted, accepted = [], 0, 0
    for start in range(0, samples, CHUNK):  # rows are independent of their batch mates: chunks bound memory
        params = [test.params(i) for i in range(start, min(start + CHUNK, samples))]
        out = speculative_generate(target, [context] * len(params), params, speculator, max_steps=1)
        tokens += out.tokens
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index[torch.tensor(case.tokens)] = torch.arange(len(case.tokens))
    pairs = index[torch.tensor([row[:2] for row in tokens])]  # [n, 2] compact indices, -1: no mass
    impossible = int((pairs < 0).any(-1).sum())
    U = len(case.tokens)
    ok = pairs[(pairs >= 0).all(-1)]
    counts = torch.bincount(ok[:, 0] * U + ok[:, 1], minlength=U * U).reshape(U, U).double()
    p_value = 0.0 if impossible else chi_square_pvalue(counts, case.exact_joint())
    joint = case.exact_joint().flatten()
    tv = 0.5 * float((counts.flatten() / samples - joint).abs().sum())
    power = power_at(case, samples, test)
    return {
        "p_value": p_value,
        "alpha": test.alpha,
        "passed": p_value >= test.alpha,
        "samples": samples,
        "sample_budget": test.samples,
        "adaptive_samples": test.adaptive,
        "run_tokens": test.max_tokens,
        "impossible_pairs": impossible,
        "tokens_in_play": U,
        "context_tokens": len(context),
        "context": list(context),
        "empirical_tv": tv,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / max(drafted, 1),
        "power_vs_sharpened_0.8": power,
        "temperature": test.temperature,
        "top_k": test.top_k,
        "top_p": test.top_p,
    }


def greedy_match(target, speculator, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy speculative output vs plain greedy decoding, token for token (a figure: float noise at near-ties may
    flip a token without any bug)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = generate(target, prompts, params).tokens
    spec = speculative_generate(target, prompts, params, speculator).tokens
    same = sum(a == b for p, s in zip(plain, spec) for a, b in zip(p, s))
    return {
        "greedy_identical_sequences": sum(p == s for p, s in zip(plain, spec)),
        "greedy_sequences": len(plain),
        "greedy_token_agreement": same / max(1, sum(map(len, plain))),
    }


def speculator_verdict(
    target, speculator, name: str, prompts: list[list[int]], test: TwoTokenTest, greedy_tokens: int = 16
) -> Verdict:
    """A speculator against plain decoding of its target: the two-token test decides; greedy agreement is a figure."""
    claimed = bool(getattr(speculator, "lossless", True))
    test = replace(test, max_tokens=max(test.max_tokens, run_tokens(speculator)))
    context = choose_context(target, prompts, test.params(0), speculator, test)
    figures = {
        **two_token_test(target, speculator, context, test),
        **greedy_match(target, speculator, prompts, greedy_tokens),
    }
    figures["speculator"] = speculator.describe()
    verdict = speculator_class(figures, claimed)
    return Verdict(f"speculator {name}", "plain decoding of the target", verdict, claimed, figures)


def speculator_class(figures: dict, claimed: bool) -> str:
    """A failed test is decisive whatever was drafted; a pass only says something if drafts were proposed."""
    if not figures["passed"]:
        return "not lossless" if claimed else "approximate"
    if figures["drafted"] < MIN_DRAFT_RATE * figures["samples"]:
        return "inconclusive"
    return "same distribution"


# ---- one verdict, as the CLI asks for it ---------------------------------------------------------------------

PROMPTS = [  # short English prompts: the speculators' contexts and the engine's greedy requests
    "The best way to learn a new language is",
    "Once upon a time, in a small village by the sea, there lived",
    "Here are three tips for staying healthy:",
    "The main difference between a virus and a bacterium is",
    "def fibonacci(n):\n    ",
    "My favourite season of the year is",
    "The history of the Roman Empire began",
    "To make a good cup of coffee, you need",
    # its tail repeats an earlier span: where prompt lookup (and any copy-based method) proposes drafts
    "Roses are red, violets are blue, sugar is sweet, and so are you. Roses are red, violets are",
]


@dataclass
class Request:
    """What to judge: exactly one of speculator / quantizer / kv_cache_dtype / engine_batch."""

    speculator: str | None = None
    quantizer: str | None = None
    kv_cache_dtype: str | None = None
    engine_batch: int | None = None
    test: TwoTokenTest = field(default_factory=TwoTokenTest)
    random_heads: bool = False  # medusa / eagle with seeded random heads (the smoke build): judges the method alone
    windows: int = 8  # teacher-forced wiki eval windows (quantizer, KV)
    seqlen: int = 256
    greedy_tokens: int = 32  # engine batch: greedy tokens per prompt
    task_documents: int = 200  # an approximate quantizer's task delta (TaskProbe); 0: none
    calib_windows: int = 32  # a calibrated quantizer's data: windows of calib_seqlen tokens (wiki calibration split)
    calib_seqlen: int = 512

    def check(self) -> None:
        """Refuse a method that does not resolve or meet its contract (one ValueError line) without a model."""
        if self.speculator is not None:
            check_method(self.speculator)
        if self.quantizer is not None:
            build_quantizer(self.quantizer)


def judge(req: Request, model, tokenizer, path) -> Verdict:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    if req.speculator is not None:
        spec = build_speculator(req.speculator, model, BuildContext(target_path=path, smoke=req.random_heads))
        return speculator_verdict(model, spec, req.speculator, prompts, req.test)
    if req.engine_batch is not None:
        return engine_batch_verdict(model, tokenizer, prompts[: req.engine_batch], req.engine_batch, req.greedy_tokens)
    sequences = token_windows(tokenizer, load_text("wiki", "eval"), req.seqlen, req.windows)
    if req.quantizer is not None:
        probe = TaskProbe(tokenizer, limit=req.task_documents) if req.task_documents > 0 else None
        calibration = None
        if calibrated(build_quantizer(req.quantizer)):
            windows = mixed_calibration_windows(tokenizer, "wiki", req.calib_windows, req.calib_seqlen)
            calibration = torch.tensor(windows, dtype=torch.long)
        return quantizer_verdict(model, req.quantizer, sequences, probe, calibration)
    return kv_verdict(model, req.kv_cache_dtype, sequences)
