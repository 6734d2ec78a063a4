"""The calculator against the issue's seed figures, hand arithmetic, and parameter counts of real modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evals.speed.calculator import (
    CalculatorError,
    Hardware,
    Shapes,
    calculate,
    count_params,
    disaggregation,
    main,
    parse_quantity,
    prefill_flops,
    tp_comm_bytes_per_token,
    tp_kv_bytes_per_token_per_gpu,
    tp_layouts,
    tp_shard,
    tp_weight_bytes_per_gpu,
    winning_ranges,
)
from runtime.config import ModelConfig
from runtime.model import Transformer, random_model
from runtime.paged_cache import PagedKVCache

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


def test_quantized_kv_counts_codes_and_scales_as_the_engine_does():
    """int8 / fp8: one fp16 scale per token and KV head; int4: nibbles, a value scale + min per token, a key scale + min
    per channel per 64 tokens. The engine's block budget (PagedKVCache.bytes_per_block) counts the same bytes."""
    per_head = {"int8": 2 * (128 + 2), "fp8": 2 * (128 + 2), "fp8_e4m3": 2 * (128 + 2), "int4": 128 + 4 + 4 * 128 / 64}
    cfg = ModelConfig.from_hf({**QWEN3_06B, "max_position_embeddings": 4096})
    for kv, head_bytes in per_head.items():
        r = calculate(QWEN3_06B, dtype="bf16", kv_dtype=kv)
        assert r.kv_bytes_per_token == 28 * 8 * head_bytes
        fmt = "fp8_e4m3" if kv == "fp8" else kv
        assert r.kv_bytes_per_token * 64 == PagedKVCache.bytes_per_block(cfg, 64, torch.bfloat16, fmt)
    bf16 = calculate(QWEN3_06B, dtype="bf16").kv_bytes_per_token
    assert bf16 / calculate(QWEN3_06B, kv_dtype="int8").kv_bytes_per_token > 1.9
    with pytest.raises(CalculatorError, match="unknown kv dtype 'int3'"):
        calculate(QWEN3_06B, kv_dtype="int3")


def test_made_up_8b_params_untied():
    r = calculate(MADE_UP_8B)
    assert r.params_total == 8_028_164_096
    tied = calculate({**MADE_UP_8B, "tie_word_embeddings": True})
    assert r.params_total - tied.params_total == 128000 * 4096  # the untied lm_head is the only difference


