"""qspec's CPU step (cpu_step.cpp): linear kernels for every weight format, and whole decode / verification steps.

The contract quantized layers plug into: a linear module that can run in the step has ``cpu_kernel_weight()``
returning a ``KernelWeight`` in one of the layouts below (runtime.model's dense ``Linear`` needs none: its own
[N, K] weight is read in place). ``quantize.qlinear.QuantLinear`` keeps its codes in these layouts on its "cpu"
path, so the step reads them with no copy.

Layouts (K_pad = K rounded up to a multiple of 32; 16 output rows per tile, rows padded with zeros; pair j of a
tile holds, for each of its 16 rows, input columns 2j and 2j + 1):
  i8   int8  [tiles, K_pad / 2, 16, 2] code - 128; zeros hold z - 128
  i4   uint8 [tiles, K_pad / 2, 16]    code(2j) | code(2j + 1) << 4 (2- and 3-bit codes too); zeros hold z
  fp8  uint8 [tiles, K_pad / 2, 16, 2] e4m3 bytes; scales hold scale * 256 (the kernel decodes e4m3 as fp16 bits)
  scales, zeros: fp32 [tiles, groups, 16] (zeros int8 where they are integers: zero_table); a group is ``group``
  consecutive columns after ``perm`` (act-order), an even number of them (or all K).
``int8_activations`` (W8A8, W4A8; i8 / i4 layouts, integer zero points): each input row is quantized per token to
int8 (quantize.grid.quantize_activations_per_token's math) and the kernels sum integer products exactly (AVX512-VNNI
vpdpbusd, else vpmaddwd), then scale per group in QuantLinear.w8a8_reference's order: equal to it bit for bit.

The extension is built once per machine (``torch.utils.cpp_extension``, g++; AVX2 + FMA + F16C baseline, the
AVX-512 and AVX512-BF16 kernels chosen at run time) under ``$QSPEC_HOME/extensions``; where it cannot be built
or the CPU lacks AVX2, one warning says why and the Python layers run. ``QSPEC_CPU_STEP=0`` turns it off,
``QSPEC_CPU_ISA=avx2|avx512|avx512bf16`` caps the kernel family (tests run every family on one machine; AMX,
where the CPU and the OS offer it, is the top one).

Dense layers read each core's weight rows as four streams side by side (cpu_step.cpp, run_dense), and the weights
and codes the step reads are copied once into transparent huge pages when their handles are first built
(runtime.kernels.huge_pages; ``QSPEC_HUGE_PAGES=0`` keeps them where they are): values unchanged.

Quantized KV caches (runtime.kv_quant: int8, fp8_e4m3, int4 KIVI; the contiguous QuantizedKVCache and the paged
pool) run in the step too: it quantizes each new token's k/v as kv_quant's writer does (same bits) and its attention
dequantizes one cached row at a time from the codes, in place; int4's write plan (which key groups a forward opens
and seals) is made once per step by the pool (``KVPool.begin_step_write``), the step seals the groups layer by layer.

Shape invariance: a position's outputs are the same bits whatever the step's row count, batch or tree shape
(cpu_step.cpp's header), so greedy speculative decoding equals plain greedy decoding token for token.
``QSPEC_CPU_AMX`` is AMX's row policy where the CPU has AMX: ``exact`` (default: AMX tiles for every bf16-activation
layer at every row count, dense and quantized: row-invariant; on the 1.5B a 1-row step costs what the vector
kernels' does and an 8-row verification ~1.2x of it instead of 2.3-3x), ``dense`` (tiles for dense bf16 layers
only, the vector kernels for quantized ones), ``off`` (the vector kernels only) or ``approximate`` (AMX from
AMX_MIN_ROWS rows only: a row's last bits then depend on the row count, so speculative greedy output can differ from
plain).

Prefill: a quantized layer called with PREFILL_MIN_ROWS rows or more (a long prompt through the Python layers)
dequantizes its weight block by block in C++ and multiplies with torch's GEMM (``prefill_linear``), as fast as a
bf16 layer's own prefill plus the dequantization; APPROXIMATE like bf16's (the weight is rounded to the activation
dtype, the GEMM's sum order depends on the shape). ``QSPEC_PREFILL_GEMM=0`` keeps every row on the exact kernels.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.kernels.huge_pages import place_member
from runtime.paths import qspec_home

SOURCE = Path(__file__).with_name("cpu_step.cpp")
# AVX2 baseline for the whole file; no FMA contraction outside the kernels' explicit ones (rope and the norms then
# round exactly as the Python ops do)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
# at::parallel_for is OpenMP inlined into this file: -fopenmp links libgomp.so.1, which resolves to the copy torch
# loaded already (one thread pool for torch's ops and ours)
LDFLAGS = ["-fopenmp"]
KINDS = {"f32": 0, "bf16": 1, "i8": 2, "i4": 3, "fp8": 4}
TILE = 16
K_ALIGN = 32
MAX_ROWS = 64  # activation rows (tokens x sequences) one kernel call takes
MAX_TOKENS = 64  # new tokens per row a step takes: longer chunks (prefills) run the Python layers; trees any size
# ... except where every layer takes int8 activations (W4A8 / W8A8): the Python layers would call the same integer
# kernels 64 rows at a time, with torch's ops around them, so the step takes prompt chunks up to this long too
MAX_INT8_ACT_TOKENS = 512
_STATE: dict = {}


def enabled() -> bool:
    return os.environ.get("QSPEC_CPU_STEP", "1") != "0"


def cpu_flags() -> set[str]:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return set()
    line = next((ln for ln in path.read_text().splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def build_key() -> str:
    """Source, flags, torch version and this CPU's features: a build from another machine is never reused."""
    parts = [
        SOURCE.read_text(),
        " ".join(FLAGS + LDFLAGS),
        torch.__version__,
        sys.version,
        " ".join(sorted(cpu_flags())),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def extension():
    """The compiled module, or None (with one warning) where it cannot be built or run here."""
    if "module" not in _STATE:
        _STATE["module"] = None
        missing = {"avx2", "fma", "f16c"} - cpu_flags()
        if missing:
            warnings.warn(f"qspec: this CPU lacks {sorted(missing)}; the CPU step is off (Python layers)", stacklevel=2)
            return None
        try:
            from torch.utils.cpp_extension import load

            key = build_key()
            build_dir = qspec_home() / "extensions" / f"cpu_step-{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            # compile a copy kept in the build directory: every checkout of the same source shares one build
            source = build_dir / SOURCE.name
            if not source.is_file() or source.read_text() != SOURCE.read_text():
                source.write_text(SOURCE.read_text())
            if not any(build_dir.glob("*.so")):
                print("[qspec] compiling the CPU step (once per machine, ~1 min)", file=sys.stderr, flush=True)
            module = load(
                name=f"qspec_cpu_step_{key}",
                sources=[str(source)],
                extra_cflags=FLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(build_dir),
                verbose=False,
            )
            cap = os.environ.get("QSPEC_CPU_ISA")
            if cap:
                module.set_isa(cap)
            module.set_amx(os.environ.get("QSPEC_CPU_AMX", "exact"))
            _STATE["module"] = module
        except Exception as err:  # no compiler, no ninja, a read-only cache: the Python path still works
            warnings.warn(f"qspec: CPU step unavailable, using the Python layers ({err})", stacklevel=2)
    return _STATE["module"]


def available() -> bool:
    return enabled() and extension() is not None


@dataclass
class KernelWeight:
    """One linear layer in a kernel layout (module docstring). data/scales/zeros already laid out."""

    kind: str  # "i8" | "i4" | "fp8" (dense f32/bf16 weights are read from nn.Linear directly)
    out_features: int
    in_features: int
    group: int  # input columns per scale group (in_features: per channel)
    data: Tensor
    scales: Tensor
    zeros: Tensor
    perm: Tensor | None = None  # act-order: input column of each packed column
    bias: Tensor | None = None
    bf16_activations: bool = False  # the layer computes in bf16: inputs are rounded to bf16 first
    int8_activations: bool = False  # W8A8 / W4A8: inputs quantized per token to int8, integer dot products

    def __getstate__(self):  # copies and pickles rebuild the extension's handle over their own tensors
        return {k: v for k, v in self.__dict__.items() if k != "_handle"}

    def handle(self):
        """The extension's Weight over these tensors (built once; it holds references, no copy)."""
        if "_handle" not in self.__dict__:
            self.__dict__["_handle"] = extension().Weight(
                KINDS[self.kind], self.out_features, self.in_features, self.group, self.bf16_activations, self.data,
                self.scales, self.zeros, self.perm, self.bias, int8_act=self.int8_activations,
            )  # fmt: skip
        return self.__dict__["_handle"]


def dense_handle(weight: Tensor, bias: Tensor | None = None):
    """The extension's Weight over a dense [N, K] fp32 / bf16 tensor, read in place."""
    kind = {torch.float32: "f32", torch.bfloat16: "bf16"}[weight.dtype]
    return extension().Weight(KINDS[kind], weight.shape[0], weight.shape[1], 0, kind == "bf16", weight.contiguous(),
                              None, None, None, bias)  # fmt: skip


# ---- layouts (used by quantize.qlinear's "cpu" path; exact inverses for checkpoints and tests) --------------------


def padded_width(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def tiles(n: int) -> int:
    return -(-n // TILE)


def _tile_columns(codes: Tensor) -> Tensor:
    """[N, K] -> [tiles, K_pad, 16]: rows padded to whole tiles, columns to K_pad, then column-major per tile."""
    n, k = codes.shape
    padded = F.pad(codes, (0, padded_width(k) - k, 0, tiles(n) * TILE - n))
    return padded.view(tiles(n), TILE, -1).transpose(1, 2).contiguous()


def _untile_columns(tiled: Tensor, n: int, k: int) -> Tensor:
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:n, :k]


def _pairs(tiled: Tensor) -> Tensor:
    """[tiles, K_pad, 16] -> [tiles, K_pad / 2, 16, 2]: each row's two columns of a pair side by side."""
    t, k, r = tiled.shape
    return tiled.view(t, k // 2, 2, r).transpose(2, 3).contiguous()


def _unpairs(paired: Tensor) -> Tensor:
    t, j, r, _ = paired.shape
    return paired.transpose(2, 3).reshape(t, 2 * j, r)


def group_table(values: Tensor, n: int) -> Tensor:
    """Per-row, per-group values [N, G] -> fp32 [tiles, G, 16]."""
    padded = F.pad(values.float(), (0, 0, 0, tiles(n) * TILE - n))
    return padded.view(tiles(n), TILE, -1).transpose(1, 2).contiguous()


def zero_table(zeros: Tensor, n: int) -> Tensor:
    """Per-row, per-group zero points [N, G] -> [tiles, G, 16]: int8 where every one is an integer in int8's range
    (fewer bytes for a decode step to stream; the kernels widen them to the same fp32 values), fp32 otherwise."""
    table = group_table(zeros, n)
    if torch.equal(table, table.round()) and (
        table.numel() == 0 or -128 <= float(table.min()) <= float(table.max()) <= 127
    ):
        return table.to(torch.int8)
    return table


def group_untable(table: Tensor, n: int) -> Tensor:
    return table.transpose(1, 2).reshape(-1, table.shape[1])[:n]


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [N, K] (group order) -> the i8 or i4 data layout."""
    if bits == 8:
        return _pairs(_tile_columns((codes.to(torch.int16) - 128).to(torch.int8)))
    if bits > 4:
        raise ValueError(f"the CPU step packs 2/3/4- and 8-bit codes, not {bits}-bit")
    tiled = _tile_columns(codes.to(torch.uint8))  # [tiles, K_pad, 16]
    return (tiled[:, 0::2] | (tiled[:, 1::2] << 4)).contiguous()


def unpack_codes(data: Tensor, bits: int, n: int, k: int) -> Tensor:
    """Inverse of pack_codes: uint8 codes [N, K]."""
    if bits == 8:
        return (_untile_columns(_unpairs(data), n, k).to(torch.int16) + 128).to(torch.uint8)
    low, high = data & 15, data >> 4
    tiled = torch.stack([low, high], dim=2).view(data.shape[0], -1, TILE)  # [tiles, K_pad, 16]
    return _untile_columns(tiled, n, k).contiguous()


def gather_rows(data: Tensor, bits: int, rows: Tensor, k: int) -> Tensor:
    """uint8 codes [R, K] (group order) of output rows `rows` from the i8 / i4 layout, without unpacking others."""
    rows = rows.long()
    picked = data[rows // TILE, :, rows % TILE]  # [R, K_pad / 2, 2] (i8) or [R, K_pad / 2] (i4)
    if bits == 8:
        return (picked.reshape(len(rows), -1)[:, :k].to(torch.int16) + 128).to(torch.uint8)
    return torch.stack([picked & 15, picked >> 4], dim=2).reshape(len(rows), -1)[:, :k]


def pack_fp8(weight_bytes: Tensor) -> Tensor:
    """e4m3 weights [N, K] (torch.float8_e4m3fn or their uint8 bits) -> the fp8 data layout."""
    return _pairs(_tile_columns(weight_bytes.view(torch.uint8) if weight_bytes.dtype != torch.uint8 else weight_bytes))


def unpack_fp8(data: Tensor, n: int, k: int) -> Tensor:
    return _untile_columns(_unpairs(data), n, k).contiguous().view(torch.float8_e4m3fn)


def linear(weight, x: Tensor, bf16_values: bool = False, rows_per_call: int = MAX_ROWS) -> Tensor:
    """y = x @ W^T (+ bias) through the kernels for x [M, K] fp32 / bf16, any M (calls of rows_per_call rows); fp32
    out, rounded to bf16 values with bf16_values (y.bfloat16().float() in the same pass)."""
    ext = extension()
    run = ext.linear_bf16_values if bf16_values else ext.linear
    rows = x.reshape(-1, x.shape[-1]).float()
    per = max(rows_per_call, 1)
    outs = [run(weight, rows[i : i + per]) for i in range(0, rows.shape[0], per)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).view(*x.shape[:-1], -1)


# ---- prefill: many rows per call through a GEMM on the dequantized weight -----------------------------------------

# from this many rows a quantized layer takes prefill_linear: the bars' shortest prompt (the crossover with the
# exact kernels between 65 and 127 rows is not measured yet); output rows per core and GEMM: 128 keeps a block of
# K = 1536 (the 1.5B's) in L2 and was the best of 64..512 at 128 / 512 / 2048 rows (notes/issue-39.md)
PREFILL_MIN_ROWS = 128
PREFILL_BLOCK_ROWS = 128


def prefill_gemm_enabled() -> bool:
    """QSPEC_PREFILL_GEMM=0 keeps every row on the exact kernels (for exactness experiments)."""
    return os.environ.get("QSPEC_PREFILL_GEMM", "1") != "0"


def uses_prefill_gemm(rows: int) -> bool:
    return rows >= PREFILL_MIN_ROWS and prefill_gemm_enabled()


def prefill_linear(weight: KernelWeight, x: Tensor) -> Tensor:
    """y = x @ W^T (+ bias) for x [M, K] with many rows: each core dequantizes PREFILL_BLOCK_ROWS output rows at a
    time into its own scratch (cpu_step.cpp, ``prefill_linear``) and multiplies them by torch's GEMM, in the
    layer's activation dtype (bf16 or fp32; the output too; bf16 GEMMs in fp32 where ``widens_bf16_prefill``,
    the weight then exact). On AMX with bf16 activations (unless the AMX policy is off): up to 512 rows each core
    dequantizes panels of its tiles into L2 and multiplies them on the tiles (``amx_prefill``), beyond that the
    whole weight is dequantized and multiplied by one GEMM. APPROXIMATE in the last bits, as a dense bf16
    layer's prefill (F.linear): the weight is rounded to that dtype and the GEMM's summation order depends on the
    shape."""
    dtype = torch.bfloat16 if weight.bf16_activations else torch.float32
    return block_gemm(weight.handle(), x.to(dtype))


def widens_bf16_prefill() -> bool:
    """Whether a dense bf16 layer's many-row GEMM runs faster through ``block_gemm`` than F.linear: on
    a CPU without native bf16 dot products (no AVX512-BF16) torch's bf16 GEMM is a fallback ~7x slower than its
    fp32 GEMM (128 x 576 x 3072: 37.0 against 5.3 ms on an AVX2 EPYC, notes/issue-39.md)."""
    ext = extension()
    return ext is not None and not ext.native_bf16_gemm()


def block_gemm(handle, x: Tensor) -> Tensor:
    """x [..., K] @ W^T (+ bias) for many rows through the extension's ``prefill_linear``, in x's dtype: each core
    dequantizes (a quantized ``KernelWeight``) or widens (a dense bf16 ``dense_handle``, where
    ``widens_bf16_prefill``: the function F.linear computes, fp32 sums of bf16 products rounded to bf16, up to
    summation order) PREFILL_BLOCK_ROWS output rows at a time in its own scratch and multiplies them there."""
    rows = x.detach().reshape(-1, x.shape[-1])  # no autograd through the kernels (as ``linear``)
    return extension().prefill_linear(handle, rows, PREFILL_BLOCK_ROWS).view(*x.shape[:-1], -1)


def quantized_linear(weight: KernelWeight, x: Tensor) -> Tensor:
    """A quantized layer's forward on CPU: the exact row-invariant kernels (``linear``, fp32 out) below
    PREFILL_MIN_ROWS rows, ``prefill_linear`` (the activation dtype out) from there, unless switched off.
    int8-activation layers (W8A8 / W4A8) always take their integer kernels, all rows in one call (the kernels keep
    each tile's expanded codes for every block of rows): a dequantized GEMM would skip the activations'
    quantization, i.e. compute another function."""
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.int8_activations:
        return linear(weight.handle(), x, rows_per_call=rows)
    return prefill_linear(weight, x) if uses_prefill_gemm(rows) else linear(weight.handle(), x)


def dequantize(weight: KernelWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The weight [N, K] as the prefill GEMM multiplies it: (code - z) * s in fp32, rounded to dtype (bf16 or
    fp32), columns in input order (act-order undone)."""
    transposed = extension().dequantize_t(weight.handle(), dtype == torch.bfloat16)  # [K, N], group order
    w = transposed.t()
    if weight.perm is None:
        return w.contiguous()
    out = torch.empty_like(w, memory_format=torch.contiguous_format)
    out[:, weight.perm] = w  # column j of the layout is input column perm[j]
    return out


AMX_POLICIES = ("exact", "dense", "off", "approximate")


@contextmanager
def amx_policy(policy: str | None):
    """Run a block under an AMX row policy (module docstring), then restore the previous one. None, or no CPU step
    here: the block runs under whatever is set."""
    ext = extension() if policy is not None else None
    if ext is None:
        yield
        return
    previous = ext.amx_mode()
    ext.set_amx(policy)
    try:
        yield
    finally:
        ext.set_amx(previous)


FAMILY_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
FAMILY_FLAGS["avx512bf16"] = FAMILY_FLAGS["avx512"] | {"avx512_bf16"}
FAMILY_FLAGS["amx"] = FAMILY_FLAGS["avx512bf16"] | {"amx_bf16", "amx_tile"}


def isa_supported(family: str) -> bool:
    """Whether this CPU runs a kernel family (avx2 | avx512 | avx512bf16 | amx)."""
    return FAMILY_FLAGS[family] <= cpu_flags()


# ---- the whole step --------------------------------------------------------------------------------------------


@dataclass
class StepEntry:
    """A model's compiled StepModel and what it was built from. ``generation``: the registrations count when last
    checked in full; ``modules`` / ``types``: every module the check looks at and its class then (a class swapped in
    place, as runtime.reference.naive_attention does, registers nothing); ``weights`` / ``pointers``: every dense
    weight and norm the step reads and its data pointer then (an in-place ``.data`` swap moves the pointer)."""

    generation: int
    fingerprint: tuple
    built: object
    int8_acts: bool
    modules: list
    types: list[type]
    weights: list[Tensor]
    pointers: list[int]

    def unchanged(self) -> bool:
        """Whether nothing the step reads can have changed since the last full check, without walking the model
        (that walk, run on caches the step's weights just flushed, cost ~0.35 ms a decode step)."""
        return (
            self.generation == _GENERATION[0]
            and [type(m) for m in self.modules] == self.types
            and [w.data_ptr() for w in self.weights] == self.pointers
        )

    def checked(self, generation: int) -> StepEntry:
        """Record a full check that found the model unchanged (at registrations count `generation`)."""
        self.generation, self.pointers = generation, [w.data_ptr() for w in self.weights]
        return self


_STEP_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> StepEntry

# Counts module / parameter / buffer registrations anywhere (a layer replaced, a weight re-assigned) and dropped
# kernel layouts (drop_kernel_weight): a cached StepModel is checked in full (fingerprint) only after one.
_GENERATION = [0]


def _registered(*_) -> None:
    _GENERATION[0] += 1


for _register in (
    torch.nn.modules.module.register_module_module_registration_hook,
    torch.nn.modules.module.register_module_parameter_registration_hook,
    torch.nn.modules.module.register_module_buffer_registration_hook,
):
    _register(_registered)


def drop_kernel_weight(module) -> None:
    """Forget a quantized layer's kernel layout (its codes, bias or dtype changed): the next call rebuilds it, and
    cached whole-step models holding the old one are checked again."""
    module.__dict__.pop("_kernel_weight", None)
    _GENERATION[0] += 1


def weight_handle(module, dtype: torch.dtype):
    """The extension's Weight for a linear module computing in dtype, or None when the step cannot run it."""
    kernel_weight = getattr(module, "cpu_kernel_weight", None)
    if kernel_weight is not None:  # a quantized layer in a kernel layout (quantize.qlinear)
        kw = kernel_weight()
        return None if kw is None or kw.bf16_activations != (dtype == torch.bfloat16) else kw.handle()
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dtype != dtype or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    place_member(module, "weight")  # the step streams it: huge pages (runtime.kernels.huge_pages)
    bias = getattr(module, "bias", None)
    return dense_handle(weight.detach(), None if bias is None else bias.detach().float())


def fingerprint(layers: list[tuple]) -> tuple:
    """What changes when a layer's module or weights change: each module, and its weight's storage (dense) or its
    kernel layout object (quantized). Read from the modules' own dicts: this runs every step."""
    out = []
    for mods in layers:
        for m in mods:
            weight = m._parameters.get("weight") if "weight" in m._parameters else None
            out.append(id(m))
            out.append(weight.data_ptr() if weight is not None else id(m.__dict__.get("_kernel_weight")))
    return tuple(out)


def step_model(model):
    """The extension's StepModel over the model's layers (cached; rebuilt when a module or weight changes), or
    None when some layer is not one the step runs."""
    entry = _step_entry(model)
    return None if entry is None else entry.built


def step_tokens_limit(model) -> int:
    """The most new tokens per row the step takes in a causal chunk (trees: any number)."""
    entry = _step_entry(model)
    return MAX_INT8_ACT_TOKENS if entry is not None and entry.int8_acts else MAX_TOKENS


def _step_entry(model) -> StepEntry | None:
    cached = _STEP_MODELS.get(model)
    if cached is not None and cached.unchanged():
        return cached
    generation = _GENERATION[0]
    layers = model.step_layers()  # per layer: input norm, post norm, qkv, o, gate_up, down (runtime.model)
    if layers is None:
        return None
    if cached is not None and cached.fingerprint == fingerprint(layers):
        return cached.checked(generation)
    dtype = model.compute_dtype
    norms, linears, int8_acts = [], [], True
    for input_norm, post_norm, *lin in layers:
        if input_norm.weight.dtype != dtype or post_norm.weight.dtype != dtype:
            return None
        norms += [input_norm.weight.detach(), post_norm.weight.detach()]
        handles = [weight_handle(m, dtype) for m in lin]
        if any(h is None for h in handles):
            return None
        linears += handles
        int8_acts &= all(getattr(m, "cpu_kernel_weight", None) and m.cpu_kernel_weight().int8_activations for m in lin)
    cfg = model.config
    built = extension().StepModel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                  norms, linears)  # fmt: skip
    # after the handles: they make the layouts and move weights into huge pages
    parts = [m for layer in model.layers for m in (layer, layer.self_attn, layer.mlp)]
    modules = parts + [m for mods in layers for m in mods]
    weights = [m.weight for mods in layers for m in mods if isinstance(m._parameters.get("weight"), Tensor)]
    entry = StepEntry(
        generation, fingerprint(layers), built, int8_acts, modules, [type(m) for m in modules], weights, []
    )
    _STEP_MODELS[model] = entry
    return entry.checked(generation)


def decode(model, x: Tensor, meta, cache) -> Tensor | None:
    """Run every decoder layer on x [B, T, hidden] (the fp32 residual stream) in one call: T <= MAX_TOKENS new
    tokens per row (a candidate tree: any number) at the cache indices the metadata gives (``meta.starts``,
    ``meta.counts``, optional ``meta.local_mask``: chains, trees, ragged rows), over a contiguous KVCache or a paged
    pool in the compute dtype, or a quantized pool (QuantizedKVCache, a quantized PagedKVCache: int8, fp8_e4m3,
    int4, read in place). Returns the residual stream after the last layer, or None when this step does not
    qualify (the Python layers run)."""
    T = x.shape[1]
    starts = getattr(meta, "starts", None)
    if not (
        enabled()
        and model.fast_decode
        and starts is not None
        and getattr(cache, "decode_kernel", None) != "triton"  # a paged pool asked to run its Triton kernel
        and 1 <= T
        and x.dtype == torch.float32  # the residual stream: fp32 models and bf16 (mixed) ones
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and extension() is not None
        # trees: any size (verification); a longer causal chunk only where the model takes it (its layers read once
        # per prompt, not per decode step)
        and (T <= MAX_TOKENS or getattr(meta, "local_mask", None) is not None or T <= step_tokens_limit(model))
    ):
        return None
    if quantized_pool(model, cache) is not None:
        return decode_quantized(model, x, meta, cache)
    if not (
        getattr(cache, "k", None) is not None
        and cache.k.dtype == model.compute_dtype
        and cache.k.dtype in (torch.float32, torch.bfloat16)
    ):
        return None
    paged = getattr(meta, "block_tables", None) is not None
    if not paged and type(cache).__name__ != "KVCache":
        return None
    built = step_model(model)
    if built is None:
        return None
    B = x.shape[0]
    counts = meta.counts if meta.counts is not None else torch.full((B,), T, dtype=torch.long)
    cos, sin = step_rope(model, meta, B * T)
    hidden = x.reshape(B * T, x.shape[2]).contiguous()
    local = meta.local_mask
    out = extension().step(
        built, hidden, T, starts.long().contiguous(), counts.long().contiguous(),
        None if local is None else local.contiguous(), cache.k, cache.v,
        meta.block_tables if paged else None, cos, sin,
    )  # fmt: skip
    return out.view(x.shape)


# model -> {dtype: (cos [P, D], sin [P, D / 2])}: model.rope of positions 0..P-1
_ROPE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
ROPE_TABLE_BLOCK = 1024  # positions per model.rope call when a table grows


def step_rope(model, meta, rows: int) -> tuple[Tensor, Tensor]:
    """The step's rope tables: cos [rows, D] and sin [rows, D / 2] in the compute dtype, rows of a table of every
    position so far: two index ops a step instead of model.rope's dozen small ones (~0.1 ms on the caches a step
    leaves), and a position's values are the same bits in every call, whatever its shape."""
    positions = meta.positions.reshape(rows)
    dtype = model.compute_dtype
    tables = _ROPE_TABLES.setdefault(model, {})
    cos, sin = tables.get(dtype, (None, None))
    top = int(positions.max())
    if cos is None or top >= cos.shape[0]:
        size = max(top + 1, 2 * (0 if cos is None else cos.shape[0]))
        cos, sin = tables[dtype] = rope_table(model, dtype, -(-size // ROPE_TABLE_BLOCK) * ROPE_TABLE_BLOCK)
    return cos.index_select(0, positions), sin.index_select(0, positions)


def rope_table(model, dtype: torch.dtype, size: int) -> tuple[Tensor, Tensor]:
    """model.rope of positions 0..size-1, a block of positions a call: cos [size, D], sin [size, D / 2]."""
    parts = []
    for start in range(0, size, ROPE_TABLE_BLOCK):
        cos, sin = model.rope(torch.arange(start, min(start + ROPE_TABLE_BLOCK, size))[None], dtype)
        parts.append((cos[0, :, 0], sin[0, :, 0, 1]))  # [n, D], [n, D / 2] (sin's signed halves: the + one)
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


# ---- quantized KV caches (runtime.kv_quant): the step writes codes and reads them in place ------------------------

KV_FORMATS = {"int8": 1, "fp8_e4m3": 2, "int4": 3}  # cpu_step.cpp's KvFormat
QUANTIZED_CACHES = ("QuantizedKVCache", "PagedKVCache")  # a sink-window cache evicts: the Python layers run it


def quantized_pool(model, cache):
    """The cache's quantized KVPool when the step can run it, else None."""
    pool = getattr(cache, "pool", None)
    if type(cache).__name__ not in QUANTIZED_CACHES or getattr(pool, "kv_dtype", None) not in KV_FORMATS:
        return None
    D = model.config.head_dim
    dtype_ok = pool.dtype == model.compute_dtype and pool.dtype in (torch.float32, torch.bfloat16)
    return pool if dtype_ok and pool.device.type == "cpu" and D % 16 == 0 and D <= 256 else None


def decode_quantized(model, x: Tensor, meta, cache) -> Tensor | None:
    """decode() over a quantized pool: the contiguous QuantizedKVCache (its row-by-row block tables) or a paged
    one (the metadata's). int4's write plan (which key groups this write opens and seals) is made here, once per
    step, by the pool itself; the step then writes, seals and attends layer by layer."""
    pool, B, T = cache.pool, x.shape[0], x.shape[1]
    paged = getattr(meta, "block_tables", None) is not None
    if paged != (type(cache).__name__ == "PagedKVCache"):
        return None
    counts = meta.counts if meta.counts is not None else torch.full((B,), T, dtype=torch.long)
    if not paged and bool((counts != T).any()):  # the contiguous writer writes padding tokens too: Python layers
        return None
    built = step_model(model)
    if built is None:
        return None
    if not paged:
        cache.check_fits(meta.kv_len)
    tables = meta.block_tables if paged else cache.tables[:B]
    stored = pool.stored  # as stored: per-token tensors [L, N, Hkv, bs, ...] (runtime.kv_quant's layout)
    tensors = [stored["k"], stored["v"], stored["k_scale"], stored["v_scale"]]
    if pool.kv_dtype == "int4":
        flat, ends = int4_write(cache, meta, B, paged)
        stage = pool.begin_step_write(flat, tables.long(), ends)
        plan = pool.plan
        tensors += [stored["k_min"], stored["v_min"], pool.k_open, pool.open_of_dev, stage, plan.stage_of]
        tensors.append(plan.seal_blocks)
    cos, sin = step_rope(model, meta, B * T)
    local = meta.local_mask
    out = extension().step_quant(
        built, x.reshape(B * T, x.shape[2]).contiguous(), T, meta.starts.long().contiguous(),
        counts.long().contiguous(), None if local is None else local.contiguous(), tables, cos, sin,
        KV_FORMATS[pool.kv_dtype], pool.lookahead, tensors,
    )  # fmt: skip
    return out.view(x.shape)


def int4_write(cache, meta, B: int, paged: bool) -> tuple[Tensor, list[int]]:
    """The global slots this forward writes and each row's end, as the cache's Python writer computes them."""
    if paged:  # padding tokens write the scratch block: not written
        slots = meta.slots.masked_fill(meta.slots < cache.block_size, -1).reshape(-1)
        return slots[slots >= 0], meta.context_lens.tolist()
    return (meta.slots + cache.row_base[:B]).reshape(-1), (meta.slots.max(1).values + 1).tolist()


def argmax_rows(x: Tensor) -> Tensor | None:
    """x.argmax(-1) of fp32 CPU logits [..., V] in one compiled pass per row (torch.argmax's rule: the first maximum,
    a NaN counting as the largest), or None where the extension is off."""
    if not enabled() or extension() is None:
        return None
    return extension().argmax_rows(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape[:-1])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """F.rms_norm(x, weight, eps) of fp32 CPU rows in one compiled pass, or None where the extension is off."""
    if not enabled() or extension() is None:
        return None
    return extension().rms_norm_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
