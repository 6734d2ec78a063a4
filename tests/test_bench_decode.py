"""evals.speed.bench_decode's arithmetic: TPOT from whole calls and the bytes-per-token roofline (weights and the KV
cache at the decode's mean context), against figures computed by hand."""

from __future__ import annotations

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
