"""The layer-by-layer calibration pass: staged forward == the model's own forward, true-sequential inputs,
quantized outputs fed forward, and layer-by-layer loading from safetensors shards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quantize.calibration import LayerAlgorithm, ShardedCheckpoint, calibrate, layer0_inputs, run_layer
from quantize.config import QuantConfig
from quantize.gptq import GPTQ, GPTQConfig
from quantize.qlinear import QuantLinear
from runtime.model import random_model
from tests.tiny_models import TINY_CONFIGS


class Recorder(LayerAlgorithm):
    """Records every stage's inputs; optionally RTN-quantizes each stage (to check what later stages see)."""

    def __init__(self, quantize: bool):
        self.seen: dict[str, torch.Tensor] = {}
        self.quantize = quantize

    def quantize_stage(self, stage):
        self.seen[stage.full_name] = torch.cat(stage.inputs)
        if self.quantize:
            from quantize.qlinear import quant_linear, set_module
            from quantize.rtn import quantize_weight

            cfg = QuantConfig(bits=3, group_size=32)
            qw = quantize_weight(stage.linear.weight, cfg, stage.linear.bias)
            set_module(stage.owner, stage.path, quant_linear(qw, cfg.act_quant, stage.linear))


def hooked_inputs(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Oracle: every linear's input during the model's ordinary forward, via forward hooks."""
    seen = {}
    handles = [
        mod.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0]))
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear | QuantLinear) and name != "lm_head"
    ]
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-tied-mha"])
def test_staged_layer_forward_equals_model_forward(name):
    model = random_model(TINY_CONFIGS[name], seed=1)
    tokens = torch.randint(0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0))
    xs, rope = layer0_inputs(model, tokens, batch_size=4)
    assert torch.equal(torch.cat(xs), model.embed_tokens(tokens))
    with torch.no_grad():
        for layer in model.layers:
            staged = run_layer(layer, xs, rope, lambda stage: None)
            direct = [layer(x, *r, None) for x, r in zip(xs, rope)]
            for a, b in zip(staged, direct):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            xs = staged


def test_true_sequential_inputs_come_from_quantized_predecessors():
    model = random_model(TINY_CONFIGS["llama"], seed=2)
    tokens = torch.randint(0, 96, (4, 20), generator=torch.Generator().manual_seed(1))
    rec = Recorder(quantize=True)
    calibrate(model, tokens, rec, batch_size=3)
    # The finished model's own forward (every linear quantized) feeds each linear exactly what the pass
    # showed the algorithm: o_proj saw quantized q/k/v, layer 1 saw layer 0's quantized output, and so on.
    oracle = hooked_inputs(model, tokens)
    assert set(oracle) == set(rec.seen)
    for name, x in oracle.items():
        torch.testing.assert_close(rec.seen[name], x.reshape(rec.seen[name].shape), rtol=0, atol=1e-5)
    # ... which differ from the float model's inputs (so the test can tell the two apart)
    float_inputs = hooked_inputs(random_model(TINY_CONFIGS["llama"], seed=2), tokens)
    assert not torch.allclose(float_inputs["layers.0.self_attn.o_proj"], oracle["layers.0.self_attn.o_proj"])


def test_bad_calibration_data_is_refused():
    model = random_model(TINY_CONFIGS["llama"], seed=0)
    algo = Recorder(quantize=False)
    with pytest.raises(ValueError, match="non-empty"):
        calibrate(model, torch.zeros(0, 16, dtype=torch.long), algo)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        calibrate(model, torch.zeros(4, 1, dtype=torch.long), algo)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\)"):
        calibrate(model, torch.full((2, 8), 96), algo)


class LoadOrder(ShardedCheckpoint):
    """Records, at each layer load, which decoder layers still hold float (nn.Linear) weights in memory."""

    def __init__(self, path, model_ref):
        super().__init__(path)
        self.model_ref = model_ref
        self.float_layers_at_load: list[list[int]] = []

    def layer(self, i):
        model = self.model_ref[0]
        resident = [
            j
            for j, layer in enumerate(model.layers)
            if any(isinstance(m, nn.Linear) and m.weight.device.type != "meta" for m in layer.modules())
        ]
        self.float_layers_at_load.append(resident)
        return super().layer(i)


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "qwen2"])
def test_sharded_layer_by_layer_gptq_equals_in_memory(tmp_path, name):
    from runtime.loader import save_checkpoint

    cfg = TINY_CONFIGS[name]
    model = random_model(cfg, seed=3)
    save_checkpoint(model, tmp_path, max_shard_bytes=20_000)  # many shards: a layer spans several
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 4
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    qcfg = QuantConfig(bits=4, group_size=16)

    in_memory = calibrate(copy.deepcopy(model), tokens, GPTQ(qcfg, GPTQConfig(act_order=True)), batch_size=2)

    ref: list = [None]
    source = LoadOrder(tmp_path, ref)
    skeleton = source.skeleton()
    ref[0] = skeleton
    assert all(p.device.type == "meta" for p in skeleton.layers.parameters())
    streamed = calibrate(skeleton, tokens, GPTQ(qcfg, GPTQConfig(act_order=True)), batch_size=2, source=source)

    # one float layer at a time: when layer i is read, no earlier layer holds float linear weights
    assert source.float_layers_at_load == [[] for _ in range(cfg.num_layers)]
    layer_reads = [n for n in source.reads if n.startswith("model.layers.")]
    assert [int(n.split(".")[2]) for n in layer_reads] == sorted(int(n.split(".")[2]) for n in layer_reads)
    for (n1, a), (n2, b) in zip(in_memory.named_buffers(), streamed.named_buffers()):
        assert n1 == n2
        assert torch.equal(a, b), n1
    torch.testing.assert_close(streamed(tokens), in_memory(tokens), rtol=0, atol=1e-5)


def test_sharded_source_refuses_a_non_checkpoint(tmp_path):
    from runtime.loader import ModelSpecError

    with pytest.raises(ModelSpecError, match="not a checkpoint"):
        ShardedCheckpoint(tmp_path)


@pytest.mark.slow
@pytest.mark.integration
def test_default_model_gptq_beats_rtn(default_model):
    """On SmolLM2-135M, 4-bit g128 asym: GPTQ with act-order has lower perplexity than RTN (small protocol:
    8 calibration windows of 256 tokens, 2 evaluation windows of 512)."""
    from evals.quality.perplexity import perplexity
    from quantize.rtn import quantize_model as rtn_quantize
    from runtime.data import calibration_windows, wiki_text

    model, tokenizer, _ = default_model
    qcfg = QuantConfig(bits=4, group_size=128)
    tokens = torch.tensor(calibration_windows(tokenizer, 8, 256, seed=0))
    gptq_model = calibrate(copy.deepcopy(model), tokens, GPTQ(qcfg, GPTQConfig(act_order=True)), batch_size=4)
    rtn_model = rtn_quantize(copy.deepcopy(model), qcfg)
    text = wiki_text("eval")
    ppl = {
        name: perplexity(m, tokenizer, text, 512, max_windows=2).perplexity
        for name, m in (("fp32", model), ("rtn", rtn_model), ("gptq", gptq_model))
    }
    assert ppl["fp32"] < ppl["gptq"] < ppl["rtn"], ppl
