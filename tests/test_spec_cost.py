"""evals.speculation.spec_cost: the speedup formula, curve interpolation and the roofline against hand arithmetic,
profile files (measured and gpu_check), and a tiny measured curve."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from evals.speculation import cost_model
from evals.speculation.cost_model import (
    GPU,
    CostError,
    FixedDrafts,
    Profile,
    Shapes,
    choose_draft,
    choose_k,
    forward_time,
    load_profile,
    measure,
    predict_speedup,
    predict_suite,
    speedup_by_k,
    truncated_to_k,
)
from evals.speculation.specbench_suite import SMOKE_CONFIG, build_method
from quantize.qlinear import QuantLinear
from runtime.decoding import generate
from runtime.loader import load_model
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.base import SpecState, SpeculatorError
from speculate.draft import FALLBACK_DRAFT, default_draft_file, parse_draft_spec
from speculate.generate import speculative_generate


def test_curve_and_speedup_exact():
    p = Profile("x", "measured", {1: 1.0, 5: 2.0, 9: 2.5})
    assert p.verify(1) == 1.0 and p.verify(3) == 1.5 and p.verify(7) == 2.25 and p.verify(13) == 3.0
    # 3 tokens/step; half the steps feed 5 tokens (2.0 s), half 1 (1.0 s); draft 0.5 s: 3 / (0.5 + 1.5)
    assert predict_speedup(3.0, {5: 2, 1: 2}, 0.5, p) == 1.5
    assert predict_speedup(2.0, {9: 1}, 0.0, p) == 2.0 / 2.5
    with pytest.raises(CostError, match="T = 1"):
        Profile("bad", "measured", {4: 1.0})
    with pytest.raises(CostError, match="empty"):
        predict_speedup(2.0, {}, 0.0, p)


def simulated_row(method: str, seed: int, k: int, steps: int = 400) -> tuple[dict, list[tuple[int, int]]]:
    """A suite row counted as speculate.generate counts steps ((offered, accepted) per step: an n-gram-like
    speculator offers 0..k drafts, a draft model k), and the steps themselves."""
    gen = torch.Generator().manual_seed(seed)
    outcomes = []
    for _ in range(steps):
        offered = k if method == "draft" else int(torch.randint(0, k + 1, (1,), generator=gen))
        accepted = 0
        while accepted < offered and float(torch.rand(1, generator=gen)) < 0.75 - 0.1 * accepted:
            accepted += 1
        outcomes.append((offered, accepted))
    proposed_at = [sum(o > j for o, _ in outcomes) for j in range(k)]
    accepted_at = [sum(a > j for _, a in outcomes) for j in range(k)]
    hist: dict[str, int] = {}
    for o, _ in outcomes:
        hist[str(o + 1)] = hist.get(str(o + 1), 0) + 1
    row = {
        "method": method,
        "category": "overall",
        "batch": 1,
        "fed_tokens_hist": hist,
        "per_position_acceptance": [a / max(p, 1) for a, p in zip(accepted_at, proposed_at)],
        "tokens_per_step": 1 + sum(a for _, a in outcomes) / steps,
        "mean_fed_tokens": 1 + sum(o for o, _ in outcomes) / steps,
        "draft_s_per_step": 0.02 * sum(o for o, _ in outcomes) / steps,
        "decode_speedup_vs_plain": 1.3,
    }
    return row, outcomes


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_row_cut_to_smaller_k_equals_the_steps_cut_to_k(method):
    """The oracle: the simulated steps themselves with every step's drafts cut to k (min(offered, k) fed,
    min(accepted, k) accepted); truncated_to_k sees only the row's counts."""
    row, outcomes = simulated_row(method, seed=3, k=6)
    for k in range(1, 7):
        tokens, fed = truncated_to_k(row, k)
        assert tokens == pytest.approx(1 + sum(min(a, k) for _, a in outcomes) / len(outcomes), rel=1e-12)
        want: dict[int, int] = {}
        for o, _ in outcomes:
            want[1 + min(o, k)] = want.get(1 + min(o, k), 0) + 1
        assert fed == want
    assert truncated_to_k(row, 6)[0] == pytest.approx(row["tokens_per_step"], rel=1e-12)  # its own k: as measured


