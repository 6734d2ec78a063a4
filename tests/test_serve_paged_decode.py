"""The Triton paged-decode kernel wired into the model's attention (PagedKVCache.attend).

In-process tests check the path selection without running Triton (the kernel entry is replaced by one that
raises, so a silent fallback to gather + SDPA fails the test). The kernel itself runs under
TRITON_INTERPRET=1 in a subprocess (the flag must be set before triton is imported): engine greedy tokens
vs the contiguous-cache generate(), decode logits vs the gather + SDPA path, and attend in fp32/fp16/bf16
vs an fp32 attention computed row by row here.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.model import random_model
from runtime.paged_cache import PagedAttentionMetadata, PagedKVCache, resolve_decode_kernel
from runtime.sampling import SamplingParams
from tests.tiny_models import TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
CFG = TINY_CONFIGS["llama"]  # 4 query heads over 2 kv heads (GQA), head_dim 16, 2 layers
BS = 4  # block size: the rows below span 1 to 8 blocks
FP32_LOGIT_TOL = 1e-4  # max |logit difference| kernel vs gather + SDPA, fp32 (observed ~1e-6)
ATTEND_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # vs the fp32 oracle


class KernelCalled(Exception):
    pass


def paged_meta(positions: torch.Tensor, tables: torch.Tensor, prefix_mask: bool = True) -> PagedAttentionMetadata:
    """Metadata as the engine builds it: positions [B, T] through block tables [B, nb]."""
    kv_len = int(positions.max()) + 1
    slots = tables.gather(1, positions // BS) * BS + positions % BS
    mask = torch.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
    return PagedAttentionMetadata(
        positions, slots, mask, kv_len, block_tables=tables, context_lens=positions[:, -1] + 1, prefix_mask=prefix_mask
    )


def scattered_tables(B: int, nb: int, seed: int) -> torch.Tensor:
    """Disjoint, shuffled block ids (never the scratch block 0)."""
    ids = torch.randperm(B * nb, generator=torch.Generator().manual_seed(seed)) + 1
    return ids.view(B, nb)


def prefill(model, cache, prompts: list[list[int]], tables: torch.Tensor) -> list[torch.Tensor]:
    """Each prompt alone (B=1, T=len) into its rows' blocks; returns each row's last logits."""
    out = []
    for b, p in enumerate(prompts):
        pos = torch.arange(len(p))[None]
        out.append(model(torch.tensor([p]), paged_meta(pos, tables[b : b + 1]), cache)[0, -1])
    return out


# ---- in-process: path selection, no Triton launch ----------------------------------------------------


def test_decode_kernel_resolution():
    pytest.importorskip("triton")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_kernel("auto", cpu, 16) == "torch"
    assert resolve_decode_kernel("torch", cuda, 16) == "torch"
    assert resolve_decode_kernel("auto", cuda, 16) == "triton"
    assert resolve_decode_kernel("auto", cuda, 12) == "torch"  # the kernel needs a power-of-two block
    assert resolve_decode_kernel("triton", cpu, 4) == "triton"
    with pytest.raises(ValueError, match="power-of-two block size, got 12"):
        PagedKVCache(CFG, 8, 12, decode_kernel="triton")
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        PagedKVCache(CFG, 8, 4, decode_kernel="cuda")


def test_cpu_engine_defaults_to_gather_sdpa():
    model = random_model(CFG, seed=0)
    engine = LLMEngine(model, config=EngineConfig(block_size=BS, kv_cache_bytes=1 << 20))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.cache.decode_kernel == "torch"
    assert out[0].output_ids == generate(model, [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True)).tokens[0]
    assert engine.metrics()["paged_decode_kernel_launches_total"] == 0


def test_requested_kernel_is_used_for_decode_only(monkeypatch):
    """decode_kernel="triton": a decode step must enter the kernel (here replaced by one that raises, so a
    silent fallback would pass through); prefill and custom-mask steps must not, and equal the torch path."""
    pytest.importorskip("triton")
    from runtime.kernels import paged_attention

    def boom(*args, **kwargs):
        raise KernelCalled

    monkeypatch.setattr(paged_attention, "paged_decode_attention", boom)
    model = random_model(CFG, seed=0)
    kernel, torch_path = (PagedKVCache(CFG, 16, BS, decode_kernel=k) for k in ("triton", "torch"))
    tables = scattered_tables(1, 4, seed=0)
    with torch.inference_mode():
        a = prefill(model, kernel, [list(range(2, 11))], tables)[0]
        b = prefill(model, torch_path, [list(range(2, 11))], tables)[0]
        assert torch.equal(a, b)
        assert kernel.kernel_launches == 0
        step = paged_meta(torch.tensor([[9]]), tables, prefix_mask=False)  # e.g. a one-node tree mask
        assert torch.equal(model(torch.tensor([[3]]), step, kernel), model(torch.tensor([[3]]), step, torch_path))
        with pytest.raises(KernelCalled):
            model(torch.tensor([[3]]), paged_meta(torch.tensor([[9]]), tables), kernel)


# ---- the kernel under the Triton interpreter (subprocess) --------------------------------------------


def check_engine_greedy_equals_contiguous() -> None:
    """Mixed prompt lengths over several blocks, GQA, fp32: greedy tokens == generate() with KVCache, and
    every decode step of every layer went through the kernel."""
    model = random_model(CFG, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist() for n in (1, 6, 13, 27)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (7, 3, 6, 5)]
    engine = LLMEngine(model, config=EngineConfig(block_size=BS, kv_cache_bytes=1 << 21, decode_kernel="triton"))
    outs = [o.output_ids for o in engine.generate(prompts, params)]
    ref = [generate(model, [p], sp).tokens[0] for p, sp in zip(prompts, params)]
    assert outs == ref, (outs, ref)
    # every step has one [B, 1] forward: the 1-token prompt is a decode row in step 1, later steps decode only
    assert engine.num_steps == max(sp.max_tokens for sp in params)
    assert engine.cache.kernel_launches == CFG.num_layers * engine.num_steps, engine.cache.kernel_launches
    print(f"engine: {sum(map(len, outs))} tokens == contiguous oracle, {engine.cache.kernel_launches} launches")


def check_decode_logits_close() -> None:
    """Batched decode steps at 4 different lengths: logits within FP32_LOGIT_TOL of gather + SDPA."""
    model = random_model(CFG, seed=1)
    lens, steps = [3, 9, 17, 26], 5
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist() for n in lens]
    tables = scattered_tables(len(lens), math.ceil((max(lens) + steps) / BS), seed=1)
    caches = {k: PagedKVCache(CFG, tables.numel() + 1, BS, decode_kernel=k) for k in ("triton", "torch")}
    with torch.inference_mode():
        last = {k: prefill(model, c, prompts, tables) for k, c in caches.items()}
        tokens = torch.stack(last["torch"]).argmax(-1)[:, None]  # [B, 1]
        worst = 0.0
        for t in range(steps):
            meta = paged_meta(torch.tensor(lens)[:, None] + t, tables)
            logits = {k: model(tokens, meta, c)[:, 0] for k, c in caches.items()}
            worst = max(worst, (logits["triton"] - logits["torch"]).abs().max().item())
            assert torch.equal(logits["triton"].argmax(-1), logits["torch"].argmax(-1))
            tokens = logits["torch"].argmax(-1)[:, None]  # both paths see the same inputs
    assert caches["triton"].kernel_launches == CFG.num_layers * steps
    assert worst <= FP32_LOGIT_TOL, worst
    print(f"decode logits: max |diff| {worst:.2e} <= {FP32_LOGIT_TOL}")


def oracle_attention(q, k_pool, v_pool, tables, lens) -> torch.Tensor:
    """fp32 attention one row at a time over the row's first lens[b] slots: q [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    Hkv = k_pool.shape[2]
    out = torch.empty(B, H, D)
    for b in range(B):
        n = int(lens[b])
        k = k_pool[tables[b]].reshape(-1, Hkv, D)[:n].float()  # [n, Hkv, D]
        v = v_pool[tables[b]].reshape(-1, Hkv, D)[:n].float()
        for h in range(H):
            kv_h = h // (H // Hkv)
            w = torch.softmax(k[:, kv_h] @ q[b, h].float() / math.sqrt(D), dim=0)
            out[b, h] = w @ v[:, kv_h]
    return out


