"""The compiled CPU decode step: every decoder layer of a decode step in one C++ call (cpu_decode.cpp).

Python costs ~45 dispatched ops per layer in a decode step (norms, rope, cache writes, attention, SiLU);
on the 2-core CPU those cost as much as a third of the weight-streaming time. The C++ step keeps ATen's
GEMV for the four projections and does the rest in short loops. It serves CPU models with an fp32
residual stream (fp32, and bf16 with ``mixed=True``) whose layers are runtime.model's own (plain ``Linear``
weights, no q/k norm) with a contiguous KVCache, when every row's new tokens (one, or a chunk of up to
MAX_TOKENS such as a chain verification) sit at the same positions; anything else keeps the Python path.

The extension is built once per machine (``torch.utils.cpp_extension``, g++) under
``$QSPEC_HOME/extensions``; where it cannot be built, a warning says why and the Python path runs.
``QSPEC_FAST_DECODE=0`` turns it off; ``Transformer.fast_decode = False`` does so for one model.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

from runtime.kv_cache import KVCache
from runtime.paths import qspec_home

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]  # no FMA contraction: rope matches apply_rope exactly
MAX_TOKENS = 32  # longer chunks (prefills) are GEMM-bound: the Python layers and SDPA's causal kernel run them
_STATE: dict = {}


def enabled() -> bool:
    return os.environ.get("QSPEC_FAST_DECODE", "1") != "0"


def build_key() -> str:
    """Source, flags, torch version and this CPU's features: a build from another machine is never reused."""
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    parts = [SOURCE.read_text(), " ".join(FLAGS), torch.__version__, sys.version, cpu]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def extension():
    """The compiled module, or None (with one warning) where it cannot be built."""
    if "module" not in _STATE:
        _STATE["module"] = None
        try:
            from torch.utils.cpp_extension import load

            key = build_key()
            build_dir = qspec_home() / "extensions" / f"cpu_decode-{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            # compile a copy kept in the build directory: ninja rebuilds whenever the source path changes, so
            # every checkout of the same source then shares one build
            source = build_dir / SOURCE.name
            if not source.is_file() or source.read_text() != SOURCE.read_text():
                source.write_text(SOURCE.read_text())
            if not any(build_dir.glob("*.so")):
                print("[qspec] compiling the CPU decode step (once per machine, ~1 min)", file=sys.stderr, flush=True)
            _STATE["module"] = load(
                name=f"qspec_cpu_decode_{key}",
                sources=[str(source)],
                extra_cflags=FLAGS,
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as err:  # no compiler, no ninja, a read-only cache: the Python path still works
            warnings.warn(f"qspec: CPU decode step unavailable, using the Python path ({err})", stacklevel=2)
    return _STATE["module"]


def decode(model, x: torch.Tensor, meta, cache) -> torch.Tensor | None:
    """Run every decoder layer on x [B, T, hidden]: T <= MAX_TOKENS new tokens per row, every row at positions
    meta.contiguous_start.., causal over the cache (a decode step, a chain verification, a short prefill);
    returns the residual stream [B, T, hidden] after the last layer, or None when this step does not
    qualify (the caller then runs the Python layers)."""
    T = x.shape[1]
    if not (
        enabled()
        and model.fast_decode
        and type(cache) is KVCache
        and 1 <= T <= MAX_TOKENS
        and meta.contiguous_start is not None  # set only by AttentionMetadata.contiguous: causal by position
        and meta.kv_len == meta.contiguous_start + T
        and x.dtype == torch.float32  # the residual stream: fp32 models and bf16 (mixed) ones
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
    ):
        return None
    tensors = model.compiled_step_tensors()
    if tensors is None or tensors[0].dtype != cache.k.dtype or extension() is None:
        return None
    cfg = model.config
    pos = int(meta.contiguous_start)
    cache.check_fits(meta.kv_len)
    cos, sin = model.rope_rows(pos, T)
    hidden = x.reshape(-1, x.shape[2]).contiguous()
    out = extension().decode_layers(
        hidden,
        T,
        tensors,
        cache.k,
        cache.v,
        cos,
        sin,
        pos,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
    )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """F.rms_norm(x, weight, eps) of fp32 CPU rows in one compiled pass, or None where the extension is off."""
    if not enabled() or extension() is None:
        return None
    return extension().rms_norm_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
