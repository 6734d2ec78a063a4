"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): protect the weights that meet large
activations by scaling input channels up before rounding and folding the inverse scale into the operation
that produces those inputs, so the float model is unchanged and only the rounding changes.

Per decoder layer, on the float layer, in forward order (scaling groups of the reference implementation):
  input_layernorm -> qkv_proj (scored on the attention output), v rows of qkv_proj -> o_proj (only without
  GQA, as in the reference), post_attention_layernorm -> gate_up_proj (scored on the MLP output),
  up rows of gate_up_proj -> down_proj (scored on its own output).
For each: s = mean|x|^α (or, duo scaling, mean|x|^α / mean|ŵ|^(1-α) with ŵ = |w| / group max), normalised by
sqrt(max s · min s), α over a grid in [0, 1) that minimises the block-output error of the fake-quantized
block; then a per-(row, group) clipping search of max|w| on the scaled weights (skipping q and k rows, as the
reference does). Finally the weights are quantized by RTN or, with --gptq, by GPTQ with Hessians of the
scaled inputs, in the same calibration pass.

    python -m quantize.awq --model smollm2-135m --bits 4 --group-size 64 --out DIR [--gptq --act-order]
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from quantize import cli
from quantize.calibration import LayerAlgorithm, Stage, run_layer
from quantize.config import QuantConfig
from quantize.gptq import GPTQ, add_gptq_args, gptq_config
from quantize.grid import expand_groups, fake_quantize, find_params, group_bounds
from quantize.qlinear import quant_linear, set_module
from quantize.rotation import HadamardMLP, RotatedRMSNorm
from quantize.rtn_weight import quantize_weight


@dataclass
class AWQConfig:
    duo_scaling: bool = True  # divide by mean|ŵ|^(1-α) too (AutoAWQ's default)
    grid: int = 20  # α in {0, 1/grid, ..., (grid-1)/grid}
    search_windows: int = 16  # calibration windows the α search and clip search score on (all feed the stats)
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5  # try max|w| * (1 - k/clip_grid) down to this fraction removed
    clip_tokens: int = 512  # evenly spaced tokens the clip search scores on

    def __post_init__(self):
        if self.grid < 1 or self.clip_grid < 1:
            raise ValueError("AWQ grids need at least one point")
        if self.search_windows < 1:
            raise ValueError(f"search_windows must be >= 1, got {self.search_windows}")


def weight_magnitude(w: Tensor, group_size: int) -> Tensor:
    """Mean over output rows of |w| normalised by its group's max |w|: [in]."""
    gmax = torch.stack([w[:, a:b].abs().amax(1) for a, b in group_bounds(w.shape[1], group_size)], 1)
    return (w.abs() / expand_groups(gmax, w.shape[1], group_size).clamp(min=1e-12)).mean(0)


def scale_candidates(x_mean: Tensor, w_mean: Tensor | None, ratio: float) -> Tensor:
    s = x_mean.pow(ratio) if w_mean is None else x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(
    stage: Stage, qcfg: QuantConfig, acfg: AWQConfig, group_size: int, n_batches: int
) -> tuple[Tensor, float, float]:
    """Best per-input-channel scale for stage.linear: (s [in], α, relative block error at the best α).

    The activation statistic uses every input; the block error is scored on the first n_batches batches."""
    linear = stage.linear
    in_features = linear.in_features
    x_mean = torch.zeros(in_features)
    n = 0
    for x in stage.inputs:
        x = x.reshape(-1, in_features).float()
        x_mean += x.abs().sum(0)
        n += x.shape[0]
    x_mean /= n
    w_orig = linear.weight.detach().clone()
    w_mean = weight_magnitude(w_orig.float(), group_size) if acfg.duo_scaling else None
    batches = range(min(n_batches, len(stage.inputs)))
    reference = [stage.block(b, stage.inputs[b]) for b in batches]
    ref_power = sum(float(r.float().pow(2).mean()) for r in reference)
    best = (float("inf"), None, 0.0)
    try:
        for k in range(acfg.grid):
            ratio = k / acfg.grid
            s = scale_candidates(x_mean, w_mean, ratio)
            linear.weight.copy_(quantize_weight(w_orig.float() * s, qcfg, name=stage.full_name).dequantize() / s)
            loss = sum(
                float((stage.block(b, stage.inputs[b]) - reference[i]).float().pow(2).mean())
                for i, b in enumerate(batches)
            )
            if loss < best[0]:
                best = (loss, s, ratio)
    finally:
        linear.weight.copy_(w_orig)
    return best[1], best[2], best[0] / max(ref_power, 1e-30)


