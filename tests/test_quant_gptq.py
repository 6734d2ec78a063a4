"""GPTQ against an oracle written from the paper's pseudocode (Frantar et al. 2022, Algorithm 1), unoptimised:
float64, every column's error pushed to all later columns at once (no lazy blocks), its own grid code."""

from __future__ import annotations

import pytest
import torch

from quantize.config import QuantConfig
from quantize.gptq import GPTQConfig, GPTQError, accumulate_hessian, gptq_quantize, inverse_cholesky, layer_error
from quantize.rtn import quantize_weight


def oracle_grid(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max grid per row, spelled out: asym spans [min(w,0), max(w,0)], sym spans ±max|w|."""
    maxq = 2**bits - 1
    lo = torch.minimum(w.min(1).values, torch.zeros(w.shape[0], dtype=w.dtype))
    hi = torch.maximum(w.max(1).values, torch.zeros(w.shape[0], dtype=w.dtype))
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = (hi - lo) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-lo / scale)
    return scale, zero


def oracle_gptq(W, X, bits, sym, group_size, act_order=False, static_groups=False, damp=0.01):
    """Returns the dequantized Ŵ [out, in] (float64)."""
    W = W.double().clone()
    H = 2 * X.double().T @ X.double() / X.shape[0]
    n = W.shape[1]
    maxq = 2**bits - 1
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    static = None
    if static_groups:
        static = [oracle_grid(W[:, g : g + group_size], bits, sym) for g in range(0, n, group_size)]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + damp * torch.diag(H).mean() * torch.eye(n, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)  # "Cholesky(H^-1)^T"
    Q = torch.zeros_like(W)
    for j in range(n):
        if static is not None:
            scale, zero = static[int(perm[j]) // group_size]
        elif j % group_size == 0:
            scale, zero = oracle_grid(W[:, j : j + group_size], bits, sym)  # the updated weights
        q = torch.clamp(torch.round(W[:, j] / scale) + zero, 0, maxq)
        Q[:, j] = scale * (q - zero)
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]
    return Q[:, torch.argsort(perm)]


def sample_layer(seed: int, out_features: int = 40, in_features: int = 96, tokens: int = 600, dead: int = 2):
    """Weights plus correlated inputs with a few outlier channels and dead (always-zero) channels."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=g)
    mix = torch.randn(in_features, in_features, generator=g) / in_features**0.5 + torch.eye(in_features)
    X = torch.randn(tokens, in_features, generator=g) @ mix
    X[:, :4] *= 8  # outlier channels: where act-order matters
    X[:, -dead:] = 0
    return W, X


def recon_error(W, W_hat, X) -> float:
    return float(((X.double() @ (W.double() - W_hat.double()).T) ** 2).sum())


CASES = [
    # bits, sym, group_size, act_order, static_groups, block_size
    (4, False, 32, False, False, 128),
    (4, False, 24, False, False, 16),  # groups straddle lazy blocks
    (3, True, 96, False, False, 32),  # per-channel
    (4, False, 32, True, False, 128),  # act-order, groups in visiting order (g_idx)
    (4, False, 20, True, False, 16),  # act-order, shorter last group, straddling blocks
    (4, True, 32, True, True, 32),  # act-order with static groups
    (2, False, 48, False, False, 128),
]


@pytest.mark.parametrize("bits,sym,group_size,act_order,static_groups,block_size", CASES)
def test_gptq_matches_paper_oracle_within_one_percent(bits, sym, group_size, act_order, static_groups, block_size):
    W, X = sample_layer(seed=bits * 100 + group_size)
    H = accumulate_hessian([X[None]])
    cfg = GPTQConfig(act_order=act_order, static_groups=static_groups, block_size=block_size)
    res = gptq_quantize(W, H, bits, sym, group_size, cfg)
    ours = recon_error(W, res.qweight.dequantize(), X)
    oracle = recon_error(W, oracle_gptq(W, X, bits, sym, group_size, act_order, static_groups), X)
    assert abs(ours - oracle) <= 0.01 * oracle, (ours, oracle)
    # and GPTQ is far better than rounding each weight to nearest on the same grid shape
    rtn = quantize_weight(W, QuantConfig(bits=bits, group_size=group_size, sym=sym)).dequantize()
    assert ours < 0.8 * recon_error(W, rtn, X)
    # the Hessian-weighted error the CLI reports is the same quantity per token, times 2/N
    assert layer_error(W, res.qweight, H) == pytest.approx(ours * 2 / X.shape[0], rel=1e-3)


def test_act_order_group_index_and_static_groups():
    W, X = sample_layer(seed=3, in_features=80)
    H = accumulate_hessian([X[None]])
    res = gptq_quantize(W, H, 4, False, 32, GPTQConfig(act_order=True))
    g_idx = res.qweight.g_idx
    assert g_idx is not None and sorted(torch.bincount(g_idx.long()).tolist()) == [16, 32, 32]
    # columns visited first (largest H_ii) are in group 0
    assert int(g_idx[torch.argmax(torch.diag(H))]) == 0
    static = gptq_quantize(W, H, 4, False, 32, GPTQConfig(act_order=True, static_groups=True))
    assert static.qweight.g_idx is None  # natural-order groups: no g_idx needed
    assert static.qweight.scales.shape == (40, 3)


def test_dead_columns_are_zero_and_codes_in_range():
    W, X = sample_layer(seed=4, dead=3)
    res = gptq_quantize(W, accumulate_hessian([X[None]]), 3, False, 32, GPTQConfig())
    W_hat = res.qweight.dequantize()
    assert torch.all(W_hat[:, -3:] == 0)
    assert int(res.qweight.codes.max()) <= 7


def test_cholesky_failure_retries_with_more_damping():
    # An indefinite "Hessian": eigenvalue -0.01 against a mean diagonal of ~1.
    g = torch.Generator().manual_seed(0)
    Qm, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    eig = torch.linspace(1.0, 2.0, 16)
    eig[0] = -0.01
    H = Qm @ torch.diag(eig) @ Qm.T
    with pytest.raises(RuntimeError):
        torch.linalg.cholesky(H + 0.001 * H.diagonal().mean() * torch.eye(16))
    U, damp = inverse_cholesky(H, 0.001, 0.0025)
    assert damp * float(H.diagonal().mean()) > 0.01  # the negative eigenvalue was lifted
    Hd = H + damp * H.diagonal().mean() * torch.eye(16)
    # the damped H is ill-conditioned (smallest eigenvalue ~2e-3, inverse entries ~100): compare in relative terms
    # against an fp64 inverse, as fp32 round-off scales with the entries
    inv = torch.linalg.inv(Hd.double())
    assert float((U.T @ U).double().sub(inv).abs().max()) <= 1e-4 * float(inv.abs().max())
    with pytest.raises(GPTQError, match="not positive definite"):
        inverse_cholesky(-torch.eye(4) * 5 + torch.ones(4, 4), 0.01, 0.2)


def test_first_token_weight_in_the_hessian():
    torch.manual_seed(0)
    batches = [torch.randn(2, 7, 5), torch.randn(3, 7, 5)]
    first = torch.cat([b[:, 0] for b in batches])  # [5, 5]: each window's first token
    rest = torch.cat([b[:, 1:].reshape(-1, 5) for b in batches])  # [30, 5]
    for w in (0.0, 4.0):
        expected = 2.0 / (rest.shape[0] + w * first.shape[0]) * (rest.t() @ rest + w * first.t() @ first)
        torch.testing.assert_close(accumulate_hessian(batches, first_token_weight=w), expected)
    torch.testing.assert_close(accumulate_hessian(batches, 1.0), 2.0 / 35 * (rest.t() @ rest + first.t() @ first))
    with pytest.raises(GPTQError, match="first_token_weight"):
        accumulate_hessian([torch.randn(2, 1, 5)], first_token_weight=0.0)
    with pytest.raises(ValueError, match="first_token_weight"):
        GPTQConfig(first_token_weight=-1)