def test_speedup_by_k_and_the_best_k_by_hand():
    # c(T) of a compute-bound CPU: cheap to 4 rows, dear beyond; a draft token 0.05 s; every step offers 4 drafts
    p = Profile("cpu", "measured", {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 2.0})
    row = {"method": "d", "category": "overall", "batch": 1, "fed_tokens_hist": {"5": 10},
           "per_position_acceptance": [0.8, 0.6, 0.5, 0.4], "mean_fed_tokens": 5.0, "draft_s_per_step": 0.2,
           "decode_speedup_vs_plain": 1.0}  # fmt: skip
    curve = speedup_by_k(row, 0.05, p, [1, 2, 3, 4])
    want = [1.8 / 1.15, 2.4 / 1.3, 2.9 / 1.45, 3.3 / 2.2]  # tokens 1 + cumulative acceptance; k x 0.05 + c(k + 1)
    assert [c["predicted_speedup"] for c in curve] == pytest.approx(want, abs=1e-4)
    suite = {"rows": [row, {**row, "method": "medusa:tree=8"}, {**row, "method": "plain"}],
             "speculators": {"medusa:tree=8": {"tree_size": 8}}}  # fmt: skip
    (choice,) = choose_k(suite, p)  # trees and plain are not cut by k
    assert choice["best_k"] == 3 and choice["k_run"] == 4 and choice["draft_s_per_token"] == pytest.approx(0.05)
    with pytest.raises(CostError, match="no chain speculator"):
        choose_k(suite, p, category="qa")


def test_roofline_by_hand():
    s = Shapes(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
    assert s.layer_params() == 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8  # 144
    gpu = GPU("toy", bandwidth=1000.0, flops=1e6, per_forward_s=0.125, per_layer_s=0.0625)
    # T=1, context 3: weights 2*144*2 + 10*4*2 = 656 B, KV 2*2*1*2*4*2 = 64 B -> 0.72 s memory-bound
    assert forward_time(gpu, s, 1, 3) == pytest.approx(0.72 + 0.125 + 2 * 0.0625, rel=1e-12)
    fast_mem = GPU("toy", bandwidth=1e12, flops=1000.0, per_forward_s=0.0, per_layer_s=0.0)
    # compute-bound: 2*2*144*4 + 4*2*2*2*(3+4)*4 + 2*10*4*4 = 2304 + 896 + 320 FLOPs at 1000 FLOP/s
    assert forward_time(fast_mem, s, 4, 3) == pytest.approx(3.52, rel=1e-12)


def test_profile_files(tmp_path):
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"device": "H200", "verify_curve_ms": {"1": 8.0, "8": 10.0, "32": 10.0}}))
    p = load_profile(str(gpu))
    assert p.kind == "gpu_check" and p.verify(1) == 0.008 and p.verify(32) == 0.01
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "x"}))
    with pytest.raises(CostError, match="no cost curve"):
        load_profile(str(bad))
    with pytest.raises(CostError, match="neither a GPU name"):
        load_profile(str(tmp_path / "nope.json"))
    suite = {
        "rows": [
            {
                "batch": 1,
                "category": "qa",
                "method": "ngram:k=4",
                "tokens_per_step": 2.0,
                "fed_tokens_hist": {"1": 1, "8": 1},
                "draft_s_per_step": 0.001,
                "speedup_vs_plain": 1.6,
            }
        ]
    }
    (row,) = predict_suite(suite, p)
    assert row["predicted_speedup"] == pytest.approx(2.0 * 0.008 / (0.001 + 0.009), abs=1e-4)
    assert row["error"] is None  # a GPU profile is not compared with the CPU's measured speedup
    measured = Profile("cpu", "measured", {1: 0.01, 8: 0.02}, {"ngram:k=4": 0.0})
    (row,) = predict_suite(suite, measured)
    assert row["predicted_speedup"] == pytest.approx(2.0 * 0.01 / 0.015, abs=1e-4)
    assert row["error"] == pytest.approx(round(row["predicted_speedup"] / 1.6 - 1, 4))
    suite["rows"][0]["decode_speedup_vs_plain"] = 1.9  # a record with the decode phase: checked against that
    (row,) = predict_suite(suite, measured)
    assert row["measured_speedup"] == 1.9
    assert row["error"] == pytest.approx(row["predicted_speedup"] / 1.9 - 1, abs=2e-4)


