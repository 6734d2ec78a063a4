"""Floating-point weight formats: FP8 (e4m3) and emulated FP4 (e2m1 with block scales), and FPLinear, a
sibling of QuantLinear with the same ``forward(x)`` contract.

Formats (``FloatWeight.fmt``):
  e4m3   FP8 e4m3fn codes (torch.float8_e4m3fn, max 448) with fp32 scales, per output channel (block=0) or per
         square block of block x block weights (DeepSeek-V3 style 128 x 128). W = code * scale.
  mxfp4  OCP MX FP4: e2m1 codes in blocks of 32 input columns, each block sharing a power-of-two scale stored
         as an e8m0 byte (exponent + 127), chosen as 2**(floor(log2(amax)) - 2) per the MX spec.
  nvfp4  NVIDIA FP4: e2m1 codes in blocks of 16 with an e4m3 block scale, times one fp32 per-tensor scale
         (amax / (448 * 6)), so the block scales use e4m3's range.
FP4 is EMULATED (APPROXIMATE row): codes are kept as 4-bit integers and dequantized; no FP4 matmul runs here.

FPLinear paths:
  reference  dequantize to fp32, matmul in fp32 (what the others are tested against; quality measurements)
  dense      the reference math on a weight dequantized once and kept (fp32): bit-identical, fast to evaluate
  dequant    dequantize to the input's dtype each forward and matmul in that dtype (bf16 activations on CPU)
  cpu        e4m3 weights through qspec's CPU step kernels (runtime.kernels.cpu_step), read as fp16 bits in
             registers: the reference math up to summation order, at fp32 or bf16 activations; the step reads its
             layout in place (a second copy of the codes, kernel-ordered, beside the checkpoint's); from
             cpu_step.PREFILL_MIN_ROWS rows the prefill GEMM (QuantLinear's "cpu" path: APPROXIMATE, as bf16's
             own prefill; QSPEC_PREFILL_GEMM=0 keeps the exact kernels)
  scaled_mm  W8A8-FP8 (act_quant, per-channel e4m3): ``torch._scaled_mm`` on fp8 activations and weights with
             row-wise scales (per token x per channel), bf16 output. Runs on CUDA GPUs with FP8 (sm >= 89)
             and, slowly, on CPU; ``scaled_mm_supported`` says where. A GPU timing harness calls
             ``fp8_matmul`` directly.
act_quant=True is W8A8-FP8: activations are quantized per token (scale = amax / 448) to e4m3 before the
matmul, on every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.kernels import cpu_step
from runtime.kernels.huge_pages import place_member

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# magnitudes of e2m1 codes 0..7 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit); codes 8..15 negate them
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FORMATS = ("e4m3", "mxfp4", "nvfp4")
FP4_BLOCK = {"mxfp4": 32, "nvfp4": 16}
PATHS = ("reference", "dense", "dequant", "scaled_mm", "cpu")


# ---- element formats ----------------------------------------------------------------------------------


def round_e4m3(x: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (torch's cast rounds RNE)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def round_e2m1(x: Tensor) -> Tensor:
    """fp32 -> e2m1 codes (uint8 0..15, bit 3 = sign), round to nearest even, saturating at +-6.

    The e2m1 grid has spacing 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; within each range the grid points
    are consecutive codes, so rounding x / spacing half-to-even picks the code with an even mantissa at a tie.
    """
    a = x.float().abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.round(a / step) * step  # torch.round is half-to-even
    table = torch.tensor(E2M1_VALUES, device=x.device)
    mag = torch.searchsorted(table, q).to(torch.uint8)
    return mag | ((x < 0) & (mag > 0)).to(torch.uint8) << 3


def decode_e2m1(codes: Tensor) -> Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def quantize_activations_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token e4m3: x ~= q * s with s = amax(|x|) / 448 per row (fp32 [..., 1])."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return round_e4m3(x.float() / scale), scale


# ---- weights ------------------------------------------------------------------------------------------


def expand_blocks(s: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    """Per-block values [ceil(rows/br), ceil(cols/bc)] -> per-element [rows, cols]."""
    return s.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def block_absmax(w: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """max |w| over each block_rows x block_cols block (edges padded with zeros)."""
    out, inp = w.shape
    pr, pc = -out % block_rows, -inp % block_cols
    a = F.pad(w.abs(), (0, pc, 0, pr))
    return a.view(a.shape[0] // block_rows, block_rows, a.shape[1] // block_cols, block_cols).amax((1, 3))


@dataclass
class FloatWeight:
    codes: Tensor  # [out, in]: float8_e4m3fn (e4m3) or uint8 e2m1 codes (mxfp4, nvfp4)
    scales: Tensor  # e4m3: fp32 [out, 1] (per-channel) or [out/b, in/b] (blocks); mxfp4: uint8 e8m0 [out, in/32];
    # nvfp4: float8_e4m3fn [out, in/16]
    fmt: str
    block: int = 0  # e4m3: 0 = per-channel, else the block side; fp4: elements per block (32 / 16)
    global_scale: float = 1.0  # nvfp4's per-tensor fp32 scale
    bias: Tensor | None = None

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown float format {self.fmt!r}; choose from {FORMATS}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def scale_matrix(self) -> Tensor:
        """fp32 [out, in]: the scale multiplying each element's code value."""
        out, inp = self.codes.shape
        if self.fmt == "e4m3":
            if self.block == 0:
                return self.scales.float().expand(out, inp)
            return expand_blocks(self.scales.float(), out, inp, self.block, self.block)
        if self.fmt == "mxfp4":
            s = torch.exp2(self.scales.float() - 127)
        else:
            s = self.scales.float() * self.global_scale
        return expand_blocks(s, out, inp, 1, self.block)

    def values(self) -> Tensor:
        """fp32 [out, in]: the element values before scaling."""
        return self.codes.float() if self.fmt == "e4m3" else decode_e2m1(self.codes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.values() * self.scale_matrix()).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of a packed checkpoint: 1 byte per e4m3 code, 4 bits per e2m1 code, scales as stored."""
        bits = 8 if self.fmt == "e4m3" else 4
        return self.codes.numel() * bits // 8 + self.scales.numel() * self.scales.element_size()


def fp8_scales(weight: Tensor, block: int = 0) -> Tensor:
    """amax / 448 per output channel [out, 1] (block=0) or per block x block block [out/b, in/b], fp32."""
    w = weight.detach().float()
    amax = w.abs().amax(1, keepdim=True) if block == 0 else block_absmax(w, block, block)
    return (amax / E4M3_MAX).clamp(min=1e-12)


def quantize_fp8(
    weight: Tensor, block: int = 0, bias: Tensor | None = None, scales: Tensor | None = None
) -> FloatWeight:
    """e4m3 by round to nearest at ``scales`` (default fp8_scales: amax / 448 per output channel (block=0) or
    per block x block block)."""
    w = weight.detach().float()
    scales = fp8_scales(w, block) if scales is None else scales
    full = scales.expand_as(w) if block == 0 else expand_blocks(scales, *w.shape, block, block)
    codes = round_e4m3(w / full)
    return FloatWeight(codes, scales, "e4m3", block, bias=None if bias is None else bias.detach().float())


def quantize_fp4(weight: Tensor, fmt: str, bias: Tensor | None = None) -> FloatWeight:
    """Emulated FP4 (mxfp4 / nvfp4) of a weight [out, in] with blocks along the input dim."""
    if fmt not in FP4_BLOCK:
        raise ValueError(f"unknown FP4 format {fmt!r}; choose from {sorted(FP4_BLOCK)}")
    w = weight.detach().float()
    block = FP4_BLOCK[fmt]
    amax = block_absmax(w, 1, block)  # [out, in/block]
    global_scale = 1.0
    if fmt == "mxfp4":
        # shared exponent floor(log2(amax)) - emax(e2m1) = -2; elements beyond 6 * scale saturate
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-38))) - 2, torch.full_like(amax, -127))
        exp = exp.clamp(-127, 127)
        scales = (exp + 127).to(torch.uint8)
        block_scale = torch.exp2(exp)
    else:
        tensor_amax = float(w.abs().max())
        global_scale = tensor_amax / (E4M3_MAX * E2M1_MAX) if tensor_amax > 0 else 1.0
        scales = round_e4m3(amax / E2M1_MAX / global_scale)
        block_scale = scales.float() * global_scale
    divisor = expand_blocks(torch.where(block_scale > 0, block_scale, 1.0), *w.shape, 1, block)
    codes = round_e2m1(w / divisor)
    return FloatWeight(codes, scales, fmt, block, global_scale, None if bias is None else bias.detach().float())


# ---- the layer ----------------------------------------------------------------------------------------


def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm with fp8 inputs: CUDA GPUs of compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul(x: Tensor, w_codes: Tensor, w_scale: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """W8A8-FP8 matmul: x [T, in] (any float dtype) quantized per token to e4m3, times e4m3 weights [out, in]
    with per-channel scales w_scale [out, 1], through torch._scaled_mm (row-wise scaling). The GPU hook."""
    xq, xs = quantize_activations_fp8(x)
    return torch._scaled_mm(xq, w_codes.t(), scale_a=xs, scale_b=w_scale.float().t(), out_dtype=out_dtype)


class FPLinear(nn.Module):
    """nn.Linear stand-in holding a FloatWeight (see the module docstring for formats and paths)."""

    def __init__(
        self, fw: FloatWeight, act_quant: bool = False, compute_dtype: torch.dtype = torch.float32, path: str = "auto"
    ):
        super().__init__()
        if act_quant and fw.fmt != "e4m3":
            raise ValueError("W8A8-FP8 (act_quant) needs e4m3 weights")
        if path not in PATHS + ("auto",):
            raise ValueError(f"unknown FPLinear path {path!r}; choose from {PATHS + ('auto',)}")
        self.in_features, self.out_features = fw.in_features, fw.out_features
        self.fmt, self.block, self.global_scale, self.act_quant = fw.fmt, fw.block, fw.global_scale, act_quant
        self.compute_dtype = compute_dtype
        self.register_buffer("codes", fw.codes.contiguous())
        self.register_buffer("scales", fw.scales.contiguous())
        self.register_buffer("bias", None if fw.bias is None else fw.bias.to(compute_dtype))
        self.auto = path == "auto"
        self.path = "reference"
        if path != "auto":
            self.set_path(path)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) / set_dtype move the codes and scales but must not re-round them: keep their dtypes
        saved = {n: self._buffers[n] for n in ("codes", "scales")}
        super()._apply(fn, recurse)
        for n, t in saved.items():
            if self._buffers[n].dtype != t.dtype:
                self._buffers[n] = t.to(self._buffers[n].device)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        if self.path == "cpu":  # rebuilt from the codes: fp32 tables, and the new compute dtype
            self.set_path("cpu" if self.unsupported_reason("cpu") is None else "reference")
        return self

    def fweight(self) -> FloatWeight:
        return FloatWeight(self.codes, self.scales, self.fmt, self.block, self.global_scale, self.bias)

    @property
    def weight(self) -> Tensor:
        return self.fweight().dequantize(self.compute_dtype)

    def weight_bytes(self) -> int:
        return self.fweight().weight_bytes()

    def unsupported_reason(self, path: str) -> str | None:
        if path == "scaled_mm" and not (self.act_quant and self.fmt == "e4m3" and self.block == 0):
            return "scaled_mm runs W8A8-FP8 with per-channel e4m3 weights (act_quant=True, block=0)"
        if path == "cpu":
            if self.fmt != "e4m3" or self.act_quant:
                return "the cpu kernels run weight-only e4m3 (FP4 is emulated; W8A8-FP8 runs scaled_mm)"
            if not cpu_step.available():
                return "qspec's CPU step is not built here (runtime.kernels.cpu_step)"
            if self.codes.device.type != "cpu":
                return "the cpu kernels run on CPU tensors"
        return None

    def set_path(self, path: str) -> FPLinear:
        if path not in PATHS:
            raise ValueError(f"unknown FPLinear path {path!r}; choose from {PATHS}")
        reason = self.unsupported_reason(path)
        if reason:
            raise ValueError(f"path {path!r} cannot run this layer: {reason}")
        for name in ("dense_weight", "kernel_data", "kernel_scales", "kernel_zeros"):
            self._buffers.pop(name, None)
        cpu_step.drop_kernel_weight(self)
        if path == "dense":  # not persistent: never saved
            self.register_buffer("dense_weight", self.fweight().dequantize(torch.float32), persistent=False)
        if path == "cpu":  # scales per (row, column group); x256: the kernel decodes e4m3 as fp16 bits (value / 256)
            n, k = self.out_features, self.in_features
            group = k if self.block == 0 else self.block
            per_row = self.scales.float() if self.block == 0 else self.scales.float().repeat_interleave(group, 0)[:n]
            self.register_buffer("kernel_data", cpu_step.pack_fp8(self.codes), persistent=False)
            self.register_buffer("kernel_scales", cpu_step.group_table(per_row * 256, n), persistent=False)
            zeros = torch.zeros_like(self.kernel_scales, dtype=torch.int8)  # int8: fewer bytes streamed (ZeroTable)
            self.register_buffer("kernel_zeros", zeros, persistent=False)
        self.path = path
        return self

    def cpu_kernel_weight(self) -> cpu_step.KernelWeight | None:
        """This layer in the CPU step's layout (runtime.kernels.cpu_step's contract), or None on another path.
        An automatic layer moves to the "cpu" path here when it can."""
        if self.path != "cpu" and self.auto and self.unsupported_reason("cpu") is None:
            self.set_path("cpu")
            self.auto = False
        if self.path != "cpu":
            return None
        kw = self.__dict__.get("_kernel_weight")
        if kw is None:
            group = self.in_features if self.block == 0 else self.block
            place_member(self, "kernel_data")  # the step streams the codes: huge pages (runtime.kernels.huge_pages)
            kw = cpu_step.KernelWeight(
                kind="fp8", out_features=self.out_features, in_features=self.in_features, group=group,
                data=self.kernel_data, scales=self.kernel_scales, zeros=self.kernel_zeros,
                bias=None if self.bias is None else self.bias.float(),
                bf16_activations=self.compute_dtype == torch.bfloat16,
            )  # fmt: skip
            self.__dict__["_kernel_weight"] = kw
        return kw

    def auto_path(self, device: torch.device) -> str:
        if self.unsupported_reason("scaled_mm") is None and scaled_mm_supported(device):
            return "scaled_mm"
        if device.type == "cpu" and self.unsupported_reason("cpu") is None:
            return "cpu"
        return "dequant" if self.compute_dtype != torch.float32 else "reference"

    def forward(self, x: Tensor) -> Tensor:
        if self.auto:
            self.set_path(self.auto_path(x.device))
            self.auto = False
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.path == "cpu":
            return cpu_step.quantized_linear(self.cpu_kernel_weight(), x2).to(x.dtype).reshape(*shape[:-1], -1)
        if self.path == "scaled_mm":
            y = fp8_matmul(x2, self.codes, self.scales)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        else:
            dtype = x.dtype if self.path == "dequant" else torch.float32
            w = self.dense_weight if self.path == "dense" else self.fweight().dequantize(dtype)
            if self.act_quant:
                q, s = quantize_activations_fp8(x2)
                y = F.linear(q.to(dtype), w) * s.to(dtype)
            else:
                y = F.linear(x2.to(dtype), w)
            if self.bias is not None:
                y = y + self.bias.to(dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scale = "per-channel" if self.fmt == "e4m3" and self.block == 0 else f"block {self.block}"
        return (
            f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, {scale}, w8a8={self.act_quant}, "
            f"path={self.path}"
        )
