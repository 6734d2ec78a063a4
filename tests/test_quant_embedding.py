"""QuantEmbedding: a tied embedding that reads its rows from the quantized lm_head. Rows against the reference
dequantization of the QuantizedWeight, models against a dense model built from the dequantized weights, the
memory left, the checkpoint round trip, and the errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from formats_helpers import rtn_quantize
from safetensors.torch import load_file, save_file
from torch import nn

from quantize import int8, rtn
from quantize.awq import AWQ, AWQConfig
from quantize.calibration import calibrate
from quantize.config import QuantConfig
from quantize.formats import linear_layout, save_quantized
from quantize.gptq import GPTQ, GPTQConfig
from quantize.kernels import cpu
from quantize.qembedding import QuantEmbedding, shares_quantized_head, tie_quantized_embedding
from quantize.qlinear import QuantLinear, set_module
from runtime.loader import load_model
from runtime.model import Transformer, random_model
from tests.tiny_models import TINY_CONFIGS

ROW_CASES = [  # (bits, group_size, sym, act_order, path, vocab, hidden)
    (4, 128, False, False, "cpu_int4", 208, 576),  # the default model's ragged groups; 208 = 3 blocks of 64 + 16
    (4, 128, False, False, "reference", 208, 576),
    (4, 32, True, False, "cpu_int4", 96, 64),
    (4, 32, False, True, "cpu_int4", 96, 64),  # act-order: the int4 pack keeps permuted columns
    (4, 32, False, True, "reference", 96, 64),
    (4, 32, False, False, "triton", 96, 64),  # GPTQ-packed, as the Triton kernels read it
    (4, -1, False, False, "cpu_int4", 80, 64),  # per-channel
    (4, -1, True, False, "reference", 80, 64),
    (3, 32, False, True, "cpu_int4", 48, 64),  # 48 rows: one partial block only
    (2, 128, False, False, "reference", 32, 256),
    (8, -1, True, False, "cpu_int8", 80, 192),  # int8 per-channel
    (8, -1, False, False, "cpu_int8", 80, 192),
    (8, 64, False, True, "cpu_int8", 80, 192),  # group-wise, act-order
    (8, -1, True, False, "cpu_w8a8", 80, 192),
    (8, -1, False, False, "reference", 80, 192),
    (4, 128, False, False, "cpu", 208, 576),  # qspec's own kernel layout: tiles of 16 rows
    (4, 32, False, True, "cpu", 96, 64),
    (3, 32, False, True, "cpu", 48, 64),
    (8, 64, False, True, "cpu", 80, 192),
    (8, -1, True, False, "cpu", 37, 192),  # a ragged last tile
]


@pytest.mark.parametrize("bits,group_size,sym,act_order,path,vocab,hidden", ROW_CASES)
def test_rows_equal_the_reference_dequantized_rows(bits, group_size, sym, act_order, path, vocab, hidden):
    gen = torch.Generator().manual_seed(bits * 1000 + vocab)
    qw = rtn_quantize(torch.randn(vocab, hidden, generator=gen) * 0.05, bits, group_size, sym, act_order, seed=3)
    head = QuantLinear(qw, act_quant=path == "cpu_w8a8", path=path)
    assert head.path == path
    embed = QuantEmbedding(head)
    tokens = torch.randint(0, vocab, (3, 11), generator=gen)
    tokens[0, :3] = torch.tensor([0, vocab - 1, 0])  # both ends of the table, and a repeat
    rows = embed(tokens)
    assert rows.shape == (3, 11, hidden) and rows.dtype == torch.float32
    assert torch.equal(rows, qw.dequantize()[tokens])  # oracle: the QuantizedWeight's reference dequantization
    assert torch.equal(head.row_codes(tokens.reshape(-1)), qw.codes[tokens.reshape(-1)])


def quantize_tied(model: Transformer, algorithm: str) -> Transformer:
    """Quantize decoder linears and the tied lm_head through each quantizer's own entry point."""
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(5))
    qcfg = QuantConfig(bits=4, group_size=16, lm_head=True)
    if algorithm == "rtn":
        return rtn.quantize_model(model, qcfg)
    if algorithm == "int8":
        return int8.quantize_model(model, lm_head=True)[0]
    if algorithm == "gptq":
        return calibrate(model, tokens, GPTQ(qcfg, GPTQConfig(act_order=True)), batch_size=2, lm_head=True)
    return calibrate(model, tokens, AWQ(qcfg, AWQConfig(search_windows=2), batch_size=2), 2, lm_head=True)