def test_measure_tiny():
    model = random_model(SMOKE_CONFIG, seed=0)
    sps = {"ngram:k=2": build_method("ngram", {"k": 2}, model, {}, True)}
    sps["draft:layers=1,k=2"] = build_method("draft", {"layers": 1, "k": 2}, model, {}, True)
    prof = measure(model, sps, context=8, Ts=[1, 2, 4], repeats=1)
    assert set(prof.verify_s) == {1, 2, 4} and all(v > 0 for v in prof.verify_s.values())
    assert set(prof.draft_s) == set(prof.draft_tokens) == {"ngram:k=2", "draft:layers=1,k=2"}
    assert 1.5 <= prof.draft_tokens["draft:layers=1,k=2"] <= 2  # k = 2 a step (the last steps may be cut short)


def test_curve_runs_generate_the_steps_asked_for(monkeypatch):
    """CurveRounds(steps=s): each timed plain run decodes s steps and each draft run generates s tokens (a curve
    predicting a suite runs as long as the suite's answers: later steps meet other host phases)."""
    import evals.speculation.cost_model as cm

    model = random_model(SMOKE_CONFIG, seed=0)
    plain_steps, real_plain = [], cm.plain_decode

    def counted(*args, **kwargs):
        out, decode_s = real_plain(*args, **kwargs)
        plain_steps.append(len(out.timing.step_times_s))
        return out, decode_s

    monkeypatch.setattr(cm, "plain_decode", counted)
    sps = {"draft:layers=1,k=2": build_method("draft", {"layers": 1, "k": 2}, model, {}, True)}
    for steps in (3, 11):
        curve = cm.CurveRounds(model, sps, context=8, Ts=[1, 2], steps=steps)
        curve.round()
        assert plain_steps[-1] == steps
        assert f"runs of {steps} tokens" in curve.profile().notes
        # a k = 2 draft run of `steps` tokens: ceil(steps / 3) .. steps speculative steps of at most 2 drafts
        assert 1 <= curve.drafted["draft:layers=1,k=2"][-1] <= 2


def test_a_composite_draft_is_priced_by_its_own_mix_of_lookups_and_drafted_tokens():
    """Prompt lookup first, a draft model otherwise: the model's drafted tokens at its own price per token (its
    MODEL_PART run), each lookup at what the curve's composite run spent beyond its model tokens (by hand here)."""
    from evals.speculation.cost_model import MODEL_PART, step_draft_seconds

    m = "draft:model=w4a8+qwen2.5-coder-0.5b,k=8,lookup=3"
    prof = Profile(
        "p", "measured", {1: 0.08, 9: 0.12}, {m: 0.006, m + MODEL_PART: 0.08},
        draft_tokens={m: 1.5, m + MODEL_PART: 8.0},
        draft_sources={m: {"lookup_rows": 0.8, "model_rows": 0.2, "model_drafted": 0.4}},
    )  # fmt: skip
    row = {"method": m, "steps": 100, "mean_fed_tokens": 5.2, "draft_s_per_step": 0.5,
           "draft_sources": {"lookup_rows": 40, "model_rows": 60, "model_drafted": 300}}  # fmt: skip
    per_token = 0.08 / 8.0
    per_lookup = (0.006 - 0.4 * per_token) / 0.8
    assert step_draft_seconds(row, {}, prof) == pytest.approx((40 * per_lookup + 300 * per_token) / 100)
    # without the row's counts (an older record): one price per drafted token, as before
    plain_row = {k: v for k, v in row.items() if k != "draft_sources"}
    assert step_draft_seconds(plain_row, {}, prof) == pytest.approx(0.006 / 1.5 * 4.2)