@torch.no_grad()
def search_clip(w: Tensor, x: Tensor, qcfg: QuantConfig, acfg: AWQConfig, group_size: int) -> Tensor:
    """Per-(row, group) clip bound of w [out, in] minimising the group-wise partial output error on
    tokens x [n, in]: [out, n_groups]."""
    out_features, in_features = w.shape
    n_groups = -(-in_features // group_size)
    pad = n_groups * group_size - in_features  # zero columns: 0 is on every grid, so they change nothing
    wg = torch.nn.functional.pad(w.float(), (0, pad)).view(out_features, n_groups, group_size)
    xg = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, n_groups, group_size)
    reference = torch.einsum("tgc,ogc->otg", xg, wg)
    org_max = wg.abs().amax(-1, keepdim=True)  # [out, G, 1]
    best_err = torch.full((out_features, n_groups), float("inf"))
    best_max = org_max.squeeze(-1).clone()
    for k in range(int(acfg.clip_max_shrink * acfg.clip_grid)):
        max_val = org_max * (1 - k / acfg.clip_grid)
        cur = torch.maximum(torch.minimum(wg, max_val), -max_val).reshape(-1, group_size)
        s, z = find_params(cur, qcfg.bits, qcfg.sym)
        q = fake_quantize(cur, s[:, None], z[:, None], qcfg.maxq).view(out_features, n_groups, group_size)
        err = (torch.einsum("tgc,ogc->otg", xg, q) - reference).pow(2).mean(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val.squeeze(-1), best_max)
    return best_max


