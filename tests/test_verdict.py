"""evals.speculation.lossless / evals.speculation.verdict: each class is decided by what it claims, on tiny random
models (seconds)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from evals.quality.fidelity import model_scorer
from evals.speculation import lossless
from evals.speculation.testing import assert_same_distribution, tiny_prompts, tiny_target
from evals.speculation.verdict import main as verdict_main
from quantize import int8 as int8_module
from quantize.registry import build as build_quantizer
from runtime.model import random_model
from speculate.base import Proposal, Speculator
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from speculate.registry import BuildContext
from speculate.registry import build as build_speculator
from tests.tiny_models import TINY_CONFIGS

SEQUENCES = torch.randint(1, 96, (3, 24), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY_CONFIGS["llama"], seed=0)


def test_classes_and_exit_codes():
    assert lossless.deterministic_class(True, 0.0, claimed=True) == "bit-identical"
    assert lossless.deterministic_class(False, lossless.SAME_MATH_NATS, claimed=True) == "same math"
    assert lossless.deterministic_class(False, 0.1, claimed=True) == "not lossless"
    assert lossless.deterministic_class(False, 0.1, claimed=False) == "approximate"
    codes = {v: lossless.Verdict("c", "b", v, True).exit_code for v in lossless.EXIT_CODES}
    assert codes == {"bit-identical": 0, "same math": 0, "same distribution": 0, "approximate": 1, "not lossless": 2,
                     "inconclusive": 3}  # fmt: skip


def test_same_model_is_bit_identical_and_a_perturbed_one_is_not(tiny):
    same = lossless.teacher_forced_verdict("x", "y", model_scorer(tiny), model_scorer(tiny), SEQUENCES, claimed=True)
    assert same.verdict == "bit-identical" and same.figures["mean_kl"] == 0.0
    nudged = copy.deepcopy(tiny)
    with torch.no_grad():  # a reassociation-sized change: one ulp-ish nudge of one weight matrix
        w = nudged.layers[0].mlp.down_proj.weight
        w.copy_(w * (1 + 2e-7))
    tiny_change = lossless.teacher_forced_verdict("x", "y", model_scorer(tiny), model_scorer(nudged), SEQUENCES, True)
    assert tiny_change.verdict == "same math", tiny_change.figures
    with torch.no_grad():
        w.copy_(w * 1.5)
    big = lossless.teacher_forced_verdict("x", "y", model_scorer(tiny), model_scorer(nudged), SEQUENCES, True)
    assert big.verdict == "not lossless" and big.figures["max_abs_dlogprob_vocab"] > lossless.SAME_MATH_NATS


def test_int8_quantizer_verdict_is_approximate_with_the_int8_modules_figures(tiny):
    v = lossless.quantizer_verdict(tiny, "int8", SEQUENCES)
    assert v.verdict == "approximate" and v.exit_code == 1 and v.figures["quant_config"]["bits"] == 8
    # the registry's int8 is quantize.int8's: the same codes give the same logits
    oracle, _ = int8_module.quantize_model(copy.deepcopy(tiny))
    ours = build_quantizer("int8").quantize_model(copy.deepcopy(tiny), lossless_cfg())
    tokens = torch.tensor(SEQUENCES)
    with torch.no_grad():
        assert torch.equal(ours(tokens), oracle(tokens))


def lossless_cfg():
    from quantize.config import QuantConfig

    return build_quantizer("int8").config(QuantConfig())


def test_kv_verdicts(tiny):
    assert lossless.kv_verdict(tiny, "auto", SEQUENCES).verdict == "bit-identical"
    v = lossless.kv_verdict(tiny, "int8", SEQUENCES)
    assert v.verdict == "approximate" and 0 < v.figures["mean_kl"] < 0.1 and v.figures["top1_agreement"] > 0.5


@pytest.mark.parametrize("flag", ["--speculator", "--quantizer"])
def test_verdict_cli_refuses_a_bad_method_before_loading(flag, capsys, monkeypatch):
    monkeypatch.setattr("evals.speculation.verdict.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exc:
        verdict_main([flag, "nosuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"unknown {flag[2:]} 'nosuch'" in err[0]


# ---- speculators: the test must see drafts ------------------------------------------------------------------


class NeverDrafts(Speculator):
    """Proposes nothing, ever: plain decoding in a speculator's clothes."""

    name = "never"

    def max_tokens_per_step(self) -> int:
        return 3

    def propose(self, state):
        zeros = torch.zeros(len(state.ids), 2, dtype=torch.long, device=state.device)
        return Proposal(tokens=zeros, num_drafted=zeros[:, 0])


def small_test(samples: int = 600) -> lossless.TwoTokenTest:
    return lossless.TwoTokenTest(samples=samples, top_k=0)  # the tiny target's 48 tokens are all in play


def test_ngram_verdict_is_judged_where_prompt_lookup_drafts():
    target, prompts = tiny_target(), tiny_prompts()
    # the tiny random target accepts ~0.6 % of these drafts (its mass spread over 48 tokens): 2400 samples draw ~460
    # drafts, ~3 accepted in expectation (600 drew ~110, 0-2 accepted depending on the sampler's draws)
    v = lossless.speculator_verdict(target, NgramSpeculator(k=2), "ngram", prompts, small_test(2400), greedy_tokens=8)
    context = v.figures["context"]
    # oracle independent of speculate.ngram: lookup drafts after the first sampled token t1 only if t1 occurred in
    # the context, so the target must put mass on the context's tokens there
    with torch.no_grad():
        p = target(torch.tensor([context]))[0, -1].softmax(-1)
    assert float(p[torch.tensor(sorted(set(context)))].sum()) > 0.05, context
    assert v.figures["drafted"] >= lossless.MIN_DRAFT_RATE * v.figures["samples"] and v.figures["accepted"] > 0
    assert v.verdict == "same distribution" and v.exit_code == 0, v.figures