def test_curve_times_a_composite_draft_and_its_model_apart(tmp_path):
    from evals.speculation.cost_model import load_profile, profile_record

    model = random_model(SMOKE_CONFIG, seed=0)
    m = "draft:layers=1,k=2,lookup=2"
    sps = {m: build_method("draft", {"layers": 1, "k": 2, "lookup": 2}, model, {}, True)}
    prof = measure(model, sps, context=8, Ts=[1, 2], repeats=1)
    assert set(prof.draft_s) == {m, m + "#model"} and prof.draft_tokens[m + "#model"] > 0
    mix = prof.draft_sources[m]
    assert mix["lookup_rows"] + mix["model_rows"] == pytest.approx(1.0)  # each step one row, by one source
    assert m + "#model" not in prof.draft_sources  # the model alone has one source
    (tmp_path / "p.json").write_text(json.dumps(profile_record(prof)))
    assert load_profile(str(tmp_path / "p.json")).draft_sources == prof.draft_sources


def test_choose_draft_by_acceptance_per_cost():
    suite = {
        "speculators": {
            "draft:layers=8,k=3": {"name": "draft(layers:8)", "k": 3},
            "quant-draft:bits=4,layers=15,k=3": {"name": "quant-draft(int4+layers:15)", "k": 3},
            "ngram:k=4": {"name": "ngram", "k": 4},
        },
        "rows": [
            # more accepted tokens but a dearer draft: 2.5 x 1 / (0.5 + 1.5) = 1.25
            {
                "batch": 1,
                "category": "overall",
                "method": "draft:layers=8,k=3",
                "tokens_per_step": 2.5,
                "fed_tokens_hist": {"4": 1},
                "draft_s_per_step": 0.5,
            },
            # fewer accepted, a cheap draft: 2.2 x 1 / (0.1 + 1.5) = 1.375 wins
            {
                "batch": 1,
                "category": "overall",
                "method": "quant-draft:bits=4,layers=15,k=3",
                "tokens_per_step": 2.2,
                "fed_tokens_hist": {"4": 1},
                "draft_s_per_step": 0.1,
            },
            {
                "batch": 1,
                "category": "overall",
                "method": "ngram:k=4",
                "tokens_per_step": 3.0,
                "fed_tokens_hist": {"4": 1},
                "draft_s_per_step": 0.0,
            },
        ],
    }
    prof = Profile("p", "measured", {1: 1.0, 4: 1.5})
    choice, rows = choose_draft(suite, prof)
    assert choice["draft"] == "int4+layers:15" and choice["k"] == 3
    assert choice["predicted_speedup"] == pytest.approx(2.2 / 1.6, abs=1e-4)
    assert {r["method"] for r in rows} == {"draft:layers=8,k=3", "quant-draft:bits=4,layers=15,k=3"}  # no n-gram


def test_draft_spec_grammar():
    model = random_model(SMOKE_CONFIG, seed=0)
    draft, label = parse_draft_spec("layers:1", model)
    assert label == "layers:1" and draft.config.num_layers == 1
    with pytest.raises(SpeculatorError, match="int4, int8, w4a8, w8a8"):
        parse_draft_spec("int3", model)
    with pytest.raises(SpeculatorError, match="integer N"):
        parse_draft_spec("int4+layers:x", model)
    for spec, int8_acts in (("int4", False), ("w4a8", True), ("w8a8+layers:1", True)):
        draft, _ = parse_draft_spec(spec, model)
        layers = [m for m in draft.modules() if hasattr(m, "cpu_kernel_weight")]
        assert layers and all(m.cpu_kernel_weight().int8_activations == int8_acts for m in layers), spec


def test_unset_draft_is_the_measured_choice_else_the_int4_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    model = random_model(SMOKE_CONFIG, seed=0)
    draft, label = parse_draft_spec(None, model)  # nothing measured for this model
    assert label == FALLBACK_DRAFT == "int4"
    quantized = [m for m in draft.modules() if isinstance(m, QuantLinear)]
    assert quantized and {m.bits for m in quantized} == {4} and draft.config.num_layers == model.config.num_layers
    path = default_draft_file(model)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"draft": "layers:1"}))  # what choose-draft --write stores
    draft, label = parse_draft_spec(None, model)
    assert label == "layers:1" and draft.config.num_layers == 1


