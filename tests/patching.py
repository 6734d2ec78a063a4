"""patch_everywhere: monkeypatch a project function in every module that bound it. Its registry lives in this
module (not in conftest, which pytest may load under a second name) so the conftest fixture sees every patch."""

from __future__ import annotations

import contextlib
import importlib
import sys

PROJECT_PACKAGES = ("runtime", "quantize", "speculate", "evals", "experiments")
_LATE_BINDINGS: list[tuple[str, object, object]] = []  # (name, patch, original) of this test's patch_everywhere


def project_modules() -> list:
    return [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").split(".")[0] in PROJECT_PACKAGES]


def patch_everywhere(monkeypatch, target: str, value) -> None:
    """monkeypatch "package.module.name" and every loaded project module's own binding of it: a module that
    did ``from package.module import name`` holds its own reference, which patching the source misses. A module
    first imported while the patch is on binds the patch itself: `restore_late_bindings` puts those back."""
    module_name, _, name = target.rpartition(".")
    original = getattr(importlib.import_module(module_name), name)
    for mod in project_modules():  # (the source module included: it holds the original too)
        if getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, value)
    _LATE_BINDINGS.append((name, value, original))


def restore_late_bindings() -> None:
    while _LATE_BINDINGS:
        name, value, original = _LATE_BINDINGS.pop()
        for mod in project_modules():
            if getattr(mod, name, None) is value:
                setattr(mod, name, original)


def spy_on_cpu_step(monkeypatch) -> list[bool]:
    """Record, per forward offered to the compiled CPU step (runtime.kernels.cpu_step.decode), whether it ran it."""
    from runtime.kernels import cpu_step

    taken: list[bool] = []
    original = cpu_step.decode

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(cpu_step, "decode", spy)
    return taken


@contextlib.contextmanager
def kv_pieces(keys: int):
    """The compiled step's attention splits contexts into pieces of `keys` keys (cpu_step.cpp's g_kv_piece) inside
    the block, its previous setting restored after."""
    from runtime.kernels import cpu_step

    ext = cpu_step.extension()
    before = ext.set_kv_piece(keys)
    try:
        yield
    finally:
        ext.set_kv_piece(before)


@contextlib.contextmanager
def kernel_family(name: str):
    """Run the CPU step's kernels of one family: "avx2", "avx512", "avx512bf16" or "amx", the latter optionally
    with its AMX row policy ("amx-dense"; plain "amx": the default, exact), then back to this CPU's best."""
    from runtime.kernels import cpu_step

    ext = cpu_step.extension()
    isa, _, policy = name.partition("-")
    ext.set_isa(isa)
    try:
        with cpu_step.amx_policy(policy or "exact"):
            yield ext.isa()
    finally:
        ext.set_isa("amx")
