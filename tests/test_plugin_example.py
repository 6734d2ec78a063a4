"""The worked example outside the qspec packages (examples/qspec_plugin_example) runs through the registries by
module:attr name with no qspec file edited; the quantizer's checkpoint reloads; the broken control is rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evals.speculation.testing import assert_lossless, assert_same_distribution, sharpened_draft, tiny_target
from quantize import plugin as quant_plugin
from quantize import registry as qreg
from quantize.qlinear import QuantLinear
from runtime.decoding import generate
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate
from speculate.ngram import lookup
from speculate.registry import BuildContext, build, check_method
from tests.tiny_models import TINY_CONFIGS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LOOKUP = "qspec_plugin_example.lookup:PromptLookup"
ABSMAX = "qspec_plugin_example.absmax:Absmax"
CLIP = "qspec_plugin_example.clipsearch:ClipSearch"
SMOKE = BuildContext(smoke=True)


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_example_lookup_matches_the_builtin_lookup():
    """The plug-in's lookup, written independently, drafts what speculate.ngram's unscaled lookup drafts."""
    from qspec_plugin_example.lookup import follow

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seq = torch.randint(0, 5, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        assert follow(seq.tolist(), 4, 3) == lookup(seq, 4, 3, 1, scaled=False).tolist()


def test_example_speculator_by_module_attr_is_greedy_identical_and_drafts():
    method = check_method(f"{LOOKUP}:k=3")
    assert method.options == {"k": 3}
    target = random_model(TINY_CONFIGS["llama"], seed=0)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]  # repeats: the lookup finds matches
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = speculative_generate(target, prompts, params, build(method, target, SMOKE))
    assert out.tokens == generate(target, prompts, params).tokens
    assert out.stats.drafted > 0


def test_example_speculator_passes_assert_lossless():
    figures = assert_lossless(lambda target: build(f"{LOOKUP}:k=2", target, SMOKE))
    assert figures["p_value"] >= 1e-3


def test_broken_control_is_rejected_and_the_honest_draft_passes():
    """The same layer-skip draft, honest and with q reported at T=0.8: the test passes one, rejects the other (both
    seeded, so reproducible; the honest one fails with probability <= 1e-3 over seeds)."""
    honest = assert_same_distribution(lambda t: build("draft:k=2,layers=1", t, SMOKE))
    assert honest["acceptance"] > 0.1  # drafts were offered and accepted: the test saw the verifier at work
    with pytest.raises(AssertionError, match="not distributed as the target's"):
        assert_same_distribution(lambda t: sharpened_draft(t, SMOKE, k=2, layers=1))
    # by name, like any plug-in
    assert check_method("evals.speculation.testing:sharpened_draft:layers=1").options == {"layers": 1}


def absmax_oracle(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Symmetric absmax fake quantization, written directly: what the example's codes must dequantize to."""
    out = torch.empty_like(w)
    q = 2 ** (bits - 1) - 1
    for g in range(0, w.shape[1], group):
        block = w[:, g : g + group]
        scale = (block.abs().amax(1, keepdim=True) / q).clamp(min=1e-8).half().float()
        out[:, g : g + group] = (block / scale).round().clamp(-q, q) * scale
    return out


def test_example_quantizer_cli_saves_a_checkpoint_that_reloads(tiny_checkpoint, tmp_path):
    from runtime.loader import load_model

    out = tmp_path / "absmax"
    argv = ["--method", ABSMAX, "--model", str(tiny_checkpoint), "--bits", "4", "--group-size", "32"]
    record = quant_plugin.main([*argv, "--out", str(out), "--dense-dtype", "fp32"])
    assert record["format"] == "gptq" and record["quant_config"]["quant_method"] == "absmax"
    assert json.loads((out / "qspec_quantize.json").read_text())["quant_config"]["quantizer"] == ABSMAX
    float_model, _, _ = load_model(str(tiny_checkpoint))
    reloaded, _, _ = load_model(str(out))
    layers = [(n, m) for n, m in reloaded.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for name, layer in layers:
        expected = absmax_oracle(float_model.get_submodule(name).weight.detach().float(), 4, 32)
        torch.testing.assert_close(layer.qweight().dequantize(), expected, rtol=0, atol=1e-6)
        layer.set_path("reference")
    in_memory = qreg.build(ABSMAX).quantize_model(float_model, qreg.QuantConfig(bits=4, group_size=32))
    tokens = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens), in_memory(tokens))  # the same tensors on the same path


