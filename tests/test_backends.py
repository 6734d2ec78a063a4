"""runtime.model is the plain PyTorch model; the compiled CPU step is a backend installed from outside it
(runtime.backends). The two paths give the same greedy tokens and logits within fp32 reordering noise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from runtime.backends import CPU_STEP, PLAIN, CpuStepBackend, use_backend
from runtime.decoding import generate
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, Backend, current_backend, random_model
from runtime.sampling import SamplingParams
from tests.tiny_models import TINY_CONFIGS

MODEL_SOURCE = Path(__file__).resolve().parents[1] / "runtime" / "model.py"
needs_step = pytest.mark.skipif(cpu_step.extension() is None, reason="the C++ decode step could not be built here")


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names (``from a.b import c`` names a.b and a.b.c)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_model_imports_no_kernels():
    kernels = [m for m in imported_modules(MODEL_SOURCE.read_text()) if m.startswith("runtime.kernels")]
    assert kernels == [], f"runtime/model.py imports {kernels}: install a backend from outside instead"


def test_importing_runtime_installs_the_cpu_step():
    assert isinstance(current_backend(), CpuStepBackend)
    with use_backend(PLAIN):
        assert current_backend() is PLAIN
    assert current_backend() is CPU_STEP
    assert type(PLAIN) is Backend  # the plain path is the model's own default


@needs_step
@torch.inference_mode()
def test_plain_and_cpu_step_backends_agree(monkeypatch):
    """fp32 tiny model: ragged greedy decoding gives the same tokens; logits of a long prefill (more rows than one
    kernel call takes) and of decode steps agree to fp32 reordering noise (atol 2e-5, rtol 1e-4)."""
    model = random_model(TINY_CONFIGS["llama"], seed=0)
    prompts = [[5, 9, 2], [8, 1, 6, 2, 9, 9, 10, 5, 4, 4, 7], [3, 3, 8, 1, 2, 6]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    steps: list[bool] = []
    decode = cpu_step.decode

    def spy(*args):
        out = decode(*args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(cpu_step, "decode", spy)
    fast = generate(model, prompts, params).tokens
    assert steps and all(steps)  # the step ran every decode step
    steps.clear()
    with use_backend(PLAIN):
        plain = generate(model, prompts, params).tokens
    assert steps == []  # the plain backend never asks the step
    assert fast == plain

    tokens = torch.randint(0, model.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    logits = {}
    for backend in (CPU_STEP, PLAIN):
        with use_backend(backend):
            cache = KVCache(model.config, 2, 84)
            prefill = model(tokens[:, :70], AttentionMetadata.contiguous(2, 0, 70, "cpu"), cache)
            step = [model(tokens[:, i : i + 1], AttentionMetadata.contiguous(2, i, 1, "cpu"), cache) for i in (70, 71)]
            logits[backend] = torch.cat([prefill, *step], dim=1)
    torch.testing.assert_close(logits[CPU_STEP], logits[PLAIN], atol=2e-5, rtol=1e-4)


@needs_step
@torch.inference_mode()
@pytest.mark.parametrize("head_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, cpu_step.MAX_ROWS + 3])
def test_widened_head_logits_are_the_head_outputs_widened(head_dtype, rows, monkeypatch):
    """The head's logits through the backend's one-pass hook (rounded to the head's dtype inside the kernels'
    call, kept fp32) are lm_head(h).float() bit for bit (a NaN stays a NaN: torch's own casts disagree on its
    bits), at a decode step's, a verification's and a chunked call's row counts; the hook ran."""
    model = random_model(TINY_CONFIGS["llama"], seed=1).set_dtype(torch.bfloat16, head_dtype=head_dtype)
    h = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(head_dtype)
    h[-1, 0] = float("nan") if rows > 1 else h[-1, 0]  # the last row's logits: all NaN
    widened = []
    hook = CpuStepBackend.linear_widened
    monkeypatch.setattr(CpuStepBackend, "linear_widened", lambda *a: widened.append(1) or hook(*a))
    with use_backend(CPU_STEP):
        got = model.logits(h)
        want = torch.cat([model.lm_head(h[i : i + 1]).float() for i in range(rows)])
    assert widened
    assert got.dtype == torch.float32
    finite = rows - 1 if rows > 1 else rows
    assert got[finite:].isnan().all() and want[finite:].isnan().all()
    assert torch.equal(got[:finite].view(torch.int32), want[:finite].view(torch.int32))
