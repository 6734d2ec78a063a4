"""speculate.registry: one table of speculators. Every built-in builds from a method string and from the CLI's
flags with the same settings; bad names, options and types are one-line errors; a plug-in from a package
outside the repository (module:attr, or an entry point of the group qspec.speculators) runs through the
generation loop, and one that breaks the contract is refused before any model loads."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap

import pytest

from evals.speculation.specbench import main as specbench_main
from runtime.decoding import generate
from runtime.generate import main as generate_main
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.base import SpeculatorError
from speculate.cli import SPECULATORS, build_speculator
from speculate.eagle.head import EagleConfig, EagleHead
from speculate.generate import speculative_generate
from speculate.medusa.heads import MedusaConfig, MedusaHeads, model_fingerprint
from speculate.registry import (
    ENTRY_POINT_GROUP,
    BuildContext,
    Method,
    build,
    check_method,
    random_weights,
    speculator_names,
)
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]
PKG = "qspec_test_plugins"  # written into tmp_path: outside the repository, found through sys.path only

PLUGIN = '''
import torch

from speculate.base import Proposal, Speculator, check_k


class RepeatSpeculator(Speculator):
    """Drafts the last committed token k times (deterministic drafts, verified losslessly)."""

    name = "repeat"

    def __init__(self, target, k: int = 2):
        self.k = check_k(k)

    def max_tokens_per_step(self):
        return self.k + 1

    def propose(self, state):
        last = torch.tensor([seq[-1] for seq in state.token_ids])
        return Proposal(tokens=last[:, None].repeat(1, self.k).to(state.device))


class FromOptions(RepeatSpeculator):
    @classmethod
    def from_options(cls, target, context, k: int = 2, scale: float = 1.0):
        spec = cls(target, k=k)
        spec.scale, spec.smoke = scale, context.smoke
        return spec


def build_repeat(target, context, k: int = 2):
    return RepeatSpeculator(target, k=k)


NOT_A_SPECULATOR = 3
'''

BROKEN = """
class NoPropose:
    name = "broken"
    lossless = True

    def max_tokens_per_step(self):
        return 1


