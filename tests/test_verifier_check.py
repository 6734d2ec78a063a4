"""evals.speculation.verifier_check: the exact two-token test of rejection sampling, and its broken controls.

Seeds are fixed; each check of a correct verifier uses alpha = 1e-3 (false-failure rate <= 1e-3 per context for a
fresh seed, asymptotic chi-square)."""

from __future__ import annotations

import pytest
import torch

from evals.speculation import chain_test as ct
from evals.speculation import verifier_check as vc
from runtime.sampling import SamplingParams


def hand_case() -> ct.ChainCase:
    """Three tokens; a draft that prefers token 2, a target that prefers token 0."""
    p1 = torch.tensor([0.6, 0.3, 0.1])
    q1 = torch.tensor([0.1, 0.2, 0.7])
    p2 = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    q2 = torch.tensor([[0.2, 0.2, 0.6], [0.6, 0.2, 0.2], [0.05, 0.05, 0.9]])
    return ct.ChainCase([10, 11, 12], p1, q1, p2, q2)


def test_the_exact_joint_is_the_targets_two_token_distribution():
    case = hand_case()
    joint = case.exact_joint()
    assert joint.sum().item() == pytest.approx(1.0)
    assert joint[0, 1].item() == pytest.approx(0.6 * 0.25) and joint[2, 2].item() == pytest.approx(0.1 * 0.4)


def test_rejection_sampling_emits_the_target_joint_and_the_controls_do_not():
    case = hand_case()
    counts = ct.simulate(case, 40000, seed=0)
    assert counts.sum().item() == 40000
    assert ct.chi_square_pvalue(counts, case.exact_joint()) > 1e-3
    # the empirical joint is close to the exact one cell by cell (4 sigma of a binomial at n = 40000)
    assert torch.allclose(counts / 40000, case.exact_joint().double(), atol=4 * (0.25 / 40000) ** 0.5)
    sharp = ct.simulate(case, 40000, seed=0, report=ct.sharpened)
    from_p = ct.simulate(case, 40000, seed=0, verify=ct.verify_from_p)
    assert ct.chi_square_pvalue(sharp, case.exact_joint()) < 1e-6
    assert ct.chi_square_pvalue(from_p, case.exact_joint()) < 1e-6


def test_a_draft_equal_to_the_target_is_always_accepted():
    case = hand_case()
    same = ct.ChainCase(case.tokens, case.p1, case.p1, case.p2, case.p2)
    counts = ct.simulate(same, 5000, seed=1)
    assert ct.chi_square_pvalue(counts, same.exact_joint()) > 1e-3


def test_chain_case_reads_the_models_distributions_on_a_tiny_pair():
    args = vc.parse_args(["--smoke", "--prompts", "1", "--samples", "1000"])
    target, draft, contexts = vc.load_pair(args)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    case = ct.chain_case(target, draft, contexts[0], params)
    with torch.no_grad():
        p1 = ct.last_probs(target, contexts, params)[0]
        t = case.tokens[int(case.p1.argmax())]
        p2 = ct.last_probs(target, [contexts[0] + [t]], params)[0]
    assert torch.equal(case.p1, p1[case.tokens]) and p1[case.tokens].sum().item() == pytest.approx(1.0)
    assert torch.allclose(case.p2[int(case.p1.argmax())], p2[case.tokens], atol=1e-6)  # computed in a batch


def test_cli_smoke_passes_the_verifier_and_rejects_both_controls(capsys):
    record = vc.main(["--smoke", "--prompts", "3", "--samples", "20000"])
    assert record["lossless"] and all(record["controls_rejected"].values())
    assert "LOSSLESS" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        vc.main(["--smoke", "--temperature", "0"])


def test_the_cut_keeps_both_models_supports_within_the_limit(monkeypatch):
    monkeypatch.setattr(ct, "MAX_SUPPORT", 40)
    args = vc.parse_args(["--smoke", "--prompts", "2", "--samples", "1000"])
    target, draft, contexts = vc.load_pair(args)
    params = SamplingParams(temperature=0.7, top_p=0.6)
    ids = contexts[0] * 3
    cut = ct.entropy_cut(target, draft, ids, params)
    case = ct.chain_case(target, draft, ids[:cut], params)  # raises when the union is over MAX_SUPPORT
    assert 1 <= cut <= len(ids) and int(((case.p1 > 0) | (case.q1 > 0)).sum()) <= 40