def test_a_speculator_that_never_proposes_is_inconclusive():
    v = lossless.speculator_verdict(tiny_target(), NeverDrafts(), "never", tiny_prompts(), small_test(), 8)
    assert v.figures["passed"] and v.figures["drafted"] == 0  # it is plain decoding: the test itself passes
    assert v.verdict == "inconclusive" and v.exit_code == 3
    with pytest.raises(AssertionError, match="inconclusive"):
        assert_same_distribution(lambda t: NeverDrafts(), samples=600)


def test_a_failed_test_is_decisive_whatever_was_drafted():
    figures = {"passed": False, "drafted": 0, "samples": 100}
    assert lossless.speculator_class(figures, claimed=True) == "not lossless"
    assert lossless.speculator_class(figures, claimed=False) == "approximate"
    assert lossless.speculator_class({**figures, "passed": True, "drafted": 4}, True) == "inconclusive"
    assert lossless.speculator_class({**figures, "passed": True, "drafted": 5}, True) == "same distribution"


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_speculators_are_judged_on_verified_trees(method):
    """A tree deeper than the tokens a run has left is withdrawn (Proposal.within): the test's runs are 2 + the
    tree's depth long, so the trees are verified (with 3-token runs these methods drafted nothing: inconclusive)."""
    target = tiny_target()
    spec = build_speculator(method, target, BuildContext(smoke=True))  # seeded random heads: the method alone
    assert spec.proposes_trees and spec.draft_depth() >= 2
    assert lossless.run_tokens(spec) == 2 + spec.draft_depth()
    v = lossless.speculator_verdict(target, spec, method, tiny_prompts(), small_test(), greedy_tokens=8)
    assert v.figures["run_tokens"] == 2 + spec.draft_depth()
    assert v.figures["drafted"] >= lossless.MIN_DRAFT_RATE * v.figures["samples"], v.figures
    assert v.verdict == "same distribution" and v.exit_code == 0, v.figures


def test_batched_probes_count_each_context_as_alone():
    """choose_context probes every candidate context in one batched call: per-row draft counts (SpecOutput) give
    each context the counts it gets alone, and they sum to the run's totals."""
    target, test = tiny_target(), small_test()
    contexts = lossless.candidate_contexts(target, tiny_prompts(), test.params(0))[:6]
    spec = NgramSpeculator(k=2)
    batched = lossless.probes(target, spec, contexts, test)
    assert batched == [lossless.probes(target, spec, [c], test)[0] for c in contexts]
    assert any(d for d, _ in batched)  # the tiny prompts repeat spans: prompt lookup proposes somewhere
    out = speculative_generate(target, contexts, [test.params(i) for i in range(len(contexts))], spec)
    assert sum(out.row_drafted) == out.stats.drafted and sum(out.row_accepted) == out.stats.accepted


def test_adaptive_budget_is_the_fewest_runs_with_full_power():
    """The verdict's default budget: the first of 500 / 1000 / 2000 runs at which every simulated test rejects the
    named bias (q reported at temperature 0.8); the figures state the runs used and that power."""
    target, prompts = tiny_target(), tiny_prompts()
    test = lossless.TwoTokenTest(samples=2000, top_k=0, adaptive=True)
    v = lossless.speculator_verdict(target, NgramSpeculator(k=2), "ngram", prompts, test, greedy_tokens=4)
    n, figures = v.figures["samples"], v.figures
    assert figures["adaptive_samples"] and figures["sample_budget"] == 2000 and n in (500, 1000, 2000)
    case = lossless.chain_case(target, target, figures["context"], test.params(0))
    smaller = [m for m in lossless.SAMPLE_LADDER if m < n]
    assert all(lossless.power_at(case, m, test) < 1.0 for m in smaller)
    assert n == 2000 or figures["power_vs_sharpened_0.8"] == 1.0
    assert v.verdict == "same distribution", figures


@pytest.mark.parametrize("method", ["ngram:k=2", "eagle"])
def test_a_test_run_is_one_step_whose_tokens_begin_the_full_run(method):
    """The two-token test runs one speculative step (max_steps=1): each row's tokens are the first tokens of the
    same seeded run left to finish (both tested tokens among them), rows cut short say so, and the step drafted
    what the full run's first step drafted (max_tokens still sizes it: a tree is proposed whole)."""
    target = tiny_target()
    spec = build_speculator(method, target, BuildContext(smoke=True))
    test = replace(small_test(), max_tokens=lossless.run_tokens(spec))
    context = lossless.candidate_contexts(target, tiny_prompts(), test.params(0))[0]
    params = [test.params(i) for i in range(24)]
    full = speculative_generate(target, [context] * 24, params, spec)
    cut = speculative_generate(target, [context] * 24, params, spec, max_steps=1)
    assert cut.stats.steps == 1 and full.stats.steps > 1
    for f, c, reason in zip(full.tokens, cut.tokens, cut.finish_reasons):
        assert len(c) >= 2 and c == f[: len(c)]
        assert reason == ("steps" if len(c) < len(f) else "length")
    assert cut.stats.drafted > 0
    with pytest.raises(ValueError, match="max_steps"):
        speculative_generate(target, [context], params[:1], spec, max_steps=0)
