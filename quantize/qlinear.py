"""The shared quantized-linear contract.

Every quantizer (RTN, int8, GPTQ, AWQ) produces a ``QuantizedWeight``: unsigned integer codes plus
per-group scales and zero points. Every packed format saves and loads one. ``QuantLinear`` holds one and
is a drop-in for ``nn.Linear`` (same ``forward(x)`` contract); its ``reference`` path is plain
dequantize-then-matmul, which faster paths (CPU packed ops, Triton) are tested against.

W8A8 (int8 activations): the reference sums the integer products q * (code - zero) exactly, as the integer
matmul (``torch._int_mm``, int32 sums) does, and applies the scales after, per group, in the same order as the
``cpu_w8a8`` path: the two give the same outputs bit for bit. (A float sum of q * dequantized weight rounds
differently; the next layer's activation rounding then turns those last-bit differences into whole int8 steps,
so a model measured on one path and run on the other differed by ~1e-4 in perplexity.)

Dequantization: ``W[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g]`` with ``g = g_idx[i]``.
Symmetric quantization is the case ``zeros == 2**(bits-1)``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quantize.grid import quantize_activations_per_token
from quantize.kernels import cpu, cuda
from quantize.packing import block_shape, pack_codes, unpack_codes
from runtime.kernels import cpu_step
from runtime.kernels.huge_pages import place_member

SUPPORTED_BITS = (2, 3, 4, 8)  # every path: the reference and Triton
FAST_CPU_BITS = (4, 8)  # bit widths with a packed torch CPU kernel (quantize.kernels.cpu)
# W8A8 reference: a float32 matmul of integers is exact, whatever its summation order, while every partial sum
# stays below 2**24 (and in bf16/TF32 matmul modes too: both factors are integers of at most 8 bits)
EXACT_SUM = 2**24


@dataclass
class QuantizedWeight:
    codes: Tensor  # [out, in] uint8, values in [0, 2**bits)
    scales: Tensor  # [out, n_groups] float
    zeros: Tensor  # [out, n_groups] float (integer-valued zero points in code units)
    bits: int
    group_size: int  # input columns per group; == in_features for per-channel
    g_idx: Tensor | None = None  # [in] int32 group of each input column (act-order); None: i // group_size
    bias: Tensor | None = None

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"unsupported bit width {self.bits}; supported: {SUPPORTED_BITS}")
        out_features, in_features = self.codes.shape
        n_groups = -(-in_features // self.group_size)
        if self.scales.shape != (out_features, n_groups) or self.zeros.shape != (out_features, n_groups):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} / zeros {tuple(self.zeros.shape)} do not match "
                f"codes {tuple(self.codes.shape)} with group size {self.group_size} ({n_groups} groups)"
            )

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def group_index(self) -> Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        g = self.group_index()
        w = (self.codes.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of a packed checkpoint: bits per code plus fp16 scales and zeros per group."""
        return self.codes.numel() * self.bits // 8 + 2 * 2 * self.scales.numel()


PATHS = ("reference", "dense", "cpu", "cpu_int4", "cpu_int8", "cpu_w8a8", "cuda_int4", "cuda_int8", "triton")


