"""`python -m runtime.server --speculator X` for every speculator: greedy completions of concurrent requests
through the server equal runtime.generate's, speculation really ran (accepted drafts in /metrics), and no KV
block is left in use afterwards. Tiny random model with the real tokenizer; Medusa heads are random (exactness
must not depend on their quality) and saved for that model, with an accuracy table so the server builds a
tree."""

from __future__ import annotations

import asyncio

import pytest
import torch

aiohttp = pytest.importorskip("aiohttp")

from runtime.decoding import generate  # noqa: E402
from runtime.loader import load_model, load_tokenizer  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from runtime.server import main as server_main  # noqa: E402
from speculate.eagle.head import EagleConfig, EagleHead  # noqa: E402
from speculate.medusa.heads import MedusaConfig, MedusaHeads, model_fingerprint  # noqa: E402
from tests.serve_helpers import running_server, wait_idle  # noqa: E402

PROMPTS = [
    "one two three four one two three four one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Rome Rome Rome Rome",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def medusa_dir(tiny_checkpoint, tmp_path_factory):
    model, _, _ = load_model(str(tiny_checkpoint))
    cfg = MedusaConfig(num_heads=3, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
    cfg.base_fingerprint = model_fingerprint(model)
    cfg.accuracy = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
    heads = MedusaHeads(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return heads.save(tmp_path_factory.mktemp("medusa"))


@pytest.fixture(scope="module")
def eagle_dir(tiny_checkpoint, tmp_path_factory):
    model, _, _ = load_model(str(tiny_checkpoint))
    head = EagleHead(EagleConfig.for_model(model))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return head.save(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    model, _, _ = load_model(str(tiny_checkpoint))
    tokenizer = load_tokenizer(str(tiny_checkpoint))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for text in PROMPTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        out.append(tokenizer.decode(generate(model, [ids], params).tokens[0], skip_special_tokens=True))
    return out


SPECULATORS = {
    "ngram": ["-k", "4"],
    "draft": ["--draft-model", "layers:1", "-k", "3"],
    "quant-draft": ["--quant-bits", "8", "-k", "3"],
    "medusa": ["--tree-size", "6"],  # --medusa-heads added below
    "eagle": ["--tree-size", "6"],  # --eagle-heads added below
}


# quant-draft and eagle (~10 s each) under -m slow: the server wires them through the same engine paths as "draft"
# and "medusa" (a candidate tree); EAGLE's own exactness is tested on generate and the engine by default
SERVED = [pytest.param(n, marks=pytest.mark.slow) if n in ("quant-draft", "eagle") else n for n in SPECULATORS]


@pytest.mark.parametrize("name", SERVED)
def test_server_speculator_greedy_equals_generate(name, tiny_checkpoint, medusa_dir, eagle_dir, expected):
    extra = ["--speculator", name, *SPECULATORS[name]]
    if name == "medusa":
        extra += ["--medusa-heads", str(medusa_dir)]
    if name == "eagle":
        extra += ["--eagle-heads", str(eagle_dir)]

    async def complete(session, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["text"]

    async def run():
        async with aiohttp.ClientSession() as s:
            texts = await asyncio.gather(*(complete(s, p) for p in PROMPTS))  # concurrent: one engine batch
            m = await wait_idle(s, url)
            return texts, m

    with running_server(tiny_checkpoint, *extra) as url:
        texts, m = asyncio.run(run())
    assert texts == expected
    assert m["qspec_spec_tokens_proposed_total"] > 0
    assert m["qspec_spec_tokens_accepted_total"] > 0 or name == "eagle"  # a random EAGLE head's guesses miss here
    assert m["qspec_kv_blocks_used"] == 0


def test_server_rejects_a_bad_speculator_option(tiny_checkpoint, capsys):
    for args, message in [
        (["--speculator", "ngram", "-k", "0"], "must be >= 1"),
        (
            ["--speculator", "eagle", "--eagle-heads", "/nonexistent"],
            "train one with `python -m speculate.eagle.train`",
        ),
        (["--speculator", "eager"], "unknown speculator 'eager'; choose from ngram, draft, medusa"),
        (["--speculator", "medusa", "--medusa-heads", "/nonexistent"], "not a Medusa checkpoint"),
        (["--speculator", "quant-draft", "--quant-bits", "3"], "quant-draft supports 4 or 8 bits, got 3"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            server_main(["--model", str(tiny_checkpoint), *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
