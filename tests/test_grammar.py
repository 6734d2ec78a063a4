"""Constrained decoding (runtime.grammar, xgrammar): the mask inside the one sampler, and every decoding loop
(plain, batched, engine, speculative chain and tree) honouring it. Oracles: the schema itself (jsonschema),
Python's re, and plain constrained decoding (greedy speculative output must equal it token for token).

A tiny random model over a character vocabulary (id 1 = EOS, ids 2.. = printable ASCII) makes every
grammar reachable in a few dozen tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.grammar import Grammar, GrammarError, GrammarSpec, response_format_spec
from runtime.model import random_model
from runtime.sampling import SamplingParams, logits_to_probs
from speculate.draft import DraftModelSpeculator, layer_skip_draft
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from speculate.verify import CandidateTree
from tests.tiny_models import tiny_model_config

VOCAB = ["<unk>", "<eos>"] + [chr(c) for c in range(32, 126)]
CFG = tiny_model_config(vocab_size=len(VOCAB), max_position_embeddings=512)
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"(ab|c[de]+)+f"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "[" [a-c]+ "]"'
PROMPT = [40, 41, 42]


def text(tokens: list[int]) -> str:
    return "".join(VOCAB[t] for t in tokens if t != 1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small ops: one thread (two collapse on a busy 2-core machine), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def grammar(kind: str, source: str = "") -> Grammar:
    return Grammar(GrammarSpec(kind, source), VOCAB, CFG.vocab_size, CFG.eos_token_ids)


def sampled(n: int, max_tokens: int = 64, temperature: float = 1.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens) for s in range(n)]


def check_outputs(tokens, reasons, incomplete, valid) -> int:
    """Each output is valid (ended by EOS, or complete just as max_tokens cut it), or it was cut by max_tokens,
    is flagged, and is not valid."""
    complete = 0
    for toks, reason, flag in zip(tokens, reasons, incomplete):
        assert reason in ("eos", "length") and (reason == "length") == (toks[-1] != 1), (reason, toks)
        if flag:
            assert reason == "length" and not valid(text(toks)), (reason, text(toks))
        else:
            assert valid(text(toks)), (reason, text(toks))
            complete += 1
    return complete


def schema_valid(s: str) -> bool:
    try:
        jsonschema.validate(json.loads(s), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_mask_inside_the_sampler():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=gen)
    mask = torch.rand(3, 10, generator=gen) < 0.4
    mask[:, 0] = True
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3, top_p=0.9)):
        probs = logits_to_probs(logits, params, mask)
        assert float(probs[~mask].abs().max()) == 0 and torch.allclose(probs.sum(-1), torch.ones(3))
        # oracle: the same params on logits where the refused tokens were never candidates
        want = logits_to_probs(logits.masked_fill(~mask, -1e30), params)
        torch.testing.assert_close(probs, want)
    greedy = logits_to_probs(logits, SamplingParams(), mask)
    assert greedy.argmax(-1).tolist() == logits.masked_fill(~mask, float("-inf")).argmax(-1).tolist()


def test_200_sampled_generations_parse_against_the_schema(model):
    """The bar: 200 seeded sampled generations (batched), every one valid under the schema unless cut."""
    g = grammar("json_schema", json.dumps(SCHEMA))
    out = generate(model, [PROMPT] * 200, sampled(200), grammar=g)
    complete = check_outputs(out.tokens, out.finish_reasons, out.grammar_incomplete, schema_valid)
    assert complete >= 150, complete  # most finish well within 64 tokens
    assert len({text(t) for t in out.tokens}) > 150  # per-row seeds: distinct samples


@pytest.mark.parametrize(
    "kind,source,valid",
    [
        ("regex", REGEX, lambda s: re.fullmatch(REGEX, s) is not None),
        ("ebnf", EBNF, lambda s: re.fullmatch(r"\((\d|\[[a-c]+\])(,(\d|\[[a-c]+\]))*\)", s) is not None),
        ("json_object", "", lambda s: isinstance(json.loads(s), dict) if s.endswith("}") else False),
    ],
)
def test_regex_ebnf_and_json_object(model, kind, source, valid):
    out = generate(model, [PROMPT] * 40, sampled(40, max_tokens=48), grammar=grammar(kind, source))
    assert check_outputs(out.tokens, out.finish_reasons, out.grammar_incomplete, valid) >= 10


def test_cut_by_max_tokens_is_flagged(model):
    g = grammar("json_schema", json.dumps(SCHEMA))
    out = generate(model, [PROMPT] * 4, sampled(4, max_tokens=5), grammar=[g, g, None, g])
    assert out.finish_reasons == ["length"] * 4
    assert out.grammar_incomplete == [True, True, False, True]  # the unconstrained row has nothing to satisfy
    assert all(text(out.tokens[b]).startswith("{") for b in (0, 1, 3))


def test_bad_grammars_are_one_line_errors():
    with pytest.raises(GrammarError, match="cannot compile the regex grammar: Regex parsing error"):
        grammar("regex", "a((")
    with pytest.raises(GrammarError, match='Rule "foo" is not defined'):
        grammar("ebnf", "root ::= foo")
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammar("json_schema", "{bad")
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("xml", "x")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        generate(random_model(CFG, seed=0), [PROMPT], SamplingParams(ignore_eos=True), grammar=grammar("regex", "a"))


def spec_speculators(model):
    from speculate.medusa.heads import MedusaConfig, MedusaHeads
    from speculate.medusa.speculator import MedusaSpeculator

    heads = MedusaHeads(MedusaConfig(num_heads=3, hidden_size=CFG.hidden_size, vocab_size=CFG.vocab_size)).eval()
    tree = CandidateTree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    return {
        "ngram": NgramSpeculator(k=4),
        "draft": DraftModelSpeculator(model, layer_skip_draft(model, 1), k=3),
        "medusa-tree": MedusaSpeculator(model, heads, tree),
    }


@pytest.mark.parametrize("name", ["ngram", "draft", "medusa-tree"])
def test_speculative_under_a_grammar(model, name):
    """Greedy: token for token the constrained plain output (batched, several grammars). Sampled: every
    output valid unless flagged."""
    speculator = spec_speculators(model)[name]
    grammars = [grammar("json_schema", json.dumps(SCHEMA)), grammar("regex", REGEX), grammar("ebnf", EBNF)]
    prompts = [PROMPT, [50, 51], [60, 61, 62, 63]]
    greedy = SamplingParams(max_tokens=40)
    plain = generate(model, prompts, greedy, grammar=grammars)
    spec = speculative_generate(model, prompts, greedy, speculator, grammar=grammars)
    assert spec.tokens == plain.tokens and spec.grammar_incomplete == plain.grammar_incomplete
    g = grammars[0]
    out = speculative_generate(
        model, [PROMPT] * 12, SamplingParams(temperature=1.0, seed=3, max_tokens=64), speculator, grammar=g
    )
    assert check_outputs(out.tokens, out.finish_reasons, out.grammar_incomplete, schema_valid) >= 6


@pytest.mark.parametrize("speculate", [False, True])
def test_engine_under_a_grammar(model, speculate):
    g = grammar("json_schema", json.dumps(SCHEMA))
    engine = LLMEngine(
        model,
        config=EngineConfig(num_blocks=64, max_num_seqs=4),
        speculator=NgramSpeculator(k=4) if speculate else None,
    )
    ids = [engine.add_request(PROMPT, p, grammar=g) for p in sampled(10)]
    greedy_id = engine.add_request(PROMPT, SamplingParams(max_tokens=40), grammar=g)
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    outs = [final[i] for i in ids]
    check_outputs(
        [o.output_ids for o in outs],
        [o.finish_reason for o in outs],
        [o.grammar_incomplete for o in outs],
        schema_valid,
    )
    want = generate(model, [PROMPT], SamplingParams(max_tokens=40), grammar=g)
    assert final[greedy_id].output_ids == want.tokens[0]
    assert final[greedy_id].grammar_incomplete == want.grammar_incomplete[0]


def test_response_format_spec():
    assert response_format_spec(None) is None and response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}) == GrammarSpec("json_object")
    spec = response_format_spec({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert spec.kind == "json_schema" and json.loads(spec.source) == SCHEMA
    with pytest.raises(GrammarError, match="json_schema.schema"):
        response_format_spec({"type": "json_schema", "json_schema": {"name": "s"}})
    with pytest.raises(GrammarError, match="not supported"):
        response_format_spec({"type": "yaml"})
