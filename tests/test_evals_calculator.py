"""The calculator against the issue's seed figures, hand arithmetic, and parameter counts of real modules."""

from __future__ import annotations

import json

import pytest
import torch

from evals.calculator import CalculatorError, Shapes, calculate, count_params, main, parse_quantity
from runtime.config import ModelConfig
from runtime.model import Transformer

QWEN3_06B = {  # public values of Qwen/Qwen3-0.6B's config.json
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
MADE_UP_8B = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128000,
    "num_hidden_layers": 32,
    "tie_word_embeddings": False,
}


def test_qwen3_kv_bytes_per_token_and_params():
    r = calculate(QWEN3_06B, dtype="bf16")
    assert r.kv_bytes_per_token == 114_688
    assert 590e6 < r.params_total < 610e6  # "about 600M"
    assert r.params_total == 596_049_920  # hand count: 151936*1024 + 28*15,730,944 + 1024


def test_kv_bytes_32_layers_8k_tokens():
    hf = {**MADE_UP_8B, "head_dim": 128}
    r = calculate(hf, dtype="bf16", context=8192)
    assert r.kv_bytes_per_sequence == 32 * 8 * 128 * 8192 * 2 * 2 == 1_073_741_824
    assert r.kv_bytes_per_sequence == 2**30  # exactly 1 GiB, 1.07 GB


def test_made_up_8b_params_untied():
    r = calculate(MADE_UP_8B)
    assert r.params_total == 8_028_164_096
    tied = calculate({**MADE_UP_8B, "tie_word_embeddings": True})
    assert r.params_total - tied.params_total == 128000 * 4096  # the untied lm_head is the only difference


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_param_count_matches_the_runtime_module(name):
    from tests.conftest import TINY_CONFIGS

    cfg: ModelConfig = TINY_CONFIGS[name]
    model = Transformer(cfg)
    n_module = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert count_params(Shapes.from_hf(cfg.to_hf())).total == n_module


def test_default_model_params_match_module_on_meta_device():
    cfg = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    n_module = sum(p.numel() for p in model.parameters())
    r = calculate(cfg.to_hf(), dtype="fp32", bandwidth=31e9)
    assert r.params_total == n_module == 134_515_008
    assert r.weight_bytes_stored == 4 * n_module
    # DESIGN.md: fp32 decode roofline at 31 GB/s is about 58 tok/s (538 MB of weights)
    # (tied: the lm_head read is the embedding matrix, so a step reads exactly the stored bytes)
    assert r.decode_tokens_per_s_batch1_empty == pytest.approx(31e9 / (4 * n_module))
    assert 57 < r.decode_tokens_per_s_batch1_empty < 59


def test_decode_roofline_and_prefill_by_hand():
    r = calculate(QWEN3_06B, dtype="bf16", context=1000, concurrency=4, bandwidth=1e12, flops=1e15)
    p = r.params
    read = 2 * (p["attention"] + p["mlp"] + 151936 * 1024 + p["norms"])  # tied lm_head read once per step
    assert r.weight_bytes_read_per_step == read
    assert r.decode_tokens_per_s_batch1_empty == pytest.approx(1e12 / read)
    assert r.decode_tokens_per_s_concurrency == pytest.approx(4 * 1e12 / (read + 4 * 1000 * 114_688))
    matmul = p["attention"] + p["mlp"] + 151936 * 1024
    attn = 4 * 28 * 16 * 128 * 1000 * 1001 / 2
    assert r.prefill_flops == pytest.approx(2 * matmul * 1000 + attn)
    assert r.prefill_seconds == pytest.approx(r.prefill_flops / 1e15)


def test_compute_bound_at_large_batch():
    r = calculate(QWEN3_06B, context=16, concurrency=4096, bandwidth=1e13, flops=1e12)
    assert r.decode_bound_concurrency == "compute"


def test_max_batch_for_budget_and_worksheet():
    budget = 24 * 2**30
    r = calculate(QWEN3_06B, dtype="bf16", context=8192, memory_budget=budget, contexts=[8192], concurrencies=[26, 27])
    per_seq = 114_688 * 8192
    expected = int((budget - r.weight_bytes_stored) // per_seq)
    assert r.max_batch_for_budget == expected == 26
    fits = {row["concurrency"]: row["fits"] for row in r.worksheet}
    assert fits == {26: True, 27: False}


def test_quantized_config_bytes():
    hf = {**QWEN3_06B, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    r = calculate(hf, dtype="bf16")
    d, L = 1024, 28
    shapes = [(4096, d), (d, 2048), (6144, d), (d, 3072)]  # qkv, o, gate_up, down: (out, in)
    per_layer = sum(o * i // 2 + o * (i // 128) * (2 + 0.5) for o, i in shapes)
    embed = 2 * 151936 * 1024
    assert r.weight_bytes_stored == L * per_layer + embed + 2 * r.params["norms"]
    fp = calculate(QWEN3_06B, dtype="bf16")
    assert r.params_total == fp.params_total  # quantization changes bytes, not parameters
    assert r.weight_bytes_stored < 0.5 * fp.weight_bytes_stored
    # lm_head quantized too: on this tied model the quantized head is also the embedding, stored once
    qc = {**hf["quantization_config"], "lm_head": True}
    head = calculate({**hf, "quantization_config": qc}, dtype="bf16")
    table = 151936 * d // 2 + 151936 * (d // 128) * (2 + 0.5)
    assert head.weight_bytes_stored == L * per_layer + table + 2 * r.params["norms"]
    assert head.weight_bytes_read_per_step == head.weight_bytes_stored


def test_parse_quantity_units():
    assert parse_quantity("1000GB/s", "B/s") == 1e12
    assert parse_quantity("100TFLOPS", "FLOPS") == 1e14
    assert parse_quantity("24GiB", "B") == 24 * 2**30
    assert parse_quantity("80GB", "B") == 80e9
    with pytest.raises(CalculatorError, match="12XB"):
        parse_quantity("12XB", "B/s")


def test_bad_inputs_name_the_problem(tmp_path, capsys):
    with pytest.raises(CalculatorError, match="num_hidden_layers"):
        calculate({k: v for k, v in QWEN3_06B.items() if k != "num_hidden_layers"})
    with pytest.raises(CalculatorError, match="dtype 'fp7'"):
        calculate(QWEN3_06B, dtype="fp7")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for path, message in ((bad, "not valid JSON"), (tmp_path / "missing.json", "config not found")):
        with pytest.raises(SystemExit) as exit_:
            main(["--config", str(path)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "Traceback" not in err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(QWEN3_06B))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(good), "--bandwidth", "lots"])
    assert exit_.value.code == 2 and "'lots'" in capsys.readouterr().err


def test_cli_prints_gb_and_gib_apart(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MADE_UP_8B, "head_dim": 128}))
    main(["--config", str(path), "--context", "8192", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_per_sequence"] == 1_073_741_824
    main(["--config", str(path), "--context", "8192", "--memory", "80GB"])
    text = capsys.readouterr().out
    assert "1.07 GB (1.00 GiB)" in text and "80.00 GB (74.51 GiB)" in text