def check_attend_dtypes() -> None:
    """attend on one decode step in fp32/fp16/bf16: the kernel (fp32 accumulation) within ATTEND_TOL of
    the fp32 oracle, and no worse than gather + SDPA in that dtype (plus one rounding step)."""
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 4, 11, 30])  # a single key, a full block, ragged, 8 blocks
    tables = scattered_tables(4, 8, seed=2)
    H, Hkv, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    for dtype, tol in ATTEND_TOL.items():
        caches = {k: PagedKVCache(CFG, tables.numel() + 1, BS, dtype, decode_kernel=k) for k in ("triton", "torch")}
        k_hist, v_hist = (torch.randn(caches["torch"].k[0].shape, generator=gen) for _ in range(2))
        for c in caches.values():  # the same history in both pools
            c.k[0].copy_(k_hist)
            c.v[0].copy_(v_hist)
        q = torch.randn(4, H, 1, D, generator=gen).to(dtype)
        k_new, v_new = (torch.randn(4, Hkv, 1, D, generator=gen).to(dtype) for _ in range(2))
        meta = paged_meta(lens[:, None] - 1, tables)
        out = {name: c.attend(0, q, k_new, v_new, meta)[:, :, 0] for name, c in caches.items()}
        assert caches["triton"].kernel_launches == 1 and out["triton"].dtype == dtype
        assert torch.equal(caches["triton"].k[0], caches["torch"].k[0])  # both wrote the new k/v
        ref = oracle_attention(q[:, :, 0], caches["torch"].k[0], caches["torch"].v[0], tables, lens)
        err = (out["triton"].float() - ref).abs().max().item()
        err_sdpa = (out["torch"].float() - ref).abs().max().item()
        eps = torch.finfo(dtype).eps
        assert err <= tol and err <= err_sdpa + 2 * eps, (dtype, err, err_sdpa)
        print(f"attend {dtype}: kernel err {err:.2e}, gather+SDPA err {err_sdpa:.2e} (tol {tol})")