class AWQ(LayerAlgorithm):
    """AWQ scaling + clipping on each float layer (prepare_layer), then RTN or GPTQ stage by stage."""

    def __init__(self, qcfg: QuantConfig, acfg: AWQConfig, gptq=None, batch_size: int = 8, log=None):
        self.qcfg, self.acfg, self.gptq, self.log = qcfg, acfg, gptq, log
        self.search_batches = max(1, -(-acfg.search_windows // batch_size))
        self.stats: list[dict] = []

    def prepare_layer(self, layer_idx, layer, xs, rope) -> None:
        # A float forward over the layer whose stage hook scales (and clips) each linear in turn; the hook
        # rescales the captured inputs in place so the rest of this forward sees the folded layer.
        run_layer(layer, xs, rope, lambda st: self.scale_and_clip(st, layer), layer_idx)

    def scale_and_clip(self, stage: Stage, layer: nn.Module) -> None:
        if stage.name not in self.qcfg.modules:
            return
        cfg = layer.self_attn
        prev = scale_producer(layer, stage.name)
        start = time.perf_counter()
        linear = stage.linear
        group_size = self.qcfg.group_size_for(linear.in_features, stage.full_name)
        entry = {"layer": stage.full_name}
        if prev is not None:
            s, ratio, rel_err = search_scale(stage, self.qcfg, self.acfg, group_size, self.search_batches)
            fold_scale(prev[0], prev[1], linear, s)
            for x in stage.inputs:
                x.div_(s.to(x.dtype))
            entry.update(alpha=ratio, block_rel_error=rel_err, scale_max=float(s.max()), scale_min=float(s.min()))
        if self.acfg.clip:
            # q and k rows are not clipped (the reference skips q_proj/k_proj: attention logits are sensitive)
            rows = slice(cfg.q_size + cfg.kv_size, None) if stage.name == "qkv_proj" else slice(None)
            x = torch.cat([t.reshape(-1, linear.in_features) for t in stage.inputs])
            x = x[:: max(1, x.shape[0] // self.acfg.clip_tokens)][: self.acfg.clip_tokens]
            w = linear.weight[rows]
            max_val = search_clip(w, x, self.qcfg, self.acfg, group_size)
            bound = expand_groups(max_val, linear.in_features, group_size)
            linear.weight[rows] = torch.maximum(torch.minimum(w, bound), -bound).to(w.dtype)
        entry["seconds"] = round(time.perf_counter() - start, 3)
        self.stats.append(entry)

    def quantize_stage(self, stage: Stage) -> None:
        if self.gptq is not None:
            self.gptq.quantize_stage(stage)
            return
        if not self.qcfg.quantizes(stage.name):
            return

        linear = stage.linear
        qw = quantize_weight(linear.weight, self.qcfg, linear.bias, name=stage.full_name)
        set_module(stage.owner, stage.path, quant_linear(qw, self.qcfg.act_quant, linear))

    # A kept layer's stats hold GPTQ's entries too, wrapped as {"gptq": entry}, so --resume restores both lists.
    def stats_mark(self):
        return len(self.stats), len(self.gptq.stats) if self.gptq is not None else 0

    def stats_since(self, mark) -> list[dict]:
        awq, gptq = mark
        return self.stats[awq:] + ([{"gptq": s} for s in self.gptq.stats[gptq:]] if self.gptq is not None else [])

    def restore_layer(self, layer_idx, layer, stats) -> None:
        self.stats.extend(s for s in stats if "gptq" not in s)
        if self.gptq is not None:
            self.gptq.restore_layer(layer_idx, layer, [s["gptq"] for s in stats if "gptq" in s])

    def record(self) -> dict:
        out = {"quant_method": "awq", "awq": asdict(self.acfg)}
        if self.gptq is not None:
            out.update(self.gptq.record(), quant_method="awq+gptq")
        return out


def scale_producer(layer: nn.Module, name: str) -> tuple[nn.Module, slice | None] | None:
    """The producer of stage `name`'s inputs that an input-channel scale folds into, and which of its rows
    (None: a norm's whole weight). None for o_proj under GQA: an o_proj input channel is a q head's copy of a
    shared v channel, so a per-channel scale cannot be folded into the v rows (the reference skips it too)."""
    attn = layer.self_attn
    if name == "down_proj" and isinstance(layer.mlp, HadamardMLP):
        return None  # the online rotation sits between the up rows and down_proj: a channel scale cannot cross it
    if name in ("qkv_proj", "gate_up_proj") and isinstance(layer.input_layernorm, RotatedRMSNorm):
        return None  # likewise between the norm's weight and the linear
    return {
        "qkv_proj": (layer.input_layernorm, None),
        "o_proj": (attn.qkv_proj, slice(attn.q_size + attn.kv_size, None))
        if attn.num_heads == attn.num_kv_heads
        else None,
        "gate_up_proj": (layer.post_attention_layernorm, None),
        "down_proj": (layer.mlp.gate_up_proj, slice(layer.mlp.intermediate_size, None)),
    }[name]


@torch.no_grad()
def fold_scale(prev: nn.Module, rows: slice | None, linear: nn.Module, s: Tensor) -> None:
    """x -> x / s at the producer (a norm's weight, or rows of a linear), W -> W * s at the consumer's columns:
    the float function is unchanged."""
    if rows is None:
        prev.weight.div_(s.to(prev.weight.dtype))
    else:
        prev.weight[rows].div_(s[:, None].to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias[rows].div_(s.to(prev.bias.dtype))
    linear.weight.mul_(s[None, :].to(linear.weight.dtype))


def main(argv: list[str] | None = None) -> None:

    ap = cli.parser("quantize.awq", __doc__)
    g = ap.add_argument_group("AWQ")
    g.add_argument("--no-duo-scaling", action="store_true", help="s = mean|x|^α only (the original AWQ)")
    g.add_argument("--grid", type=int, default=20, help="α grid points in [0, 1)")
    g.add_argument("--search-windows", type=int, default=16, help="calibration windows scoring α and clipping")
    g.add_argument("--no-clip", action="store_true", help="skip the clipping search")
    g.add_argument("--gptq", action="store_true", help="quantize the scaled weights with GPTQ instead of RTN")
    add_gptq_args(ap)
    cli.add_resume_arg(ap)
    args = ap.parse_args(argv)
    qcfg = cli.quant_config(ap, args)
    try:
        acfg = AWQConfig(
            duo_scaling=not args.no_duo_scaling,
            grid=args.grid,
            search_windows=args.search_windows,
            clip=not args.no_clip,
        )
    except ValueError as err:
        ap.error(str(err))
    gptq = GPTQ(qcfg, gptq_config(ap, args), log=cli.log) if args.gptq else None
    model, tokenizer, path, source = cli.load(ap, args, qcfg)
    store = cli.layer_store(args, "quantize.awq")  # after every argument check: a bad one leaves nothing behind
    tokens = cli.calibration_tokens(ap, args, tokenizer)
    algo = AWQ(qcfg, acfg, gptq, batch_size=args.batch_size, log=cli.log)
    seconds = cli.run_calibration(args, model, tokens, algo, qcfg, source, store, "awq")
    qcfg.extra.update(algo.record(), calib=args.calib, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    stats = {"quantize_seconds": round(seconds, 1), "awq_layers": algo.stats, "gptq_layers": gptq.stats if gptq else []}
    cli.finish(args, model, tokenizer, path, qcfg, "quantize.awq", stats, argv, store=store)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