@pytest.mark.parametrize(
    "method, message",
    [
        ("no_such_pkg.mod:Thing", "cannot import module 'no_such_pkg.mod'"),
        (LOOKUP, "is not a quantizer: it lacks quantize_model(model, cfg)"),
        ("quantize.registry:WeightQuantizer", "lacks quantize_weight(weight, cfg, name)"),
        (f"{ABSMAX}:bits=3", "unknown option 'bits'"),
        (f"{ABSMAX}:shrink=big", "must be a number"),
        ("nosuch", "unknown quantizer 'nosuch'"),
    ],
)
def test_bad_quantizer_plugin_is_one_line_before_any_model_loads(method, message, capsys):
    with pytest.raises(SystemExit) as exc:
        quant_plugin.main(["--method", method, "--model", "/no/such/model", "--out", "/tmp/never"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_quantizer_entry_point_and_builtins_share_the_table(monkeypatch):
    monkeypatch.setattr(
        qreg.plugins, "entry_points", lambda group: {"absmax": ABSMAX} if group == qreg.ENTRY_POINT_GROUP else {}
    )
    assert qreg.check_method("absmax:shrink=0.5").options == {"shrink": 0.5}
    assert qreg.build("absmax:shrink=0.5").shrink == 0.5
    assert qreg.module_of("absmax") == ("quantize.plugin", ["--method", "absmax"])
    assert qreg.module_of("gptq") == ("quantize.gptq", [])
    with pytest.raises(qreg.QuantizerError, match="needs calibration data"):
        qreg.build("gptq")


def test_experiments_quantized_row_builds_a_plugin_checkpoint_with_quantize_plugin(tiny_checkpoint):
    from experiments.rows import quantized_artifact

    art = quantized_artifact(str(tiny_checkpoint), {"method": f"{ABSMAX}:shrink=0.9", "bits": 4, "group_size": 32})
    assert art.module == "quantize.plugin"
    assert art.args == ("--method", f"{ABSMAX}:shrink=0.9", "--bits", "4", "--group-size", "32")
    assert ":" not in art.label and "=" not in art.label
    assert quantized_artifact(str(tiny_checkpoint), {"method": "rtn", "group_size": 32}).module == "quantize.rtn"
    with pytest.raises(ValueError, match="unknown quantizer"):
        quantized_artifact(str(tiny_checkpoint), {"method": "nosuch"})


def clip_search_oracle(w: torch.Tensor, x: torch.Tensor, bits: int, group: int, ratios: list[float]) -> torch.Tensor:
    """The clip search written directly, one (row, group) at a time: the asymmetric grid of the group's shrunk
    range whose dequantized weights give the smallest sum of squared output errors over the tokens x [n, in]."""
    top = 2**bits - 1
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], group):
            block, xs = w[r, g : g + group], x[:, g : g + group]
            best, best_err = None, float("inf")
            for ratio in ratios:
                hi, lo = max(float(block.max()), 0.0) * ratio, min(float(block.min()), 0.0) * ratio
                scale = torch.tensor(max((hi - lo) / top, 1e-8)).half().float()
                zero = torch.clamp(torch.round(-lo / scale), 0, top)
                deq = (torch.clamp(torch.round(block / scale + zero), 0, top) - zero) * scale
                err = float((xs @ (block - deq)).square().sum())
                if err < best_err:
                    best, best_err = deq, err
            out[r, g : g + group] = best
    return out


