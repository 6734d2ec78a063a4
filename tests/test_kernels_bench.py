"""evals.bench_quant: argument errors, and a full run on a tiny checkpoint (numbers are not asserted,
only their presence, ratios and the memory accounting)."""

from __future__ import annotations

import json

import pytest

from evals import bench_quant
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
    assert record["command"].startswith("python -m evals.bench_quant --model")
    assert record["git_sha"] and record["versions"]["torch"] and record["seed"] == 0
    mem = record["weight_bytes"]
    assert mem["int4"]["linears"] <= 0.3 * mem["bf16"]["linears"]
    assert mem["int8"]["linears"] <= 0.55 * mem["bf16"]["linears"]
    assert mem["fp32"]["total"] == 2 * mem["bf16"]["total"]
    decode = {(r["batch"], r["variant"]): r for r in record["decode"]}
    assert set(decode) == {(b, v) for b in (1, 3) for v in bench_quant.VARIANTS}
    assert decode[(1, "bf16")]["speedup_vs_bf16"] == 1.0 and decode[(3, "fp32")]["greedy_agreement_vs_fp32"] == 1.0
    paths = {(r["variant"], r["layer"]): r["path"] for r in record["layers"]}
    assert paths[("int4", "layers.0.mlp.down_proj")] == "cpu_int4"
    assert paths[("int8", "layers.0.mlp.down_proj")] == "cpu_int8"
    assert paths[("w8a8", "layers.0.mlp.down_proj")] == "cpu_w8a8"
    assert "| 1 | int4 |" in capsys.readouterr().out
