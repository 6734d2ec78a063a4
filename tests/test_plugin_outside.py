"""Issue 38's bar: a speculator and a quantizer defined in a package the test writes into tmp_path (outside the
repository, no qspec file edited) run in generate, the server, specbench and an experiments config, and the
quantized checkpoint reloads. Oracles: plain greedy decoding (a lossless speculator must reproduce it), the
plug-in's own in-memory quantization (the reloaded checkpoint must give its logits), and the counters of drafts."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from runtime.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
PKG = "qspec_outside_plugin"
SPEC = f"{PKG}.methods:RepeatLast"
QUANT = f"{PKG}.methods:SignMagnitude"
PROMPT = "one two three one two three one two"

# A speculator that drafts its row's last token k times (valid, proposes every step) and a symmetric RTN quantizer
# per group: both written against qspec's public base classes only.
SOURCE = """
import torch
from quantize.qlinear import QuantizedWeight
from quantize.registry import WeightQuantizer
from speculate.base import Proposal, Speculator


class RepeatLast(Speculator):
    name = "repeat-last"

    def __init__(self, target, k: int = 2):
        self.k = k

    def max_tokens_per_step(self):
        return self.k + 1

    def propose(self, state):
        last = torch.tensor([seq[-1] for seq in state.token_ids], dtype=torch.long)
        num = torch.full((len(last),), self.k, dtype=torch.long)
        return Proposal(tokens=last[:, None].repeat(1, self.k).to(state.device), num_drafted=num.to(state.device))


class SignMagnitude(WeightQuantizer):
    name = "sign-magnitude"

    def quantize_weight(self, weight, cfg, name):
        out_f, in_f = weight.shape
        g = cfg.group_size_for(in_f, name)
        w = weight.float().reshape(out_f, -1, g)
        half = 2 ** (cfg.bits - 1)
        scales = (w.abs().amax(-1) / (half - 1)).clamp(min=1e-8).half().float()
        codes = (w / scales[..., None]).round().clamp(1 - half, half - 1) + half
        zeros = torch.full_like(scales, float(half))
        return QuantizedWeight(codes.reshape(out_f, in_f).to(torch.uint8), scales, zeros, cfg.bits, g)
"""


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """The plug-in package in tmp_path, importable in-process and by every subprocess qspec starts."""
    root = tmp_path / "site"
    (root / PKG).mkdir(parents=True)
    (root / PKG / "__init__.py").write_text("")
    (root / PKG / "methods.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(root))
    paths = [str(root), str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    return root


def generate_text(capsys, argv: list[str]) -> str:
    from runtime.generate import main

    main(argv)
    return capsys.readouterr().out


def test_generate_runs_an_outside_speculator_and_reloads_an_outside_quantizers_checkpoint(
    outside, tiny_checkpoint, tmp_path, capsys
):
    from quantize.plugin import main as quantize_main
    from quantize.qlinear import QuantLinear
    from quantize.registry import build as build_quantizer

    base = ["--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "12"]
    plain = generate_text(capsys, base)
    assert generate_text(capsys, [*base, "--speculator", SPEC, "-k", "2"]) == plain  # greedy: lossless
    out = tmp_path / "q"
    quantize_main(["--method", QUANT, "--model", str(tiny_checkpoint), "--bits", "4", "--group-size", "32", "--out",
                   str(out)])  # fmt: skip
    reloaded, _, _ = load_model(str(out))
    assert any(isinstance(m, QuantLinear) for m in reloaded.modules())
    model, _, _ = load_model(str(tiny_checkpoint))
    quantizer = build_quantizer(QUANT)
    from quantize.config import QuantConfig

    oracle = quantizer.quantize_model(copy.deepcopy(model), quantizer.config(QuantConfig(bits=4, group_size=32)))
    layers = {n: m for n, m in reloaded.named_modules() if isinstance(m, QuantLinear)}
    assert layers and set(layers) == {n for n, m in oracle.named_modules() if isinstance(m, QuantLinear)}
    for name, layer in layers.items():  # the checkpoint holds exactly the plug-in's in-memory grid
        expected = oracle.get_submodule(name).qweight().dequantize()
        torch.testing.assert_close(layer.qweight().dequantize(), expected, rtol=0, atol=1e-6)
    assert generate_text(capsys, ["--model", str(out), "--prompt", PROMPT, "--max-tokens", "4"]).strip()


@pytest.mark.slow  # ~12 s (a server start); the server builds speculators through the registry generate uses
def test_server_serves_a_completion_with_an_outside_speculator(outside, tiny_checkpoint, capsys):
    aiohttp = pytest.importorskip("aiohttp")
    from tests.serve_helpers import running_server, wait_idle

    plain = generate_text(capsys, ["--model", str(tiny_checkpoint), "--prompt", PROMPT, "--max-tokens", "12"])

    async def complete(url):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                text = (await r.json())["choices"][0]["text"]
            return text, await wait_idle(s, url)

    with running_server(tiny_checkpoint, "--speculator", SPEC, "-k", "2") as url:
        text, metrics = asyncio.run(complete(url))
    assert text in plain  # generate prints the prompt's continuation (possibly with the prompt)
    assert metrics["qspec_spec_tokens_proposed_total"] > 0


def test_specbench_smoke_runs_an_outside_speculator(outside, tmp_path):
    from evals.speculation.specbench import main

    out = tmp_path / "s.json"
    main(["--smoke", "--per-category", "1", "--batch-sizes", "1", "--max-tokens", "6", "--warmup", "0",
          "--categories", "qa", "--methods", "plain", f"{SPEC}:k=2", "--strict", "--out", str(out)])  # fmt: skip
    rows = [r for r in json.loads(out.read_text())["rows"] if r["method"] == f"{SPEC}:k=2"]
    assert rows and all(r["tokens"] > 0 for r in rows)


def test_experiments_config_runs_outside_speculator_and_quantizer_rows(outside, tiny_checkpoint, tmp_path):
    from experiments.records import read_jsonl
    from experiments.run import main

    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["name"] = "outside"
    data["model"] = {"spec": str(tiny_checkpoint)}
    data["rows"] = [
        {"name": "fp32 reference", "kind": "reference", "lossless_class": "exact", "run_bench": False},
        {"name": "outside spec", "kind": "speculative", "lossless_class": "same distribution",
         "params": {"speculator": SPEC, "k": 2}, "run_bench": False},
        {"name": "outside quant", "kind": "quantized", "lossless_class": "approximate",
         "params": {"method": QUANT, "bits": 4, "group_size": 32}, "run_bench": False},
    ]  # fmt: skip
    path = tmp_path / "outside.yaml"
    path.write_text(yaml.safe_dump(data))
    main([str(path), "--results-dir", str(tmp_path / "out"), "--store", str(tmp_path / "store")])
    records = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "out" / "outside" / "records.jsonl")}
    assert all(r["status"] == "ok" for r in records.values()), {k: r.get("error") for k, r in records.items()}
    spec, quant = records["outside spec"]["results"], records["outside quant"]["results"]
    assert spec["speculator"] == "repeat-last" and spec["greedy"]["match_rate"] == 1.0  # lossless: plain greedy
    assert (
        quant["fidelity"]["max_abs_dlogprob"] > 0
        and quant["weight_bytes"] < records["fp32 reference"]["results"]["weight_bytes"]
    )
    assert load_model(quant["checkpoint"])[0] is not None  # the row's checkpoint reloads by its directory