def test_loop_overheads_enter_both_sides_of_the_speedup(tmp_path):
    p = Profile("x", "measured", {1: 1.0, 5: 2.0}, decode_overhead_s=0.5, step_overhead_s=1.0)
    assert predict_speedup(3.0, {5: 1}, 0.5, p) == pytest.approx(3.0 * (1.0 + 0.5) / (0.5 + 2.0 + 1.0))
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({"kind": "measured", "verify_s": {"1": 1.0}, "decode_overhead_s": 0.25, "step_overhead_s": 0.75})
    )
    loaded = load_profile(str(path))
    assert (loaded.decode_overhead_s, loaded.step_overhead_s) == (0.25, 0.75)


def test_fixed_drafts_feed_k_plus_one_tokens_every_step():
    model = random_model(SMOKE_CONFIG, seed=0)
    prompts = torch.randint(2, SMOKE_CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    drafts = FixedDrafts(3, SMOKE_CONFIG.vocab_size)
    state = SpecState(ids=[0, 1], token_ids=prompts, hidden=None, params=[params] * 2, generators=[None] * 2)
    proposal = drafts.propose(state)
    assert proposal.num_drafted.tolist() == [3, 3] and proposal.tokens.shape == (2, 3)
    out = speculative_generate(model, prompts, params, drafts, compile="off")
    # k drafts at every step until the row's token budget cuts them (the loop's draft_budget)
    assert out.stats.proposed_at[2] >= out.stats.row_steps // 2
    plain = generate(model, prompts, params).tokens
    assert out.tokens == plain  # random drafts change nothing but the work done


def test_steps_without_drafts_cost_the_measured_empty_step(tmp_path):
    """An n-gram step with no match feeds 1 token through the speculative loop: priced at empty_step_s, not c(1)."""
    p = Profile("x", "measured", {1: 1.0, 5: 2.0}, empty_step_s=1.5)
    # 2 tokens/step; half the steps empty (1.5 s), half feed 5 (2.0 s): 2 x 1.0 / 1.75
    assert predict_speedup(2.0, {1: 3, 5: 3}, 0.0, p) == pytest.approx(2.0 / 1.75)
    assert predict_speedup(2.0, {1: 3, 5: 3}, 0.0, Profile("y", "measured", {1: 1.0, 5: 2.0})) == pytest.approx(2 / 1.5)
    with pytest.raises(CostError, match="empty step"):
        Profile("bad", "measured", {1: 1.0}, empty_step_s=0.0)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "measured", "verify_s": {"1": 1.0}, "empty_step_s": 1.25}))
    assert load_profile(str(path)).empty_step_s == 1.25
    model = random_model(SMOKE_CONFIG, seed=0)
    prompts = torch.randint(2, SMOKE_CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = speculative_generate(model, prompts, params, FixedDrafts(3, SMOKE_CONFIG.vocab_size, empty=True))
    assert out.stats.drafted == 0 and out.stats.steps == 5 and out.tokens == generate(model, prompts, params).tokens
    prof = measure(model, {}, context=16, Ts=[1, 3], repeats=1)
    assert prof.empty_step_s is not None and prof.empty_step_s > 0
    assert measure(model, {}, context=16, Ts=[1], repeats=1, in_loop=False).empty_step_s is None


def test_in_loop_profile_has_no_separate_overheads():
    """--timing loop: c(T) is a step of the real loops, so the overhead terms stay zero and the speedup is
    tokens_per_step x c(1) / (draft + E[c(T)])."""
    model = random_model(SMOKE_CONFIG, seed=0)
    prof = measure(model, {}, context=16, Ts=[1, 3], repeats=1)
    assert set(prof.verify_s) == {1, 3} and all(v > 0 for v in prof.verify_s.values())
    assert (prof.decode_overhead_s, prof.step_overhead_s) == (0.0, 0.0) and "in-loop" in prof.notes
    assert predict_speedup(2.0, {3: 1}, 0.0, prof) == pytest.approx(2.0 * prof.verify_s[1] / prof.verify_s[3])


def test_measured_profile_carries_the_loop_overheads():
    model = random_model(SMOKE_CONFIG, seed=0)
    prof = measure(model, {}, context=16, Ts=[1, 2, 5], repeats=1, in_loop=False)
    assert set(prof.verify_s) == {1, 2, 5}
    assert math.isfinite(prof.decode_overhead_s) and math.isfinite(prof.step_overhead_s)
    assert prof.step_overhead_s > -prof.verify(5)  # a speculative step costs more than nothing


def test_bare_forward_curve_takes_its_samples_in_interleaved_rounds(monkeypatch):
    """--timing forward: every T gets one sample a round, in turn (host drift lands on each alike), after a warm-up
    round; a sample is the mean of its calls and each T's value the median of its rounds."""
    calls, clock = [], iter(range(10_000))
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: next(clock))
    fns = {T: (lambda T=T: calls.append(T)) for T in (1, 2, 8)}
    medians = cost_model.interleaved_medians(fns, repeats=4, calls=3)
    assert calls == [T for _ in range(5) for T in (1, 2, 8) for _ in range(3)]
    assert medians == {1: 1 / 3, 2: 1 / 3, 8: 1 / 3}  # each sample: 3 calls between two reads of the clock


