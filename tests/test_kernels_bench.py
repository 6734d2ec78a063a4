"""evals.speed.bench_quant: argument errors, and a full run on a tiny checkpoint (numbers are not asserted,
only their presence, ratios and the memory accounting)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from evals.speed import bench_quant
from quantize.qembedding import QuantEmbedding
from runtime.config import ModelConfig
from runtime.loader import save_checkpoint
from runtime.model import random_model

TINY = ModelConfig(
    architecture="llama",
    vocab_size=96,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    eos_token_ids=[1],
)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--variants", "fp32,int3"], "unknown variant(s) ['int3']"),
        (["--group-size", "48"], "--group-size must be a positive multiple of 32 or -1, got 48"),
        (["--batch-sizes", "1,0"], "--batch-sizes must be >= 1"),
        (["--batch-sizes", "one"], "--batch-sizes: cannot parse 'one'"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_bad_arguments_give_one_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as err:
        bench_quant.main(args)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_tiny_run_reports_every_variant_with_ratios(tmp_path, capsys):
    ckpt = save_checkpoint(random_model(TINY, seed=0), tmp_path / "tiny")
    out = tmp_path / "bench.json"
    bench_quant.main(
        ["--model", str(ckpt), "--batch-sizes", "1,3", "--repeats", "1", "--new-tokens", "3", "--prompt-len", "4"]
        + ["--layer-iters", "1", "--group-size", "128", "--random-prompts", "--out", str(out)]
    )
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m evals.speed.bench_quant --model")
    assert record["git_sha"] and record["versions"]["torch"] and record["seed"] == 0
    mem = record["weight_bytes"]
    # int4 g128 on the "cpu" path: 0.5 byte codes + fp32 kernel scale and zero tables (tiles of 16 rows, K padded to
    # 32) beside the checkpoint's fp16 scales and uint8 zeros
    assert mem["int4"]["linears"] <= 0.33 * mem["bf16"]["linears"]
    assert mem["int8"]["linears"] <= 0.55 * mem["bf16"]["linears"]
    assert mem["fp32"]["linears"] == 2 * mem["bf16"]["linears"]
    assert mem["bf16"]["total"] <= 0.501 * mem["fp32"]["total"]  # mixed bf16: the norms stay fp32
    decode = {(r["batch"], r["variant"]): r for r in record["decode"]}
    assert set(decode) == {(b, v) for b in (1, 3) for v in bench_quant.VARIANTS}
    assert decode[(1, "bf16")]["speedup_vs_bf16"] == 1.0 and decode[(3, "fp32")]["greedy_agreement_vs_fp32"] == 1.0
    paths = {(r["variant"], r["layer"]): r["path"] for r in record["layers"]}
    assert paths[("int4", "layers.0.mlp.down_proj")] == "cpu"
    assert paths[("int8", "layers.0.mlp.down_proj")] == "cpu"
    assert paths[("w8a8", "layers.0.mlp.down_proj")] == "cpu"  # the step's integer kernels (issue 39)
    memory = {(r["variant"], r["quantized"]): r for r in record["weight_memory"]}
    assert set(memory) == {("fp32", "none (dense)"), ("bf16", "none (dense)")} | {
        (v, scope) for v in ("int8", "w8a8", "int4") for scope in ("decoder linears", "+ lm_head")
    }
    assert memory[("int4", "decoder linears")]["total_bytes"] == mem["int4"]["total"]  # the timed models
    printed = capsys.readouterr().out
    assert "| 1 | int4 |" in printed and "| int4 | + lm_head |" in printed


def test_weight_memory_of_a_tied_head_shared_with_the_embedding():
    """Both scopes for each quantized variant; with the head, the bf16 table is gone and only the packed head
    (which the embedding reads) comes in."""
    tied = replace(TINY, tie_word_embeddings=True)
    base = random_model(tied, seed=0)
    models = {v: bench_quant.build_variant(base, v, 128, lm_head=False) for v in ("bf16", "int8", "int4")}
    rows = {(r["variant"], r["quantized"]): r for r in bench_quant.weight_memory(base, models, 128, lm_head=False)}
    table = tied.vocab_size * tied.hidden_size * 2  # the bf16 embedding/head table
    for variant in ("int8", "int4"):
        shared = bench_quant.build_variant(base, variant, 128, lm_head=True)
        assert isinstance(shared.embed_tokens, QuantEmbedding) and shared.embed_tokens.head is shared.lm_head
        decoder_only, with_head = rows[(variant, "decoder linears")], rows[(variant, "+ tied head/embedding")]
        assert with_head["total_bytes"] == decoder_only["total_bytes"] - table + shared.lm_head.weight_bytes()
        assert with_head["total_x_bf16"] < decoder_only["total_x_bf16"] < 1
        assert rows[("bf16", "none (dense)")]["total_x_bf16"] == 1.0
