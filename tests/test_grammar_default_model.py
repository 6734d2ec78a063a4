"""Constrained decoding on the embedded default model: ``python -m runtime.generate --json-schema FILE`` /
``--regex`` (plain and speculative), and the bar's 200 seeded sampled generations, each valid under its schema
(jsonschema) unless cut by max_tokens and flagged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from runtime import generate as gen_cli
from runtime.decoding import encode_prompt, generate
from runtime.grammar import Grammar, GrammarSpec
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "Give a made-up person's name, age and city as JSON."


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.slow  # loads the default model four times: ~2 min on the busy 2-core machine
@pytest.mark.parametrize("speculator", [None, "ngram"])
def test_generate_cli_json_schema_and_regex(tmp_path, capsys, speculator):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    extra = ["--speculator", speculator] if speculator else []
    gen_cli.main(["--prompt", PROMPT, "--chat", "--json-schema", str(schema), "--max-tokens", "80", *extra])
    out = capsys.readouterr()
    assert valid(out.out.strip()), out.out
    gen_cli.main(["--prompt", "Is the sky blue? Answer yes or no.", "--chat", "--regex", "(yes|no)", *extra])
    assert re.fullmatch("(yes|no)", capsys.readouterr().out.strip())
    gen_cli.main(["--prompt", PROMPT, "--chat", "--json-schema", str(schema), "--max-tokens", "3", *extra])
    out = capsys.readouterr()
    assert "INCOMPLETE" in out.err and not valid(out.out.strip())
    with pytest.raises(SystemExit):
        gen_cli.main(["--prompt", "x", "--regex", "a(("])
    assert "cannot compile the regex grammar" in capsys.readouterr().err


@pytest.mark.slow
def test_200_sampled_generations_parse(default_model):
    """The bar on the default model: 200 generations at temperature 1, one seed each, in batches of 50."""
    model, tokenizer, _ = default_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = Grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)), tokenizer, model.config.vocab_size,
                    model.config.eos_token_ids)  # fmt: skip
        prompt = encode_prompt(tokenizer, PROMPT, chat=True)
        results = []
        for batch in range(4):
            params = [SamplingParams(temperature=1.0, seed=50 * batch + i, max_tokens=64) for i in range(50)]
            out = generate(model, [prompt] * 50, params, grammar=g)
            for toks, reason, flag in zip(out.tokens, out.finish_reasons, out.grammar_incomplete):
                results.append((tokenizer.decode(toks, skip_special_tokens=True), reason, flag))
    finally:
        torch.set_num_threads(threads)
    flagged = [r for r in results if r[2]]
    for text, reason, flag in results:
        if flag:
            assert reason == "length" and not valid(text), (reason, text)
        else:
            assert valid(text), (reason, text)
    print(f"\n200 generations: {200 - len(flagged)} valid, {len(flagged)} cut by max_tokens (flagged)")
    assert len(flagged) < 20