def test_calibrated_plugin_sees_each_linears_inputs_and_its_search_matches_the_oracle(tiny_checkpoint, monkeypatch):
    """qspec's calibration pass hands a CalibratedQuantizer each linear's inputs with every earlier linear already
    quantized: exactly what that linear receives in the finished quantized model (captured here by hooks). The
    example's clip search equals a direct per-group search on those inputs."""
    from qspec_plugin_example.clipsearch import ClipSearch

    from runtime.loader import load_model

    seen: dict[str, torch.Tensor] = {}
    search = ClipSearch.quantize_weight

    def recording(self, weight, cfg, name, inputs):
        seen[name] = torch.cat([b.reshape(-1, weight.shape[1]) for b in inputs])
        return search(self, weight, cfg, name, inputs)

    monkeypatch.setattr(ClipSearch, "quantize_weight", recording)
    model, _, _ = load_model(str(tiny_checkpoint))
    float_weight = model.layers[1].mlp.down_proj.weight.detach().float().clone()
    tokens = torch.randint(0, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    quantizer = qreg.build(f"{CLIP}:steps=5")
    cfg = qreg.QuantConfig(bits=3, group_size=32)
    with pytest.raises(qreg.QuantizerError, match="needs calibration tokens"):
        quantizer.quantize_model(model, cfg)
    quantizer.quantize_model(model, cfg, tokens, batch_size=2)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(layers) == sorted(seen) and len(layers) == 8
    captured: dict[str, torch.Tensor] = {}

    def capture(module, args, name):
        captured[name] = args[0].reshape(-1, module.in_features)

    for name, layer in layers.items():
        layer.set_path("reference")
        layer.register_forward_pre_hook(lambda m, args, name=name: capture(m, args, name))
    with torch.no_grad():
        model(tokens)
    for name in layers:
        torch.testing.assert_close(seen[name], captured[name], rtol=1e-5, atol=1e-5)
    name = "layers.1.mlp.down_proj"  # the last linear: its inputs went through every quantized layer before it
    expected = clip_search_oracle(float_weight, seen[name], 3, 32, quantizer.ratios())
    torch.testing.assert_close(layers[name].qweight().dequantize(), expected, rtol=0, atol=1e-6)


def test_calibrated_plugin_cli_saves_a_checkpoint_that_reloads_with_its_stats(tiny_checkpoint, tmp_path):
    from runtime.loader import load_model

    out = tmp_path / "clip"
    argv = ["--method", f"{CLIP}:steps=3", "--model", str(tiny_checkpoint), "--bits", "3", "--group-size", "32"]
    record = quant_plugin.main([*argv, "--nsamples", "4", "--seqlen", "32", "--out", str(out), "--dense-dtype", "fp32"])
    qc = record["quant_config"]
    assert qc["quant_method"] == "clip-search" and qc["nsamples"] == 4 and qc["quantizer"] == f"{CLIP}:steps=3"
    stats = record["stats"]["layers"]
    assert len(stats) == 8 and all(0 < s["output_rel_error"] < 1 for s in stats)
    reloaded, _, _ = load_model(str(out))
    assert sum(isinstance(m, QuantLinear) for m in reloaded.modules()) == 8
    assert not (tmp_path / "clip.layers.partial").exists()
    # an in-memory plug-in takes no calibration flags
    with pytest.raises(SystemExit):
        quant_plugin.main(["--method", ABSMAX, "--model", str(tiny_checkpoint), "--nsamples", "4"])


def test_calibrated_plugin_contract_and_experiment_rows(tiny_checkpoint):
    from experiments.rows import quantized_artifact

    assert qreg.resolve(CLIP).calibrated and not qreg.resolve(ABSMAX).calibrated
    art = quantized_artifact(str(tiny_checkpoint), {"method": CLIP, "bits": 3, "group_size": 32, "calib": "wiki-fr"})
    assert art.module == "quantize.plugin" and art.args[-2:] == ("--calib", "wiki-fr")
    with pytest.raises(qreg.QuantizerError, match=r"lacks quantize_weight\(weight, cfg, name, inputs\)"):
        qreg.build("quantize.registry:CalibratedQuantizer")


def test_verdict_judges_a_calibrated_plugin_on_its_calibration_tokens():
    """The verdict quantizes a calibrated plug-in with the tokens it is given (not the eval sequences) and calls it
    approximate; the same tokens through quantize_model give the logits it scored."""
    from evals.quality.fidelity import model_scorer
    from evals.speculation import lossless

    target = random_model(TINY_CONFIGS["llama"], seed=0)
    sequences = torch.randint(1, 96, (3, 24), generator=torch.Generator().manual_seed(1)).tolist()
    calibration = torch.randint(1, 96, (4, 32), generator=torch.Generator().manual_seed(2))
    v = lossless.quantizer_verdict(target, f"{CLIP}:steps=3", sequences, calibration=calibration)
    assert v.verdict == "approximate" and v.figures["calibration"] == {"text": "wiki", "windows": 4, "seqlen": 32}
    cfg = qreg.QuantConfig(bits=4, group_size=64)
    direct = qreg.build(f"{CLIP}:steps=3").quantize_model(random_model(TINY_CONFIGS["llama"], seed=0), cfg, calibration)
    again = lossless.compare_teacher_forced(model_scorer(target), model_scorer(direct), sequences)
    assert again.max_abs_dlogprob_vocab == v.figures["max_abs_dlogprob_vocab"]


def test_tiny_target_is_seeded():
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(tiny_target()(tokens), tiny_target()(tokens))
