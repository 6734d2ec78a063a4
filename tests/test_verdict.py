"""evals.speculation.lossless / evals.speculation.verdict: each class is decided by what it claims, on tiny random
models (seconds)."""

from __future__ import annotations

import copy

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
from speculate.ngram import NgramSpeculator
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
    v = lossless.speculator_verdict(target, NgramSpeculator(k=2), "ngram", prompts, small_test(), greedy_tokens=8)
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