def dense_oracle(quantized: Transformer) -> Transformer:
    """A plain Transformer with every linear (and the tied embedding/head) = the dequantized weight, and the
    quantized model's norms (AWQ folds scales into them)."""
    oracle = Transformer(quantized.config)
    assert oracle.lm_head.weight is oracle.embed_tokens.weight  # one dense tensor: embedding and head
    with torch.no_grad():
        for name, p in quantized.named_parameters():
            oracle.get_parameter(name).copy_(p)
        for name, module in quantized.named_modules():
            if isinstance(module, QuantLinear):
                target = oracle.get_submodule(name)
                target.weight.copy_(module.qweight().dequantize())
                if module.bias is not None:
                    target.bias.copy_(module.bias)
    return oracle.eval()


@pytest.mark.parametrize("algorithm", ["rtn", "int8", "gptq", "awq"])
@pytest.mark.parametrize("name", ["llama-tied-mha", "qwen3"])
def test_quantized_tied_head_serves_as_embedding_and_logits_match_dense(algorithm, name):
    cfg = TINY_CONFIGS[name]
    model = quantize_tied(random_model(cfg, seed=1), algorithm)
    assert isinstance(model.lm_head, QuantLinear) and shares_quantized_head(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    oracle = dense_oracle(model)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), oracle(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-tied-mha", "qwen3"])
def test_no_full_precision_table_is_left(name):
    cfg = TINY_CONFIGS[name]
    dense_head = rtn.quantize_model(random_model(cfg, seed=0), QuantConfig(bits=8, group_size=-1))
    shared = rtn.quantize_model(random_model(cfg, seed=0), QuantConfig(bits=8, group_size=-1, lm_head=True))

    def tensors(model):
        seen = {}
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t is not None and not n.endswith("inv_freq"):
                seen.setdefault(t.data_ptr(), (n, t))
        return list(seen.values())

    def nbytes(model):
        return sum(t.numel() * t.element_size() for _, t in tensors(model))

    # what is left: norms (the only parameters) and the QuantLinear buffers (codes, scales, zeros)
    assert all(n.endswith("norm.weight") for n, _ in shared.named_parameters())
    quantized = [m for m in shared.modules() if isinstance(m, QuantLinear)]
    norms = sum(p.numel() * p.element_size() for p in shared.parameters())
    assert nbytes(shared) == norms + sum(m.weight_bytes() for m in quantized)
    big = cfg.vocab_size * cfg.hidden_size
    assert not any(t.is_floating_point() and t.numel() >= big for _, t in tensors(shared))
    # vs the head quantized alone: the fp32 table is gone and one int8 copy of it (plus scales) came in
    head = shared.lm_head
    assert nbytes(dense_head) - nbytes(shared) == 4 * big - head.weight_bytes()
    assert head.weight_bytes() < 1.2 * big


def quantize_for_checkpoint(model: Transformer, bits: int, group_size: int, act_order: bool, min_zero: int):
    """Reference QuantLinears with RTN codes for every linear and the tied head, then the shared embedding."""
    for name, _ in linear_layout(model, quantized_head=True):
        lin = model.get_submodule(name)
        qw = rtn_quantize(lin.weight.detach(), bits, group_size, act_order=act_order, seed=lin.in_features)
        qw.zeros.clamp_(min=min_zero)
        qw.bias = None if lin.bias is None else lin.bias.detach().clone()
        set_module(model, name, QuantLinear(qw))
    tie_quantized_embedding(model)
    return model


@pytest.mark.parametrize(
    "fmt,bits,group_size,act_order",
    [("gptq_v2", 4, 32, False), ("gptq_v2", 4, 32, True), ("gptq", 8, -1, False), ("awq", 4, 32, False)],
)
def test_save_load_round_trip_keeps_one_packed_table(tmp_path, fmt, bits, group_size, act_order):
    cfg = TINY_CONFIGS["qwen3"]  # tied embeddings
    model = quantize_for_checkpoint(random_model(cfg, seed=2), bits, group_size, act_order, int(fmt == "gptq"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    before = model(tokens)
    out = save_quantized(model, tmp_path / "q", {}, fmt=fmt, dense_dtype=torch.float32)
    saved = load_file(out / "model.safetensors")
    assert "lm_head.qweight" in saved and "model.embed_tokens.weight" not in saved
    if fmt != "awq":
        assert json.loads((out / "config.json").read_text())["quantization_config"]["lm_head"] is True
    loaded, _, _ = load_model(str(out))
    assert shares_quantized_head(loaded)
    assert torch.equal(loaded.lm_head.qweight().codes, model.lm_head.qweight().codes)
    assert torch.equal(loaded(tokens), before)
    again = save_quantized(loaded, tmp_path / "q2", {}, fmt=fmt, dense_dtype=torch.float32)
    second = load_file(again / "model.safetensors")
    assert saved.keys() == second.keys() and all(torch.equal(saved[k], second[k]) for k in saved)


def test_checkpoint_with_its_own_dense_embedding_loads_it(tmp_path):
    """A tied checkpoint whose writer kept a dense table next to the quantized head (older qspec checkpoints,
    other tools) loads as written: that table embeds, the quantized head projects."""
    cfg = TINY_CONFIGS["qwen3"]
    model = quantize_for_checkpoint(random_model(cfg, seed=2), 4, 32, False, 0)
    out = save_quantized(model, tmp_path / "q", {}, fmt="gptq_v2")
    tensors = load_file(out / "model.safetensors")
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    save_file({**tensors, "model.embed_tokens.weight": table}, out / "model.safetensors")
    loaded, _, _ = load_model(str(out))
    assert isinstance(loaded.embed_tokens, nn.Embedding) and torch.equal(loaded.embed_tokens.weight, table)
    assert isinstance(loaded.lm_head, QuantLinear)


def test_errors_name_what_cannot_be_shared(monkeypatch):
    untied = rtn.quantize_model(random_model(TINY_CONFIGS["llama"]), QuantConfig(bits=4, group_size=16, lm_head=True))
    assert isinstance(untied.embed_tokens, nn.Embedding)  # untied: the embedding keeps its own weight
    with pytest.raises(ValueError, match="not tied"):
        tie_quantized_embedding(untied)
    plain = rtn.quantize_model(random_model(TINY_CONFIGS["qwen3"]), QuantConfig(bits=4, group_size=16))
    with pytest.raises(ValueError, match=r"lm_head is not quantized \(Linear\)"):
        tie_quantized_embedding(plain)
    with pytest.raises(TypeError, match="reads a QuantLinear"):
        QuantEmbedding(nn.Linear(8, 16))
    qw = rtn_quantize(torch.randn(32, 64), 4, 32)
    qw.bias = torch.zeros(32)
    with pytest.raises(ValueError, match="has a bias"):
        QuantEmbedding(QuantLinear(qw))
    qw.bias = None
    with pytest.raises(IndexError, match=r"token ids must lie in \[0, 32\)"):
        QuantEmbedding(QuantLinear(qw))(torch.tensor([[3, 32]]))

    # an int4 pack that does not keep rows at fixed strides (a future torch) is refused, not misread
    real = cpu.int4_nibble_positions

    def scrambled(n, k):
        pos = real(n, k)
        return pos[torch.randperm(n, generator=torch.Generator().manual_seed(0))] if k == 8 else pos

    monkeypatch.setattr(cpu, "int4_nibble_positions", scrambled)
    cpu.int4_row_layout.cache_clear()
    try:
        layer = QuantLinear(rtn_quantize(torch.randn(112, 64), 4, 32), compute_dtype=torch.bfloat16, path="cpu_int4")
        with pytest.raises(ValueError, match="rows cannot be gathered"):
            QuantEmbedding(layer)
    finally:
        cpu.int4_row_layout.cache_clear()


def test_bf16_model_embeds_in_its_residual_dtype():
    """The bench's shape: plain bf16 model, cpu_int4 head; rows equal a bf16 nn.Embedding of the same weight."""
    cfg = TINY_CONFIGS["qwen3"]
    model = random_model(cfg, seed=0).set_dtype(torch.bfloat16, mixed=False)
    qw = rtn_quantize(model.lm_head.weight.detach().float(), 4, 32)
    set_module(model, "lm_head", QuantLinear(qw, compute_dtype=torch.bfloat16, path="cpu_int4"))
    embed = tie_quantized_embedding(model)
    dense = nn.Embedding.from_pretrained(qw.dequantize().to(torch.bfloat16))
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(embed(tokens).to(model.compute_dtype), dense(tokens))
    assert model(tokens).dtype == torch.float32  # logits: the bf16 head's outputs, widened (Transformer.logits)
    twin = copy.deepcopy(model)
    assert twin.embed_tokens.head is twin.lm_head is not model.lm_head  # a copy shares the copied head
