"""evals.speed.bench_decode's arithmetic: TPOT from whole calls and the bytes-per-token roofline (weights and the KV
cache at the decode's mean context), against figures computed by hand."""

from __future__ import annotations

import math

import pytest

from evals.speed.bench_decode import Runner, kv_position_bytes, summarize
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]  # 2 layers, 2 KV heads, head_dim 16


@pytest.mark.parametrize(
    "kv_dtype, per_head",
    [("auto", 2 * 16 * 2), ("int8", 2 * (16 + 2)), ("fp8_e4m3", 2 * (16 + 2)), ("int4", 16 + 4 + 4 * 16 / 64)],
)
def test_kv_position_bytes_count_codes_and_scales(kv_dtype, per_head):
    # k and v for every layer and KV head: codes (1 byte int8 / fp8, half a byte int4) + fp16 scales (int4: value
    # scale and min per token, key scale and min per channel shared by a 64-token group)
    expected = CFG.num_layers * CFG.num_kv_heads * per_head
    assert kv_position_bytes(CFG, kv_dtype, dtype_bytes=2) == pytest.approx(expected)


def test_summary_roofline_reads_weights_and_the_kv_cache_at_the_mean_context():
    r = Runner("row", call=None, weight_bytes=1000, kv_bytes_per_position=10.0)
    r.walls = {1: [0.10, 0.12, 0.11], 5: [0.50, 0.52, 0.51]}  # medians 0.11 and 0.51
    out = summarize(r, new_tokens=5, bandwidth=1e4, prompt_tokens=100)
    assert out["tpot_ms"] == pytest.approx(100.0)  # (0.51 - 0.11) / 4
    assert out["kv_bytes_per_token"] == pytest.approx(10 * (100 + 2.5))
    assert out["roofline_share"] == pytest.approx((1000 + 1025) / 1e4 / 0.1)


def test_tpot_is_read_per_round_and_refused_where_ttft_noise_exceeds_the_decode():
    r = Runner("row", call=None, weight_bytes=1000, kv_bytes_per_position=10.0)
    # rounds decode 0.4, 0.4 and (a slow patch in the third whole call) 4.0 s: the difference of the medians would
    # say 3.4 s, the median round 0.4 s
    r.walls = {1: [40.0, 44.0, 41.0], 5: [40.4, 44.4, 45.0]}
    assert summarize(r, new_tokens=5, bandwidth=1e4, prompt_tokens=8000)["tpot_ms"] == pytest.approx(100.0)
    r.walls = {1: [40.0, 44.0, 41.0], 5: [39.0, 42.0, 40.8]}  # a slower first call than the whole one
    assert math.isnan(summarize(r, new_tokens=5, bandwidth=1e4, prompt_tokens=8000)["tpot_ms"])


def test_rows_name_their_kv_format_and_amx_policy():
    from evals.speed.bench_decode import parse_rows, row_parts
    from runtime.cliutil import UsageError
    from runtime.kernels.cpu_step import isa_supported

    assert row_parts("qspec:bf16:kv=int8:amx=off") == ("qspec", "bf16", {"kv": "int8", "amx": "off"})
    assert row_parts("qspec:int4") == ("qspec", "int4", {})
    assert parse_rows("qspec:bf16:kv=int8, hf:bf16") == ["qspec:bf16:kv=int8", "hf:bf16"]
    for bad, why in [
        ("qspec:bf16:kv=int3", "kv= takes one of"),
        ("qspec:bf16:speed=fast", "options are kv=FORMAT and amx=POLICY"),
        ("qspec:bf16:kv=int8:kv=int4", "each at most once"),
        ("hf:bf16:kv=int8", "unknown row"),
    ]:
        with pytest.raises(UsageError, match=why):
            parse_rows(bad)
    if isa_supported("amx"):
        assert parse_rows("qspec:bf16:amx=off") == ["qspec:bf16:amx=off"]
        with pytest.raises(UsageError, match="amx= takes one of"):
            parse_rows("qspec:bf16:amx=fast")
    else:
        with pytest.raises(UsageError, match="this CPU has no AMX"):
            parse_rows("qspec:bf16:amx=off")