def test_tree_rows_use_the_tree_curve_and_extrapolation_never_falls():
    p = Profile("x", "measured", {1: 1.0, 8: 2.0, 12: 1.8}, tree_verify_s={9: 3.0, 17: 4.0})
    assert p.verify(20) == 1.8  # a falling last segment is held flat, not extended to nothing
    assert p.verify(9, tree=True) == 3.0 and p.verify(13, tree=True) == 3.5 and p.verify(9) == 2.0 - 0.05
    assert Profile("y", "roofline", {1: 1.0, 9: 2.0}).verify(9, tree=True) == 2.0  # no tree curve: the chain's
    suite = {
        "speculators": {"medusa:tree=8": {"name": "medusa", "tree_size": 8}, "ngram:k=8": {"name": "ngram"}},
        "rows": [
            {"batch": 1, "category": "qa", "method": m, "tokens_per_step": 2.0, "fed_tokens_hist": {"9": 4},
             "draft_s_per_step": 0.0, "decode_speedup_vs_plain": 1.0}
            for m in ("medusa:tree=8", "ngram:k=8")
        ],
    }  # fmt: skip
    medusa, ngram = predict_suite(suite, p)
    assert medusa["predicted_speedup"] == pytest.approx(2.0 / 3.0, abs=1e-4)
    assert ngram["predicted_speedup"] == pytest.approx(2.0 / 1.95, abs=1e-4)


