"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a weight column by column, each time spreading the rounding error over the columns
not yet quantized with the inverse Hessian of the layer-wise loss ||WX - ŴX||², H = 2 X Xᵀ / N.

Behaviour of the reference implementation, kept: dead inputs (H_ii = 0) are zeroed; damping is a fraction of
the mean diagonal, retried higher if the Cholesky fails; the error is propagated lazily in blocks of 128
columns; act-order (desc_act) visits columns by decreasing H_ii, with groups either in that order (g_idx) or
fixed in the natural order before any update (static groups); an optional MSE search shrinks each group's
range. Differences, both making the grid follow the paper's "updated weights" more closely: a group's
parameters always see every update made so far (the reference misses the updates from earlier columns of the
same 128-column block when a group starts mid-block, e.g. group size 32), and a group that straddles a block
boundary sees the pending update of its columns beyond the block.

    python -m quantize.gptq --model smollm2-135m --bits 4 --group-size 64 --act-order --out DIR
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from quantize import cli
from quantize.calibration import LayerAlgorithm, Stage
from quantize.config import QuantConfig
from quantize.grid import find_params, group_params, quantize_codes
from quantize.qlinear import QuantizedWeight, QuantLinear, quant_linear, set_module


class GPTQError(RuntimeError):
    pass


@dataclass
class GPTQConfig:
    act_order: bool = False  # desc_act: columns by decreasing Hessian diagonal
    static_groups: bool = False  # with act_order: groups fixed in natural column order before any update
    damp_percent: float = 0.01  # damping = damp_percent * mean(diag(H))
    damp_increment: float = 0.0025  # added to damp_percent after each failed Cholesky
    block_size: int = 128  # columns per lazy-update block
    mse: bool = False  # MSE search of each group's range (clipping); the reference's Quantizer(mse=True)
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    mse_norm: float = 2.4
    first_token_weight: float = 1.0  # weight of each window's first token (the attention sink) in H; 0 leaves it out

    def __post_init__(self):
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.first_token_weight < 0:
            raise ValueError(f"first_token_weight must be >= 0, got {self.first_token_weight}")


def accumulate_hessian(inputs: list[Tensor], first_token_weight: float = 1.0) -> Tensor:
    """H = 2/N Σ w_t x xᵀ over all N input rows (tokens) of a linear layer, N = Σ w_t: [in, in] float32.

    inputs: [B, T, in] per calibration batch. w_t = 1, except each window's first token (the attention sink,
    which carries the massive activations) weighs ``first_token_weight`` (0: left out)."""
    in_features = inputs[0].shape[-1]
    H = torch.zeros(in_features, in_features, dtype=torch.float32, device=inputs[0].device)
    n = 0
    for x in inputs:
        if first_token_weight != 1.0:
            if x.dim() != 3 or x.shape[1] < 2:
                raise GPTQError(f"first_token_weight needs [batch, tokens >= 2, in] inputs, got {tuple(x.shape)}")
            sink = x[:, 0].reshape(-1, in_features).float()
            H.addmm_(sink.t(), sink, alpha=first_token_weight)
            n += first_token_weight * sink.shape[0]
            x = x[:, 1:]
        x = x.reshape(-1, in_features).float()
        H.addmm_(x.t(), x)
        n += x.shape[0]
    return H.mul_(2.0 / n)