@pytest.mark.parametrize("name", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_param_count_matches_the_runtime_module(name):
    from tests.tiny_models import TINY_CONFIGS

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
    # docs/methodology.md (machine numbers): fp32 decode roofline at 31 GB/s is about 58 tok/s (538 MB of weights)
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


# ---- tensor parallelism and disaggregation ----------------------------------------------------------

LLAMA31_8B = json.loads((Path(__file__).resolve().parents[1] / "configs/models/llama-3.1-8b.json").read_text())


def test_tp_per_gpu_weight_kv_and_comm_bytes_by_hand():
    s = Shapes.from_hf(LLAMA31_8B)
    assert tp_weight_bytes_per_gpu(s, 2, 1) == calculate(LLAMA31_8B, dtype="bf16").weight_bytes_stored
    # TP=2: q/k/v/o and the MLP halve (per layer 4096*6144 + 4096*4096 + 3*4096*14336 = 218,103,808 weights),
    # norms are replicated, embedding and lm_head are split by vocabulary rows (128256 / 2)
    per_layer = (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) // 2
    params = 32 * per_layer + (32 * 2 * 4096 + 4096) + 2 * 64128 * 4096
    assert tp_weight_bytes_per_gpu(s, 2, 2) == 2 * params == 8_030_527_488
    replicated_head = 32 * per_layer + (32 * 2 * 4096 + 4096) + 2 * 128256 * 4096
    assert tp_weight_bytes_per_gpu(s, 2, 2, vocab_parallel=False) == 2 * replicated_head
    # KV: 8 heads split 4 + 4; at TP=16 each KV head is replicated on 2 ranks (1 head per GPU)
    assert tp_kv_bytes_per_token_per_gpu(s, 2, 2) == 2 * 32 * 4 * 128 * 2 == 65_536
    assert tp_kv_bytes_per_token_per_gpu(s, 2, 16) == 2 * 32 * 1 * 128 * 2
    # comm per token per GPU: 2 all-reduces per layer + the embedding's, ring sends 2 (t-1)/t of 4096 bf16
    # values each; the vocab-parallel logits are all-gathered in fp32
    assert tp_comm_bytes_per_token(s, 1) == 0
    assert tp_comm_bytes_per_token(s, 2) == 65 * 2 * (1 / 2) * 4096 * 2 + (1 / 2) * 128256 * 4 == 788_992
    assert tp_comm_bytes_per_token(s, 8) == 65 * 2 * (7 / 8) * 8192 + (7 / 8) * 128256 * 4 == 1_380_736
    with pytest.raises(CalculatorError, match="cannot split 32 query / 8 KV heads over 12 ranks"):
        tp_shard(s, 12)


@pytest.mark.parametrize("name,world", [("llama", 2), ("llama-tied-mha", 2), ("qwen2", 2), ("llama", 4)])
def test_tp_weight_bytes_equal_runtime_shards(name, world):
    """The calculator's per-GPU bytes (replicated head, as runtime.tp does it) are the largest rank's real
    parameter bytes in runtime.tp's shard modules."""
    from runtime.tp import build_shard
    from tests.tiny_models import TINY_CONFIGS

    cfg = TINY_CONFIGS[name]
    state = random_model(cfg).hf_state_dict()
    real = max(
        sum(p.numel() * p.element_size() for p in build_shard(cfg, state, r, world).parameters()) for r in range(world)
    )
    s = Shapes.from_hf(cfg.to_hf())
    assert tp_weight_bytes_per_gpu(s, 4, world, vocab_parallel=False) == real
    kv = max(2 * cfg.num_layers * build_shard(cfg, state, r, world).config.kv_size * 4 for r in range(world))
    assert tp_kv_bytes_per_token_per_gpu(s, 4, world) == kv


def test_tp_layouts_step_time_and_winners():
    s = Shapes.from_hf(LLAMA31_8B)
    hw = Hardware(bandwidth=4e12, flops=1e15, link_bandwidth=4e11, link_latency=1e-5)
    rows = tp_layouts(s, "bf16", "bf16", 8, [1, 2, 8], [1, 8192], 128, hw)
    by = {(r["batch"], r["tp"]): r for r in rows}
    r = by[(1, 2)]  # one sequence on one of 4 TP=2 replicas, by hand
    mem = (8_030_527_488 + 128 * 65_536) / 4e12
    comm = 788_992 / 4e11 + 66 * 1e-5
    assert r["memory_s"] == pytest.approx(mem, rel=1e-12) and r["comm_s"] == pytest.approx(comm, rel=1e-12)
    assert r["compute_s"] < mem and r["tpot_s"] == pytest.approx(mem + comm, rel=1e-12)
    assert r["tokens_per_s"] == pytest.approx(1 / (mem + comm), rel=1e-12)
    # batch 1 is memory-bound: splitting the weights over 8 GPUs wins; at 8192 short sequences compute dominates
    # and the layouts do the same FLOPs per GPU, so TP=1 (no communication) wins
    assert [t for t in (1, 2, 8) if by[(1, t)]["wins"]] == [8]
    assert [t for t in (1, 2, 8) if by[(8192, t)]["wins"]] == [1]
    assert by[(8192, 1)]["compute_s"] > by[(8192, 1)]["memory_s"]
    # a memory budget rules out layouts whose shard does not fit
    tight = tp_layouts(s, "bf16", "bf16", 8, [1, 8], [1], 1024, hw, memory_per_gpu=10e9)
    assert [(r["tp"], r["fits"], r["wins"]) for r in tight] == [(1, False, False), (8, True, True)]


def test_disaggregation_buys_tpot_not_throughput():
    s = Shapes.from_hf(LLAMA31_8B)
    hw = Hardware(bandwidth=4e12, flops=1e15, link_bandwidth=4e11, link_latency=0.0)
    rows = disaggregation(s, "bf16", "bf16", 1, [1, 32, 256], 1024, 128, hw, slo_tpot=0.02)
    t_prefill = prefill_flops(s, 1024) / 1e15
    for r in rows:
        b = r["batch"]
        assert r["prefill_s"] == t_prefill
        assert r["colocated_tpot_s"] == pytest.approx(r["decode_step_s"] + b / 128 * t_prefill, rel=1e-12)
        assert r["disaggregated_tpot_s"] == r["decode_step_s"] < r["colocated_tpot_s"]
        # per GPU: decode group b / T_d tokens/s over 1 + (prefill GPUs) = b / (T_d + b T_p / output)
        gpus = 1 + r["prefill_gpus_per_decode_gpu"]
        assert r["tokens_per_s_per_gpu"] == pytest.approx(b / r["decode_step_s"] / gpus, rel=1e-12)
        assert r["kv_transfer_s"] == 1024 * 131_072 / 4e11
    for mode in ("colocated", "disaggregated"):  # the largest batch within the SLO, checked at b and b + 1
        best = rows[0][f"{mode}_max_batch"]
        at = {r["batch"]: r for r in disaggregation(s, "bf16", "bf16", 1, [best, best + 1], 1024, 128, hw, 0.02)}
        assert at[best][f"{mode}_tpot_s"] <= 0.02 < at[best + 1][f"{mode}_tpot_s"]
    assert rows[0]["disaggregated_max_batch"] > rows[0]["colocated_max_batch"] > 0


def test_cli_parallel_section(capsys):
    path = Path(__file__).resolve().parents[1] / "configs/models/llama-3.1-8b.json"
    main(["--config", str(path), "--bandwidth", "4.8TB/s", "--flops", "990TFLOPS", "--memory", "141GB",
          "--tp", "1,2,4,8", "--batches", "1,64,4096", "--slo-tpot-ms", "20"])  # fmt: skip
    out = capsys.readouterr().out
    assert "TP=8 wins at total batch 1" in out
    assert "| 1 | 2 x 4 | 8.03 GB" in out and "788,992 B" in out
    assert "disaggregated: largest decode batch within TPOT 20 ms" in out
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--tp", "1,3", "--gpus", "8"])
    assert "TP=3 does not divide 8 GPUs" in capsys.readouterr().err


def test_winning_ranges_partition_the_batches_and_follow_communication_cost():
    s = Shapes.from_hf(LLAMA31_8B)
    fast = Hardware(bandwidth=4.8e12, flops=9.9e14, link_bandwidth=4.5e11, link_latency=5e-6)
    runs = winning_ranges(s, "bf16", "bf16", 8, [1, 2, 4, 8], 1024, 4096, fast, memory_per_gpu=141e9)
    scanned = [1, *range(8, 1025, 8)]
    assert runs[0]["from"] == 1 and runs[-1]["to"] == 1024
    assert all(scanned.index(b["from"]) == scanned.index(a["to"]) + 1 for a, b in zip(runs, runs[1:]))
    for run in runs:  # each run's layout is the winner tp_layouts names at both ends
        for b in (run["from"], run["to"]):
            rows = tp_layouts(s, "bf16", "bf16", 8, [1, 2, 4, 8], [b], 4096, fast, 141e9)
            assert next(r["tp"] for r in rows if r["wins"]) == run["tp"]
    assert runs[0]["tp"] == 8  # one sequence: splitting the weight reads wins
    # a slow link (1 GB/s): communication dominates as soon as a few sequences share each all-reduce
    slow = Hardware(bandwidth=4.8e12, flops=9.9e14, link_bandwidth=1e9, link_latency=5e-6)
    runs = winning_ranges(s, "bf16", "bf16", 8, [1, 2, 4, 8], 256, 4096, slow)
    assert runs[0]["tp"] != 1 and runs[-1]["tp"] == 1 and runs[-1]["from"] <= 16
