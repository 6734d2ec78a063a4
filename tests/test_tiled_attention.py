"""NumPy FlashAttention and paged decode attention against naive softmax attention (fp64), the naive reference
against torch's SDPA, their memory, and the runtime's paged kernels against the NumPy paged version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.reference.tiled_attention import (
    DenseCase,
    check_random_shapes,
    check_runtime_paged_kernels,
    dense_inputs,
    flash_attention,
    memory_table,
    naive_attention,
    naive_score_bytes,
    paged_decode_attention,
)

ROOT = Path(__file__).resolve().parents[1]


def test_flash_and_paged_equal_naive_on_100_random_shapes():
    res = check_random_shapes(100, seed=0)
    assert res["flash_max_abs_err"] <= 1e-6
    assert res["paged_max_abs_err"] <= 1e-6


@pytest.mark.parametrize(
    "B,H,Hkv,Tq,Tk,causal",
    [(2, 4, 2, 5, 9, False), (1, 6, 3, 7, 7, True), (2, 2, 1, 3, 11, True), (1, 1, 1, 1, 4, False)],
)
def test_naive_reference_equals_torch_sdpa(B, H, Hkv, Tq, Tk, causal):
    rng = np.random.default_rng(1)
    q, k, v = dense_inputs(DenseCase(B, H, Hkv, Tq, Tk, 16, causal, 4, 4), rng)
    # queries are the last Tq positions: an explicit bottom-right mask (SDPA's is_causal is top-left)
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq) if causal else None
    ref = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), attn_mask=mask, enable_gqa=True)
    np.testing.assert_allclose(naive_attention(q, k, v, causal=causal), ref.numpy(), rtol=0, atol=1e-12)


def test_rescaling_is_exercised_and_survives_huge_scores():
    """Scores of ~1e3 overflow exp() unless each tile is shifted by the running max; a rising max across tiles
    (keys sorted by score) makes every new tile rescale the old sum."""
    rng = np.random.default_rng(2)
    q, k, v = dense_inputs(DenseCase(1, 2, 1, 8, 64, 32, False, 4, 8), rng, spread=60.0)
    k = k[:, :, np.argsort(np.einsum("d,sd->s", q[0, 0, 0], k[0, 0]))]  # increasing scores for query 0
    out = flash_attention(q, k, v, block_q=4, block_k=8)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(q, k, v), rtol=0, atol=1e-9)
    # tile size 1 is the fully online (one key at a time) softmax
    np.testing.assert_allclose(flash_attention(q, k, v, block_q=1, block_k=1), out, rtol=0, atol=1e-9)


def test_extra_memory_flash_constant_naive_quadratic():
    small, large = memory_table([128, 512], B=1, H=4, Hkv=2, D=32, block=32, block_size=16)
    # naive materialises the score matrix (at least its computed size); 4x the length -> ~16x the bytes
    for r in (small, large):
        assert r["naive_measured"] >= r["naive_computed"] == naive_score_bytes(1, 4, r["length"], r["length"])
    assert large["naive_measured"] > 12 * small["naive_measured"]
    # flash tiles do not grow with the length and stay within a small factor of the computed tile state
    assert large["flash_measured"] <= 1.1 * small["flash_measured"]
    assert large["flash_measured"] <= 3 * large["flash_computed"]
    assert large["flash_measured"] < large["naive_measured"] / 8
    # paged decode keeps one block of state; gathering copies the whole K/V
    assert large["paged_decode_measured"] <= 1.1 * small["paged_decode_measured"]
    assert large["gathered_decode_measured"] >= large["gathered_decode_computed"] * 0.9
    assert large["gathered_decode_measured"] > 3 * small["gathered_decode_measured"]


def test_bad_inputs_are_named():
    q = np.zeros((1, 3, 4, 8))
    kv = np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, kv, kv)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        flash_attention(np.zeros((1, 2, 5, 8)), kv, kv, causal=True)
    pool = np.zeros((4, 2, 1, 8))
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(np.zeros((1, 1, 8)), pool, pool, np.array([[1, 2]]), np.array([5]))


def test_torch_paged_reference_agrees_with_numpy():
    rows = check_runtime_paged_kernels(n=6, seed=3)
    assert {r["dtype"] for r in rows} == {"float32", "float16"}
    for r in rows:
        assert r["max_abs_err"] <= (1e-5 if r["dtype"] == "float32" else 2e-3), r


def test_triton_paged_kernel_agrees_with_numpy_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = ["--shapes", "2", "--lengths", "32", "--kernels", "--triton"]
    cmd = [sys.executable, "-m", "runtime.reference.tiled_attention", *args]
    proc = subprocess.run(cmd + ["--kernel-cases", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "triton float32" in proc.stdout and "triton float16" in proc.stdout, proc.stdout