def inverse_cholesky(H: Tensor, damp_percent: float, damp_increment: float) -> tuple[Tensor, float]:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp * mean(diag H); damp is raised until it works."""
    mean_diag = H.diagonal().mean()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    damp = damp_percent
    while damp < 1.0:
        L, info = torch.linalg.cholesky_ex(H + damp * mean_diag * eye)
        if info == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0:
                return U, damp
        damp += damp_increment
    raise GPTQError(f"Hessian is not positive definite even with damping {damp:.4f} of its mean diagonal")


@dataclass
class GPTQResult:
    qweight: object  # the grid's weight: QuantizedWeight (IntGrid), quantize.fplinear.FloatWeight (FP8 grid)
    damp: float  # damping actually used
    loss: float  # Σ (w - ŵ)² / [H⁻¹]_jj² / 2, the paper's per-column objective summed
    seconds: float


class ElementGrid:
    """What the GPTQ solver rounds each column onto: the integer grid (IntGrid) or a float one (quantize.fp8's
    FP8Grid). The solver owns the OBS updates; the grid owns parameters, rounding and the resulting weight.

    Lifecycle per weight: ``start(W)`` once on the natural-order weight (after dead columns are zeroed, before
    any update), then ``round`` per visited column (``fit_group`` first when the grid is not fixed and a group
    begins), then ``build``."""

    group_size: int  # columns per parameter group (the input width when one group spans the row)

    def start(self, W: Tensor) -> bool:
        """Fit whatever can be fixed before any update from W [out, in]; True if every group's parameters are
        fixed now (then a column's group is its original column // group_size)."""
        raise NotImplementedError

    def fit_group(self, g: int, cols: Tensor) -> None:
        """Dynamic groups only: fit group g from its updated columns [out, <= group_size]."""
        raise NotImplementedError

    def round(self, w: Tensor, g: int) -> tuple[Tensor, Tensor]:
        """One column w [out] in group g -> (codes as float32 [out], dequantized values [out])."""
        raise NotImplementedError

    def build(self, codes: Tensor, g_idx: Tensor | None, bias: Tensor | None):
        """codes [out, in] in natural column order -> the quantized weight."""
        raise NotImplementedError

    def module(self, qweight, act_quant: bool, linear: nn.Module) -> nn.Module:
        """The layer replacing ``linear`` that holds ``qweight``."""
        raise NotImplementedError


@dataclass
class IntGrid(ElementGrid):
    """The uniform integer grid of quantize.grid (per-channel or groups, optional MSE range search)."""

    bits: int
    sym: bool
    group_size: int
    static_groups: bool = False
    mse: bool = False
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    mse_norm: float = 2.4

    @classmethod
    def from_config(cls, bits: int, sym: bool, group_size: int, cfg: GPTQConfig) -> IntGrid:
        search = dict(mse=cfg.mse, mse_grid=cfg.mse_grid, mse_max_shrink=cfg.mse_max_shrink, mse_norm=cfg.mse_norm)
        return cls(bits, sym, group_size, cfg.static_groups, **search)

    def _search(self) -> dict:
        return dict(mse=self.mse, grid=self.mse_grid, max_shrink=self.mse_max_shrink, norm=self.mse_norm)

    def start(self, W: Tensor) -> bool:
        out_features, n = W.shape
        n_groups = -(-n // self.group_size)
        # per-channel (one group, as the reference does) and static groups are fixed before any update
        fixed = self.group_size >= n or self.static_groups
        if fixed:
            self.scales, self.zeros = group_params(W, self.bits, self.sym, self.group_size, **self._search())
        else:
            self.scales, self.zeros = torch.zeros(out_features, n_groups), torch.zeros(out_features, n_groups)
        return fixed

    def fit_group(self, g: int, cols: Tensor) -> None:
        self.scales[:, g], self.zeros[:, g] = find_params(cols, self.bits, self.sym, **self._search())

    def round(self, w: Tensor, g: int) -> tuple[Tensor, Tensor]:
        s, z = self.scales[:, g], self.zeros[:, g]
        q = quantize_codes(w, s, z, 2**self.bits - 1)
        return q, s * (q - z)

    def build(self, codes: Tensor, g_idx: Tensor | None, bias: Tensor | None) -> QuantizedWeight:
        return QuantizedWeight(
            codes=codes.to(torch.uint8),
            scales=self.scales,
            zeros=self.zeros,
            bits=self.bits,
            group_size=self.group_size,
            g_idx=g_idx,
            bias=bias,
        )

    def module(self, qweight: QuantizedWeight, act_quant: bool, linear: nn.Module) -> nn.Module:
        return quant_linear(qweight, act_quant, linear)


# (stage, its Hessian) -> the grid its linear is rounded onto
GridFactory = Callable[[Stage, Tensor], ElementGrid]


@torch.no_grad()
def gptq_quantize(
    weight: Tensor, H: Tensor, bits: int, sym: bool, group_size: int, cfg: GPTQConfig, bias: Tensor | None = None
) -> GPTQResult:
    """GPTQ of one weight [out, in] onto the integer grid given its Hessian H [in, in]; group_size == in is
    per-channel."""
    return gptq_on_grid(weight, H, IntGrid.from_config(bits, sym, group_size, cfg), cfg, bias)


@torch.no_grad()
def gptq_on_grid(
    weight: Tensor, H: Tensor, grid: ElementGrid, cfg: GPTQConfig, bias: Tensor | None = None
) -> GPTQResult:
    """THE GPTQ solver: weight [out, in], Hessian H [in, in], columns rounded onto ``grid``."""
    start = time.perf_counter()
    W = weight.detach().float().clone()
    H = H.float().clone()
    n = W.shape[1]

    dead = H.diagonal() == 0  # inputs that are always zero: their weights cannot matter, zero them
    H[dead, dead] = 1
    W[:, dead] = 0

    fixed = grid.start(W)
    group_size = grid.group_size

    perm = torch.argsort(H.diagonal(), descending=True) if cfg.act_order else torch.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv, damp = inverse_cholesky(H, cfg.damp_percent, cfg.damp_increment)

    # Group of each visited position j (permuted order): static/per-channel groups follow the original column,
    # dynamic groups are consecutive runs of group_size visited columns (g_idx records them under act-order).
    visit_group = perm // group_size if fixed else torch.arange(n) // group_size
    codes = torch.zeros_like(W)
    loss = torch.zeros((), dtype=torch.float64)
    for i1 in range(0, n, cfg.block_size):
        i2 = min(i1 + cfg.block_size, n)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = int(visit_group[j])
            if not fixed and j % group_size == 0:
                # The group's grid from its weights with every update so far: in-block columns from W1, the
                # columns past the block with this block's pending update applied.
                end = min(j + group_size, n)
                cols = W1[:, i : i + (end - j)]
                if end > i2:
                    pending = W[:, i2:end] - Err1[:, :i] @ Hinv[i1 : i1 + i, i2:end]
                    cols = torch.cat([cols, pending], 1)
                grid.fit_group(g, cols)
            w = W1[:, i]
            d = Hinv1[i, i]
            q, w_hat = grid.round(w, g)
            codes[:, j] = q
            err = (w - w_hat) / d
            loss += (err.double() ** 2).sum() / 2
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    invperm = torch.argsort(perm)
    g_idx = None
    if cfg.act_order and not fixed:
        g_idx = (torch.arange(n) // group_size)[invperm].to(torch.int32)
    qweight = grid.build(codes[:, invperm], g_idx, None if bias is None else bias.detach().float())
    return GPTQResult(qweight, damp, float(loss), time.perf_counter() - start)


def layer_error(weight: Tensor, qweight, H: Tensor) -> float:
    """Σ_tokens ||(W - Ŵ) x||² / N * 2 = tr(ΔW H ΔWᵀ) for H = 2/N Σ x xᵀ (the undamped Hessian); qweight is
    any weight with ``dequantize(dtype)`` (QuantizedWeight, FloatWeight)."""
    delta = weight.float() - qweight.dequantize(torch.float32)
    return float(((delta @ H) * delta).sum())


class GPTQ(LayerAlgorithm):
    """GPTQ inside the calibration pass: one Hessian per (fused) linear from its true-sequential inputs, the
    columns rounded onto the grid ``grid_for(stage, H)`` gives (default: qcfg's integer grid)."""

    def __init__(self, qcfg: QuantConfig, gcfg: GPTQConfig, log=None, grid_for: GridFactory | None = None):
        self.qcfg, self.gcfg, self.log = qcfg, gcfg, log
        self.grid_for = grid_for or self.int_grid
        self.stats: list[dict] = []
        self.any_g_idx = False

    def int_grid(self, stage: Stage, H: Tensor) -> IntGrid:
        group_size = self.qcfg.group_size_for(stage.linear.in_features, stage.full_name)
        return IntGrid.from_config(self.qcfg.bits, self.qcfg.sym, group_size, self.gcfg)

    def quantize_stage(self, stage: Stage) -> None:
        if not self.qcfg.quantizes(stage.name):
            return

        linear = stage.linear
        H = accumulate_hessian(stage.inputs, self.gcfg.first_token_weight)
        grid = self.grid_for(stage, H)
        res = gptq_on_grid(linear.weight, H, grid, self.gcfg, linear.bias)
        err = layer_error(linear.weight, res.qweight, H)
        self.any_g_idx |= getattr(res.qweight, "g_idx", None) is not None
        self.stats.append(
            {
                "layer": stage.full_name,
                "damp": res.damp,
                "gptq_loss": res.loss,
                "hessian_error": err,
                "seconds": round(res.seconds, 3),
            }
        )
        if self.log is not None and res.damp > self.gcfg.damp_percent:
            self.log(f"{stage.full_name}: Cholesky needed damping {res.damp:.4f}")
        set_module(stage.owner, stage.path, grid.module(res.qweight, self.qcfg.act_quant, linear))

    def restore_layer(self, layer_idx: int, layer, stats: list[dict]) -> None:
        self.stats.extend(stats)
        self.any_g_idx |= any(m.g_idx is not None for m in layer.modules() if isinstance(m, QuantLinear))

    def record(self) -> dict:
        # desc_act in the checkpoint sense: the columns carry a g_idx (act-order without static groups, with
        # groups: a per-channel layer has one group per row, so its visiting order leaves no g_idx behind)
        desc_act = self.any_g_idx
        return {"quant_method": "gptq", "desc_act": desc_act, **asdict(self.gcfg), "true_sequential": True}


def add_gptq_args(ap, block_flag: str = "--block-size") -> None:
    """block_flag: the lazy-update block's option (quantize.fp8 uses --block-size for its scale blocks)."""
    g = ap.add_argument_group("GPTQ")
    g.add_argument("--act-order", action="store_true", help="desc_act: quantize columns by decreasing H_ii")
    g.add_argument("--static-groups", action="store_true", help="with --act-order: groups fixed before updates")
    g.add_argument("--damp-percent", type=float, default=0.01, help="damping as a fraction of mean diag(H)")
    g.add_argument(block_flag, dest="gptq_block_size", type=int, default=128, help="columns per lazy-update block")
    g.add_argument("--mse", action="store_true", help="MSE search of each group's range (clipping)")
    g.add_argument(
        "--first-token-weight",
        type=float,
        default=1.0,
        help="weight of each calibration window's first token (the attention sink) in the Hessian; 0 leaves it out",
    )


def gptq_config(ap, args) -> GPTQConfig:
    try:
        return GPTQConfig(
            act_order=args.act_order,
            static_groups=args.static_groups,
            damp_percent=args.damp_percent,
            block_size=args.gptq_block_size,
            mse=args.mse,
            first_token_weight=args.first_token_weight,
        )
    except ValueError as err:
        ap.error(str(err))


def main(argv: list[str] | None = None) -> None:

    ap = cli.parser("quantize.gptq", __doc__)
    add_gptq_args(ap)
    cli.add_resume_arg(ap)
    args = ap.parse_args(argv)
    qcfg = cli.quant_config(ap, args)
    gcfg = gptq_config(ap, args)
    model, tokenizer, path, source = cli.load(ap, args, qcfg)
    store = cli.layer_store(args, "quantize.gptq")  # after every argument check: a bad one leaves nothing behind
    tokens = cli.calibration_tokens(ap, args, tokenizer)
    algo = GPTQ(qcfg, gcfg, log=cli.log)
    seconds = cli.run_calibration(args, model, tokens, algo, qcfg, source, store, "gptq")
    qcfg.extra.update(algo.record(), calib=args.calib, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    stats = {"quantize_seconds": round(seconds, 1), "layers": algo.stats}
    cli.finish(args, model, tokenizer, path, qcfg, "quantize.gptq", stats, argv, store=store)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