class Silent:  # says nothing about being lossless
    name = "silent"

    def propose(self, state): ...
    def max_tokens_per_step(self): ...
    def verify(self, state, proposal, logits): ...
    def prefill(self, state): ...
    def release(self, ids): ...
    def describe(self): ...
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    package = tmp_path / PKG
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lookahead.py").write_text(textwrap.dedent(PLUGIN))
    (package / "broken.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PKG
    for name in [m for m in sys.modules if m == PKG or m.startswith(f"{PKG}.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def target():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Random Medusa heads (with an accuracy table, for trees) and an EAGLE head, saved for the target."""
    config = MedusaConfig(num_heads=3, hidden_size=CFG.hidden_size, vocab_size=CFG.vocab_size)
    config.base_fingerprint = model_fingerprint(target)
    config.accuracy = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    medusa = random_weights(MedusaHeads(config)).save(tmp_path_factory.mktemp("medusa"))
    eagle = random_weights(EagleHead(EagleConfig.for_model(target))).save(tmp_path_factory.mktemp("eagle"))
    return {"medusa": medusa, "eagle": eagle}


# method string <-> the CLI's flags (speculate.cli.build_speculator's keywords), one pair per built-in setting
BUILTIN_CASES = [
    ("ngram:k=3,fixed=1", {"k": 3, "ngram_fixed": True}),
    ("ngram:k=5", {"k": 5}),
    ("draft:layers=1,k=2", {"k": 2, "draft_model": "layers:1"}),
    ("draft:model=int8+layers:1,k=3", {"k": 3, "draft_model": "int8+layers:1"}),
    ("draft:layers=1,k=3,lookup=2", {"k": 3, "draft_model": "layers:1", "lookup": 2}),  # prompt lookup first
    ("quant-draft:bits=4,group=32,k=2", {"k": 2, "quant_bits": 4, "quant_group_size": 32}),
    ("quant-draft:bits=8", {"quant_bits": 8}),
    ("medusa:tree=4", {"tree_size": 4}),
    ("medusa:k=2", {"k": 2}),  # no tree: a top-1 chain of k
    ("medusa:tree=5,acceptance=typical", {"tree_size": 5, "acceptance": "typical"}),
    ("eagle:tree=6", {"tree_size": 6}),
]


def settings(spec) -> dict:
    tree = getattr(spec, "tree", None)
    return {
        "type": type(spec).__name__,
        **spec.describe(),
        "tree": None if tree is None else tree.parents,
        "scaled": getattr(spec, "scaled", None),
    }


def test_every_builtin_has_a_case():
    assert set(SPECULATORS) == {method.partition(":")[0] for method, _ in BUILTIN_CASES}
    assert list(speculator_names())[: len(SPECULATORS)] == list(SPECULATORS)


@pytest.mark.parametrize("method,flags", BUILTIN_CASES, ids=[m for m, _ in BUILTIN_CASES])
def test_builtin_from_method_string_equals_builtin_from_cli_flags(method, flags, target, heads):
    from_method = build(method, target, BuildContext(heads=heads))
    from_flags = build_speculator(
        method.partition(":")[0], target, medusa_heads=heads["medusa"], eagle_heads=heads["eagle"], **flags
    )
    assert settings(from_method) == settings(from_flags)
    assert from_method.name == from_flags.name


def test_checked_methods_are_typed():
    assert check_method("draft:model=layers:1,k=3,conf=0.4") == Method(
        "draft", {"model": "layers:1", "k": 3, "conf": 0.4}
    )
    assert check_method("ngram:fixed=true").options == {"fixed": True}
    assert check_method(Method("eagle", {"tree": 4, "depth": 2})).options == {"tree": 4, "depth": 2}
    assert check_method("medusa").options == {}


@pytest.mark.parametrize(
    "method,message",
    [
        ("lookahead", "unknown speculator 'lookahead'; choose from ngram, draft, medusa, quant-draft, eagle"),
        ("ngrm:k=2", "unknown speculator 'ngrm' in method 'ngrm:k=2'"),
        ("ngram:tree=4", "unknown option 'tree' in method 'ngram:tree=4'; ngram takes k=, fixed="),
        ("ngram:k", "bad option 'k' in method 'ngram:k'; ngram takes k=, fixed="),
        ("ngram:k=two", "option k of method 'ngram:k=two' must be an integer, got 'two'"),
        ("ngram:fixed=maybe", "option fixed of method 'ngram:fixed=maybe' must be 0 or 1"),
        ("draft:conf=high", "option conf of method 'draft:conf=high' must be a number"),
        ("ngram:k=0", "k must be an integer >= 1, got 0"),
        ("eagle:tree=0", "option tree must be >= 1, got 0"),
        ("draft:lookup=0", "option lookup must be >= 1, got 0"),
        ("quant-draft:bits=3", "quant-draft supports 4 or 8 bits, got 3"),
        ("draft:layers=1,model=int4", "layers=L (the target's first L layers) or model=SPEC, not both"),
        ("draft:model=int3+layers:1", "quantized drafts are int4, int8, w4a8, w8a8"),
        ("medusa:acceptance=greedy", "Medusa acceptance is rejection (lossless) or typical"),
        (Method("ngram", {"k": 2.5}), "option k of method 'ngram:k=2.5' must be an integer"),
        (Method("ngram", {"k": True}), "must be an integer"),
    ],
)
def test_a_bad_method_is_one_line(method, message):
    with pytest.raises(SpeculatorError) as err:
        check_method(method)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_flags_keep_their_errors(target):
    with pytest.raises(SpeculatorError, match="unknown speculator 'eagel'; choose from ngram, draft"):
        build_speculator("eagel", target)
    with pytest.raises(SpeculatorError, match="typical acceptance is a Medusa mode; ngram verifies losslessly only"):
        build_speculator("ngram", target, acceptance="typical")
    with pytest.raises(SpeculatorError, match="expected layers:N"):
        build_speculator("draft", target, draft_model="layers:x")


# ---- plug-ins --------------------------------------------------------------------------------------------


def plain_and_speculative(target, spec):
    prompts = [[5, 9, 13, 5, 9, 13, 5], [11, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return generate(target, prompts, params).tokens, speculative_generate(target, prompts, params, spec)


def test_plugin_class_runs_through_the_registry_and_is_lossless(plugins, target):
    spec = build(f"{plugins}.lookahead:RepeatSpeculator:k=3", target)
    assert type(spec).__name__ == "RepeatSpeculator" and spec.k == 3 and spec.lossless
    plain, out = plain_and_speculative(target, spec)
    assert out.tokens == plain
    assert out.stats.drafted > 0  # it really speculated
    assert build_speculator(f"{plugins}.lookahead:RepeatSpeculator", target, k=4).k == 4  # -k reaches it


def test_plugin_builder_function_and_from_options(plugins, target):
    assert build(f"{plugins}.lookahead:build_repeat:k=2", target).k == 2
    spec = build(f"{plugins}.lookahead:FromOptions:k=2,scale=0.5", target, BuildContext(smoke=True))
    assert (spec.k, spec.scale, spec.smoke) == (2, 0.5, True)
    with pytest.raises(SpeculatorError, match=r"unknown option 'depth' .*; .*RepeatSpeculator takes k="):
        check_method(f"{plugins}.lookahead:RepeatSpeculator:depth=2")


def test_plugin_found_by_entry_point_name(plugins, target, monkeypatch):
    entry_points = importlib.metadata.entry_points

    def fake_entry_points(**select):
        if select.get("group") == ENTRY_POINT_GROUP:
            value = f"{plugins}.lookahead:RepeatSpeculator"
            return [importlib.metadata.EntryPoint(name="repeat", value=value, group=ENTRY_POINT_GROUP)]
        return entry_points(**select)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert "repeat" in speculator_names()
    assert check_method("repeat:k=2") == Method("repeat", {"k": 2})
    spec = build_speculator("repeat", target, k=3)
    assert spec.k == 3
    plain, out = plain_and_speculative(target, spec)
    assert out.tokens == plain
    with pytest.raises(SpeculatorError, match="choose from ngram, draft, medusa, quant-draft, eagle, repeat"):
        check_method("lookahead")


@pytest.mark.parametrize(
    "attr,message",
    [
        ("broken:NoPropose", "class NoPropose is not a speculator: it lacks propose, verify, prefill, release"),
        ("broken:Silent", "it lacks acceptance ('rejection': verified by the one verifier), lossless (whether"),
        ("lookahead:Nope", "has no attribute 'Nope'"),
        ("lookahead:NOT_A_SPECULATOR", "neither a Speculator class nor a builder function"),
        ("no_such_module:Cls", "cannot import module"),
    ],
)
def test_a_broken_plugin_is_refused_before_any_model(plugins, attr, message):
    with pytest.raises(SpeculatorError) as err:
        check_method(f"{plugins}.{attr}")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_clis_refuse_a_broken_plugin_before_loading(plugins, capsys):
    broken = f"{plugins}.broken:NoPropose"
    # a model that does not exist: had the check come after loading, the error would be about the model
    for speculator in (broken, "eagel"):
        with pytest.raises(SystemExit) as exit_info:
            generate_main(["--model", "/nonexistent", "--prompt", "hi", "--speculator", speculator])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "lacks propose" in err and "unknown speculator 'eagel'; choose from ngram" in err
    assert "/nonexistent" not in err
    with pytest.raises(SystemExit):
        specbench_main(["--smoke", "--methods", "plain", broken])
    assert "lacks propose" in capsys.readouterr().err