def test_tree_steps_are_timed_through_the_tree_verifier():
    model = random_model(SMOKE_CONFIG, seed=0)
    prompts = torch.randint(2, SMOKE_CONFIG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    drafts = FixedDrafts(4, SMOKE_CONFIG.vocab_size, tree=True)
    state = SpecState(ids=[0], token_ids=prompts, hidden=None, params=[params], generators=[None])
    proposal = drafts.propose(state)
    assert proposal.tree is not None and len(proposal.tree) == 5 and proposal.tokens[0, 0] == prompts[0][-1]
    assert (
        speculative_generate(model, prompts, params, drafts, compile="off").tokens
        == generate(model, prompts, params).tokens
    )
    prof = measure(model, {}, context=16, Ts=[1], repeats=1, tree_Ts=[3, 5])
    assert set(prof.tree_verify_s) == {3, 5} and all(v > 0 for v in prof.tree_verify_s.values())


def test_a_separate_draft_checkpoint_quantized_and_tokenizer_checked(tiny_checkpoint, tmp_path):
    """--draft-model SPEC / int4+SPEC load a separate checkpoint (the 0.5B for the 1.5B); a draft whose
    tokenizer.json maps text to other ids is refused by name, before any drafting."""
    target, _, path = load_model(str(tiny_checkpoint))
    draft, label = parse_draft_spec(str(tiny_checkpoint), target, path)
    assert label == str(tiny_checkpoint) and not any(isinstance(m, QuantLinear) for m in draft.modules())
    draft, label = parse_draft_spec(f"int4+{tiny_checkpoint}", target, path)
    bits = {name: m.bits for name, m in draft.named_modules() if isinstance(m, QuantLinear)}
    assert bits.pop("lm_head") == 8 and set(bits.values()) == {4}  # int4 layers, int8 head (SEPARATE_DRAFT_HEAD_BITS)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_checkpoint, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SpeculatorError, match=r"another tokenizer than the target .*vocabulary differ"):
        parse_draft_spec(str(other), target, path)
    with pytest.raises(SpeculatorError, match="no such directory"):
        parse_draft_spec("int8+./missing-draft/", target, path)


def test_a_dynamic_k_draft_costs_its_drafted_tokens_at_the_profiled_per_token_price():
    # the profile timed the draft at a fixed k = 5; a confidence-stopped row of the same draft that fed 4.5 tokens
    # per step drafted 3.5 of them: its propose() costs 3.5 / 5 of the profiled one, not the profile's k = 5 cost
    fixed, dynamic = "draft:layers=2,k=5", "draft:layers=2,k=8,conf=0.4"
    profile = Profile("cpu", "measured", {1: 0.01, 9: 0.02}, {fixed: 0.05})
    row = {"batch": 1, "category": "overall", "tokens_per_step": 3.0, "fed_tokens_hist": {"4": 1, "5": 1},
           "mean_fed_tokens": 4.5, "draft_s_per_step": 0.9, "decode_speedup_vs_plain": 1.0}  # fmt: skip
    suite = {"rows": [dict(row, method=dynamic), dict(row, method=fixed), dict(row, method="draft:layers=3,k=5")]}
    rows = {r["method"]: r["draft_s"] for r in predict_suite(suite, profile)}
    assert rows[dynamic] == pytest.approx(0.05 / 5 * 3.5)
    assert rows[fixed] == 0.05  # its own entry
    assert rows["draft:layers=3,k=5"] == 0.9  # another draft: the suite's own measurement


def test_a_draft_timed_with_its_drafted_tokens_is_priced_per_token_it_drafts(tmp_path):
    # the profile timed a confidence-stopped draft at 6 drafted tokens per call (on its random context) and this
    # very method drafted 4 per step on the suite: its propose() costs 4 / 6 of the profiled call; the same draft
    # at another k is priced by the 6 drafted tokens too (not by its k = 8); without the count, the call's cost
    dynamic, other = "draft:layers=2,k=8,conf=0.4", "draft:layers=2,k=4"
    profile = Profile("cpu", "measured", {1: 0.01, 9: 0.02}, {dynamic: 0.06}, draft_tokens={dynamic: 6.0})
    row = {"batch": 1, "category": "overall", "tokens_per_step": 3.0, "fed_tokens_hist": {"5": 2},
           "mean_fed_tokens": 5.0, "draft_s_per_step": 0.9, "decode_speedup_vs_plain": 1.0}  # fmt: skip
    suite = {"rows": [dict(row, method=dynamic), dict(row, method=other), dict(row, method="ngram:k=8")]}
    rows = {r["method"]: r["draft_s"] for r in predict_suite(suite, profile)}
    assert rows[dynamic] == pytest.approx(0.06 / 6 * 4) and rows[other] == pytest.approx(0.06 / 6 * 4)
    assert rows["ngram:k=8"] == 0.9  # not in the profile: the suite's own measurement
    uncounted = Profile("cpu", "measured", {1: 0.01, 9: 0.02}, {dynamic: 0.06})
    assert predict_suite({"rows": [dict(row, method=dynamic)]}, uncounted)[0]["draft_s"] == 0.06
    path = tmp_path / "p.json"  # the count survives the profile's record
    path.write_text(json.dumps({"kind": "measured", "verify_s": {"1": 0.01}, "draft_tokens": {dynamic: 6.0}}))
    assert load_profile(str(path)).draft_tokens == {dynamic: 6.0}