def check_quantized_engine_triton_equals_torch() -> None:
    """int8 / fp8 pools: decode steps through the Triton kernel (codes and scales read in place, dequantized in
    registers) give the tokens of the chunked torch path over the same pool."""
    model = random_model(CFG, seed=0)
    prompts = [[5, 9, 13, 2, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for fmt in ("int8", "fp8_e4m3"):
        outs = {}
        for kernel in ("triton", "torch"):
            config = EngineConfig(block_size=BS, num_blocks=32, decode_kernel=kernel, kv_cache_dtype=fmt)
            engine = LLMEngine(model, config=config)
            outs[kernel] = [o.output_ids for o in engine.generate(prompts, params)]
            assert (engine.cache.kernel_launches > 0) == (kernel == "triton")
        assert outs["triton"] == outs["torch"], fmt
        print(f"quantized {fmt}: Triton decode tokens equal the chunked torch path's")


def check_gpu_script_smoke() -> None:
    from evals.speed.bench_paged_decode import main

    main(["--smoke", "--device", "cpu"])


INTERPRETER_CHECKS = [
    "check_engine_greedy_equals_contiguous",
    "check_decode_logits_close",
    "check_attend_dtypes",
    "check_quantized_engine_triton_equals_torch",
    "check_gpu_script_smoke",
]


@pytest.mark.slow  # ~0.5 min under the interpreter; test_serve_paged_kernel checks the kernel itself by default
def test_triton_decode_path_under_interpreter():
    pytest.importorskip("triton")
    code = "import tests.test_serve_paged_decode as t\nfor c in t.INTERPRETER_CHECKS: getattr(t, c)()\nprint('OK')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.endswith("OK\n"), proc.stdout[-3000:] + proc.stderr[-4000:]