class QuantLinear(nn.Module):
    """nn.Linear stand-in holding a QuantizedWeight, with one forward contract and several paths.

    act_quant=True is W8A8: activations are quantized per token to int8 before the matmul (the reference
    path sums the integer products exactly, then scales: the same outputs as cpu_w8a8's integer matmul and the
    cpu path's integer kernels, bit for bit; Triton dots in float: the same result up to summation order). With
    2/3/4-bit codes it is W4A8, an opt-in approximation of the weight-only layer (int8 activations let the CPU
    step use integer dot products; no checkpoint format stores it): paths reference, dense, cpu.

    Paths (``path="auto"`` picks one at the first forward from the input's device and compute_dtype; on CPU
    int4 is picked only for a 16-bit compute_dtype, since it rounds activations to bf16):
      reference  dequantize-then-matmul in fp32 (what every other path is tested against)
      dense      the reference math on a weight dequantized once and kept (fp32; W8A8: code - zero, the scales
                 applied after the integer sums): bit-identical to reference
                 and as fast as an unquantized fp32 model, for evaluating a quantized model's quality at
                 scale; resident bytes are the dense size plus the packed codes
      cpu        qspec's CPU step kernels (runtime.kernels.cpu_step: 2/3/4- and 8-bit codes, fp32 or bf16
                 activations, any group size that is even or per-channel; the decode step reads this layout
                 in place); the reference math up to summation order (W8A8 / W4A8: integer dot products,
                 equal to the reference bit for bit; integer zero points). From cpu_step.PREFILL_MIN_ROWS rows
                 (prompts) weight-only layers take the "prefill GEMM": the weight dequantized a block of output
                 rows at a time in C++, rounded to the activation dtype, times torch's GEMM
                 (cpu_step.prefill_linear): APPROXIMATE in the last bits, as a bf16 layer's own prefill;
                 QSPEC_PREFILL_GEMM=0 keeps the exact kernels (int8-activation layers always do)
      cpu_int4   torch's int4 packed matmul (2/3/4-bit codes, group size a multiple of 32; bf16 activations)
      cpu_int8   torch's int8 weight-only matmul (8-bit codes)
      cpu_w8a8   torch._int_mm on int8 activations and weights (act_quant=True, 8-bit codes)
      cuda_int4  torch's CUDA int4 kernel, tinygemm (2/3/4-bit codes in nibbles, group size a multiple of 32,
                 out_features % 16 == 0; bf16 activations)
      cuda_int8  per-channel int8 weight-only in plain torch ops (fused by torch.compile; runs on any device)
      triton     fused dequantize + matmul Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)

    The automatic rule on CPU (W8A8 too): ``cpu`` where the step's kernels are built and take the layer, else cpu_w8a8 /
    cpu_int8 / cpu_int4 (torch's packed ops) as supported. The automatic rule on CUDA: W8A8 and act-order (g_idx)
    layers run Triton; <= 4-bit codes run cuda_int4 when
    its layout fits and the compute dtype is 16-bit (Triton otherwise, for fp32 models, which keep fp32 math, and
    for a head whose rows a QuantEmbedding reads); per-channel 8-bit runs
    cuda_int8; other 8-bit layouts (groups) run Triton. On CPU: cpu_w8a8 / cpu_int8 / cpu_int4 as supported.
    Each path keeps only its own weight layout (so resident bytes are the packed size); ``qweight()``
    recovers the exact codes, scales and zeros from any of them.
    """

    def __init__(
        self,
        qweight: QuantizedWeight,
        act_quant: bool = False,
        compute_dtype: torch.dtype = torch.float32,
        path: str = "auto",
    ):
        super().__init__()
        if path not in PATHS + ("auto",):
            raise ValueError(f"unknown QuantLinear path {path!r}; choose from {PATHS + ('auto',)}")
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bits, self.group_size, self.act_quant = qweight.bits, qweight.group_size, act_quant
        self.compute_dtype = compute_dtype  # activation dtype the fast paths prepare their scales in
        self.auto = path == "auto"  # re-pick the path whenever the input's device type changes
        self.auto_device: str | None = None
        self.serves_rows = False  # set by QuantEmbedding: keep a layout that single rows can be read from
        self.register_buffer("scales", qweight.scales.float().contiguous())  # [out, n_groups]
        self.register_buffer("zeros", qweight.zeros.float().contiguous())  # [out, n_groups]
        self.register_buffer("g_idx", None if qweight.g_idx is None else qweight.g_idx.to(torch.int32))
        self.register_buffer("bias", None if qweight.bias is None else qweight.bias.to(compute_dtype))
        self.path = "reference"
        self.store(qweight.codes, "reference")
        if path != "auto":
            self.set_path(path)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) / set_dtype move the tables but must not re-round scales and zeros: keep their dtypes, and
        # follow the new compute dtype (the cpu kernels' activation rounding, the bias)
        kept = ("scales", "zeros", "kernel_scales", "kernel_zeros")
        saved = {n: self._buffers[n] for n in kept if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, t in saved.items():
            if self._buffers[n].dtype != t.dtype:
                self._buffers[n] = t.to(self._buffers[n].device)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        cpu_step.drop_kernel_weight(self)
        return self

    # ---- storage ----------------------------------------------------------------------------------------

    def store(self, codes: Tensor, path: str) -> None:
        """Keep the codes in the layout `path` reads, dropping every other layout."""

        layouts = ("packed_codes", "dense_weight", "int4_weight", "int4_scales_zeros", "int8_weight", "in_perm")
        layouts += ("int4_cuda_weight", "int8_cuda_weight", "kernel_data", "kernel_scales", "kernel_zeros")
        cpu_step.drop_kernel_weight(self)
        for name in layouts + ("zero_shift",):
            self._buffers.pop(name, None)
        self.path = path
        if path in ("reference", "dense", "triton"):
            per_block = block_shape(self.bits)[0]
            k_pad = -(-self.in_features // per_block) * per_block
            padded = F.pad(codes.t().to(torch.int32), (0, 0, 0, k_pad - self.in_features))
            # [k_pad * bits / 32, out] int32, GPTQ's layout (low bits first, 3-bit codes straddle words)
            self.register_buffer("packed_codes", pack_codes(padded, self.bits).to(codes.device))
            if path == "dense":  # not persistent: checkpoints hold the codes, never the dense copy
                # W8A8 keeps the integer weights (code - zero), which the exact integer sums read
                weight = self.centered_codes() if self.act_quant else self.qweight().dequantize(torch.float32)
                self.register_buffer("dense_weight", weight, persistent=False)
            return
        perm = cpu.contiguous_group_order(self.g_idx, self.group_size, self.in_features)
        self.register_buffer("in_perm", perm)
        if path == "cpu":  # the step's layout: codes in group order, tiles of 16 rows, per-tile scale tables
            ordered = codes if perm is None else codes[:, perm.to(codes.device)]
            n = self.out_features
            self.register_buffer("kernel_data", cpu_step.pack_codes(ordered.cpu(), self.bits))
            self.register_buffer("kernel_scales", cpu_step.group_table(self.scales.cpu(), n))
            zeros = self.zeros.float().cpu() - (128 if self.bits == 8 else 0)
            self.register_buffer("kernel_zeros", cpu_step.zero_table(zeros, n))
            return
        if path == "cuda_int4":  # converted once, here; forward only calls the kernel
            perm_dev = None if perm is None else perm.to(codes.device)
            weight, scales_zeros, self.int4_group = cuda.int4_pack(
                codes, self.scales, self.zeros, self.group_size, perm
            )
            self.register_buffer("int4_cuda_weight", weight)
            self.register_buffer("int4_scales_zeros", scales_zeros)
            self.register_buffer("in_perm", perm_dev)
        elif path == "cuda_int8":
            self.register_buffer("int8_cuda_weight", cuda.int8_pack(codes))
            shift = self.zeros - 128
            self.register_buffer("zero_shift", None if bool((shift == 0).all()) else shift.to(self.compute_dtype))
        elif path == "cpu_int4":
            weight, scales_zeros, self.int4_group = cpu.int4_pack(codes, self.scales, self.zeros, self.group_size, perm)
            self.register_buffer("int4_weight", weight)
            self.register_buffer("int4_scales_zeros", scales_zeros)
        else:  # cpu_int8, cpu_w8a8
            self.register_buffer("int8_weight", cpu.int8_pack(codes, self.group_size, perm))
            shift = self.zeros - 128
            self.register_buffer("zero_shift", None if bool((shift == 0).all()) else shift.to(self.compute_dtype))
        self.compact_scales()

    def compact_scales(self) -> None:
        """fp16 scales and uint8 zeros when that is exact (what checkpoints store): fewer resident bytes."""
        if torch.equal(self.scales.half().float(), self.scales.float()):
            self.scales = self.scales.half()
        z = self.zeros.float()
        if torch.equal(z, z.round()) and float(z.min()) >= 0 and float(z.max()) <= 255:
            self.zeros = z.to(torch.uint8)

    def codes_now(self) -> Tensor:
        """The uint8 codes [out, in], recovered from whichever layout this path keeps."""

        if "packed_codes" in self._buffers:  # by layout, not path name: subclasses may rename paths
            per_block = block_shape(self.bits)[0]
            k_pad = -(-self.in_features // per_block) * per_block
            return unpack_codes(self.packed_codes.cpu(), self.bits, k_pad)[: self.in_features].t().contiguous()
        if "kernel_data" in self._buffers:
            codes = cpu_step.unpack_codes(self.kernel_data, self.bits, self.out_features, self.in_features)
            return self._from_group_order(codes)
        if "int4_weight" in self._buffers:
            n_sub = self.int4_scales_zeros.shape[0]
            return cpu.int4_unpack(
                self.int4_weight, self.int4_group, n_sub, self.out_features, self.in_features, self.in_perm
            )
        if "int4_cuda_weight" in self._buffers:
            n, k = self.out_features, self.in_features
            return cuda.int4_unpack(self.int4_cuda_weight, self.int4_scales_zeros, self.int4_group, n, k, self.in_perm)
        if "int8_cuda_weight" in self._buffers:
            return (self.int8_cuda_weight.cpu().to(torch.int16) + 128).to(torch.uint8)
        n, k = self.out_features, self.in_features
        return cpu.int8_unpack(self.int8_weight.cpu(), n, k, self.group_size, self.in_perm)

    def row_codes(self, rows: Tensor) -> Tensor:
        """The uint8 codes [T, in] of output rows `rows` [T], read from this path's layout without unpacking the
        other rows (what a quantized embedding sharing this layer as its tied lm_head needs per token)."""

        rows = rows.long()
        if "packed_codes" in self._buffers:  # [k_pad * bits / 32, out]: a row of W is a column here
            per_block = block_shape(self.bits)[0]
            k_pad = -(-self.in_features // per_block) * per_block
            cols = self.packed_codes.index_select(1, rows.to(self.packed_codes.device))
            return unpack_codes(cols, self.bits, k_pad)[: self.in_features].t()
        if "kernel_data" in self._buffers:
            codes = cpu_step.gather_rows(self.kernel_data, self.bits, rows.cpu(), self.in_features)
        elif "int4_weight" in self._buffers:
            k_pad = self.int4_scales_zeros.shape[0] * self.int4_group
            codes = cpu.int4_gather_rows(self.int4_weight, self.out_features, k_pad, rows)[:, : self.in_features]
        elif "int8_cuda_weight" in self._buffers:
            return (
                self.int8_cuda_weight.index_select(0, rows.to(self.int8_cuda_weight.device)).to(torch.int16) + 128
            ).to(torch.uint8)
        elif "int8_weight" in self._buffers:
            flat = self.int8_weight
            codes = cpu.int8_gather_rows(
                flat, self.out_features, self.in_features, self.group_size, rows.to(flat.device)
            )
        else:
            raise ValueError(f"path {self.path!r} keeps no layout that single rows can be read from")
        perm = self._buffers.get("in_perm")
        if perm is None:
            return codes
        out = torch.empty_like(codes)  # column j of the packed order is input column perm[j]
        out[:, perm.to(codes.device)] = codes
        return out

    def _from_group_order(self, codes: Tensor) -> Tensor:
        """Codes [N, K] whose column j is input column in_perm[j] -> columns in input order."""
        perm = self._buffers.get("in_perm")
        if perm is None:
            return codes
        out = torch.empty_like(codes)
        out[:, perm.to(codes.device)] = codes
        return out

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        """Rows [T] of the dequantized weight, fp32 [T, in]: equal to ``qweight().dequantize()[rows]`` bit for
        bit, since groups run along the input dim and each row has its own scales and zeros."""
        rows = rows.long().to(self.scales.device)
        g = self.group_index()
        scales = self.scales.index_select(0, rows).float()[:, g]
        zeros = self.zeros.index_select(0, rows).float()[:, g]
        return (self.row_codes(rows).to(scales.device).float() - zeros) * scales

    def group_index(self) -> Tensor:
        """Group of each input column (g_idx under act-order, else consecutive groups of group_size)."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.scales.device) // self.group_size

    def set_path(self, path: str, pin: bool = True) -> QuantLinear:
        """Switch to another path (re-laying out the codes); raises if this layer cannot take it.
        pin=True (the default for callers) stops ``auto`` from switching it again."""
        self.auto = self.auto and not pin
        if path not in PATHS:
            raise ValueError(f"unknown QuantLinear path {path!r}; choose from {PATHS}")
        reason = self.unsupported_reason(path)
        if reason:
            raise ValueError(f"path {path!r} cannot run this layer: {reason}")
        if path != self.path:
            device = self.scales.device
            codes = self.codes_now()
            self.scales, self.zeros = self.scales.float(), self.zeros.float()
            self.store(codes.to(device), path)
        return self

    def unsupported_reason(self, path: str) -> str | None:

        if path in ("reference", "dense", "triton"):
            return None
        if path == "cpu":
            if self.act_quant and not torch.equal(self.zeros.float(), self.zeros.float().round()):
                return "the cpu kernels sum int8 activations times (code - zero) in integers: integer zero points"
            if not cpu_step.available():
                return "qspec's CPU step is not built here (runtime.kernels.cpu_step)"
            n_groups = -(-self.in_features // self.group_size)
            if self.bits < 8 and self.group_size % 2 and n_groups > 1:
                return "the cpu kernels read codes in column pairs: an even group size (or per-channel)"
            if self.scales.device.type != "cpu":
                return "the cpu kernels run on CPU tensors"
        if path == "cuda_int4":
            if self.act_quant:
                return "cuda_int4 is weight-only; W8A8 layers run on triton"
            if not cuda.int4_supported(self.bits, self.group_size, self.out_features):
                return "cuda_int4 needs <= 4 bits, a group size that is a multiple of 32 and out_features % 16 == 0"
        if path == "cuda_int8":
            if self.act_quant or self.bits != 8 or self.g_idx is not None or self.group_size < self.in_features:
                return "cuda_int8 needs weight-only 8-bit codes with one group per output channel"
            return None
        if path == "cpu_w8a8" and not self.act_quant:
            return "cpu_w8a8 quantizes activations; build the layer with act_quant=True"
        if path not in ("cpu_w8a8", "cpu") and self.act_quant:
            return "act_quant=True layers run on cpu, cpu_w8a8, reference or triton"
        if path == "cpu_int4" and not cpu.int4_supported(self.bits, self.group_size, self.out_features):
            return "cpu_int4 needs <= 4 bits, a group size that is a multiple of 32 and out_features % 16 == 0"
        if path in ("cpu_int8", "cpu_w8a8") and self.bits != 8:
            return f"{path} needs 8-bit codes"
        try:
            cpu.contiguous_group_order(self.g_idx, self.group_size, self.in_features)
        except ValueError as err:
            return str(err)
        return None

    def auto_path(self, device: torch.device) -> str:
        if device.type == "cuda":  # the rule in the class docstring
            if self.act_quant or self.g_idx is not None:
                return "triton"
            fits = self.unsupported_reason("cuda_int4") is None and not self.serves_rows
            if self.bits <= 4 and fits and self.compute_dtype != torch.float32:  # tinygemm rounds x to bf16
                return "cuda_int4"
            if self.bits == 8 and self.unsupported_reason("cuda_int8") is None:
                return "cuda_int8"
            return "triton"
        if self.unsupported_reason("cpu") is None:
            return "cpu"
        preferred = "cpu_w8a8" if self.act_quant else ("cpu_int8" if self.bits == 8 else "cpu_int4")
        if preferred == "cpu_int4" and self.compute_dtype == torch.float32:
            return "reference"  # int4 computes in bf16: an fp32 model keeps fp32 math unless it asks for the path
        return preferred if self.unsupported_reason(preferred) is None else "reference"

    def weight_bytes(self) -> int:
        """Resident bytes of this layer's tensors in its current layout (weights, scales, zeros, indices)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---- the nn.Linear face ------------------------------------------------------------------------------

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (for code that inspects .weight; not used by forward fast paths)."""
        return self.qweight().dequantize(self.compute_dtype)

    @property
    def codes(self) -> Tensor:
        return self.codes_now()

    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(
            self.codes_now().to(self.scales.device),
            self.scales.float(),
            self.zeros.float(),
            self.bits,
            self.group_size,
            self.g_idx,
            self.bias,
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.auto and self.auto_device != x.device.type:
            self.set_path(self.auto_path(x.device), pin=False)
            self.auto_device = x.device.type
            if self.path == "reference":
                say_slow_path(self)
        if self.path in ("reference", "dense"):
            return self.reference_forward(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.path == "triton":
            from quantize.kernels.triton_qmm import quant_matmul

            y = quant_matmul(x2, self)
        else:
            if self.path == "cpu":  # the exact kernels, or the prefill GEMM for many rows
                y = cpu_step.quantized_linear(self.cpu_kernel_weight(), x2)
            elif self.path == "cuda_int4":
                y = cuda.int4_mm(x2, self.int4_cuda_weight, self.int4_scales_zeros, self.int4_group, self.in_perm)
            elif self.path == "cuda_int8":
                y = cuda.int8_mm(x2, self.int8_cuda_weight, self.scales, self.zero_shift)
            elif self.path == "cpu_int4":
                y = cpu.int4_mm(x2, self.int4_weight, self.int4_scales_zeros, self.int4_group, self.in_perm)
            else:
                mm = cpu.w8a8_mm if self.path == "cpu_w8a8" else cpu.int8_mm
                y = mm(x2, self.int8_weight, self.scales, self.zero_shift, self.group_size, self.in_perm)
        if self.bias is not None and self.path != "cpu":  # the cpu kernels add it themselves
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def cpu_kernel_weight(self) -> cpu_step.KernelWeight | None:
        """This layer in the CPU step's layout (runtime.kernels.cpu_step's contract), or None when it keeps
        another path. An automatic layer on CPU moves to the "cpu" path here when it can."""
        if self.path != "cpu" and self.auto and self.unsupported_reason("cpu") is None:
            self.set_path("cpu", pin=False)
            self.auto_device = "cpu"
        if self.path != "cpu":
            return None
        kw = self.__dict__.get("_kernel_weight")
        if kw is None:
            n = -(-self.in_features // self.group_size)
            place_member(self, "kernel_data")  # the step streams the codes: huge pages (runtime.kernels.huge_pages)
            kw = cpu_step.KernelWeight(
                kind="i8" if self.bits == 8 else "i4", out_features=self.out_features, in_features=self.in_features,
                group=self.in_features if n == 1 else self.group_size, data=self.kernel_data,
                scales=self.kernel_scales, zeros=self.kernel_zeros, perm=self.in_perm,
                bias=None if self.bias is None else self.bias.float(),
                bf16_activations=self.compute_dtype == torch.bfloat16, int8_activations=self.act_quant,
            )  # fmt: skip
            self.__dict__["_kernel_weight"] = kw
        return kw

    def reference_forward(self, x: Tensor) -> Tensor:
        if self.act_quant:
            y = self.w8a8_reference(x, self.dense_weight if self.path == "dense" else self.centered_codes())
        else:
            w = self.dense_weight if self.path == "dense" else self.qweight().dequantize(torch.float32)
            y = F.linear(x.float(), w)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def centered_codes(self) -> Tensor:
        """codes - zeros [out, in] in float32 (integer-valued for integer zero points): the weight before its
        scales."""
        return self.codes_now().to(self.scales.device).float() - self.zeros.float()[:, self.group_index()]

    def w8a8_reference(self, x: Tensor, centered: Tensor) -> Tensor:
        """W8A8 without the bias, in float32: per token int8 activations q, scale s; per group g the exact sum
        of q * (code - zero) (exact_dots), times the group's scales, added group after group, times s. The
        cpu_w8a8 path's arithmetic (quantize.kernels.cpu.w8a8_mm) with float matmuls: equal bit for bit."""
        q, s = quantize_activations_per_token(x)
        q = q.float()
        acc = None
        for group in range(self.scales.shape[1]):
            if self.g_idx is None:  # consecutive columns (the last group may be short)
                cols = slice(group * self.group_size, (group + 1) * self.group_size)
                qg, wg = q[..., cols], centered[:, cols]
            else:
                cols = (self.g_idx == group).nonzero().squeeze(1)
                qg, wg = q.index_select(-1, cols), centered.index_select(1, cols)
            part = exact_dots(qg, wg).float() * self.scales[:, group].float()
            acc = part if acc is None else acc + part
        return acc * s

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group_size={self.group_size}, "
            f"act_order={self.g_idx is not None}, w8a8={self.act_quant}, path={self.path}"
        )


_SAID: set[str] = set()


def say_slow_path(layer: QuantLinear) -> None:
    """One line per process and reason when the automatic choice is the slow reference path."""
    if layer.bits <= 4 and layer.compute_dtype == torch.float32:
        why = (
            f"{layer.bits}-bit layers at fp32 compute run the reference path (dequantize, then matmul: ~15x slower "
            "decoding): the int4 kernel takes bf16 activations. Load with --dtype bf16 (the default for quantized "
            "checkpoints, --dtype auto) to use it"
        )
    else:
        why = f"{layer.extra_repr()}: no fast kernel fits this layer here; it runs the reference path (slow)"
    if why not in _SAID:
        _SAID.add(why)
        print(f"[qspec] {why}", file=sys.stderr)


def exact_dots(q: Tensor, w: Tensor) -> Tensor:
    """q [..., K] @ w [N, K]^T for integer-valued float32 operands as in W8A8 (|q| <= 127, |w| <= 255): the
    exact integer sums an int32 matmul gives, in float32 when they fit below 2**24 in one matmul (symmetric
    int8, |w| <= 128: up to 1032 columns), else from float32 matmuls over column blocks that each stay below
    2**24, added in float64 (exact for integers; still the right sums, rounded, for a non-integer zero point).
    .float() of the result rounds as the int32 sums' .float() does."""
    k = q.shape[-1]
    w_max = float(w.abs().amax()) if w.numel() else 0.0
    cols = max(1, int((EXACT_SUM - 1) // (127 * w_max))) if w_max else max(k, 1)
    if k <= cols:
        return F.linear(q, w)
    out = None
    for a in range(0, k, cols):
        part = F.linear(q[..., a : a + cols], w[:, a : a + cols]).double()
        out = part if out is None else out + part
    return out


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at a dotted path (e.g. 'layers.3.mlp.down_proj')."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quant_linear(qweight: QuantizedWeight, act_quant: bool, like: nn.Module) -> QuantLinear:
    """A QuantLinear on the device of the layer it replaces, pinned to the exact dequantize-then-matmul
    reference path: calibration and quality measurements see the quantization error alone. Callers that
    want speed afterwards pick a fast path (``layer.set_path(...)``, or ``layer.auto = True``)."""
    ref = like.weight
    return QuantLinear(qweight, act_quant=act_quant, compute_dtype=ref.dtype, path="reference").to(ref.device)
