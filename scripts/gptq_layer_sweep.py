"""Layer-wise check of GPTQ settings on held-out calibration data, without touching the evaluation split.

Runs the GPTQ calibration pass (act-order, damping 0.01: the default recipe, so every layer sees the inputs the
real run gives it). At the chosen layers, each linear's Hessian is split: H_fit from the first windows, H_test
from the last --test-windows windows; each variant quantizes the weight with H_fit and is scored by the
layer-wise error on the held-out tokens, tr(ΔW H_test ΔWᵀ), relative to RTN's. Also prints how skewed diag(H)
is (damping is a fraction of its mean).

    python scripts/gptq_layer_sweep.py --nsamples 128 --layers 0,1,5,10,15,20,25,29 > sweep.jsonl
"""

from __future__ import annotations

import json
import sys

from quantize import cli
from quantize.calibration import calibrate
from quantize.gptq import GPTQ, GPTQConfig, accumulate_hessian, gptq_quantize, layer_error
from quantize.rtn import quantize_weight

VARIANTS = {  # name -> GPTQConfig (None: RTN, with or without the MSE range search)
    "rtn": None,
    "rtn-mse": None,
    "gptq": GPTQConfig(),
    "gptq-ao": GPTQConfig(act_order=True),
    "gptq-ao-damp0.001": GPTQConfig(act_order=True, damp_percent=0.001),
    "gptq-ao-damp0.0001": GPTQConfig(act_order=True, damp_percent=0.0001),
    "gptq-ao-damp0.1": GPTQConfig(act_order=True, damp_percent=0.1),
    "gptq-ao-static": GPTQConfig(act_order=True, static_groups=True),
    "gptq-ao-mse": GPTQConfig(act_order=True, mse=True),
}


class Sweep(GPTQ):
    def __init__(self, qcfg, layers: set[int], test_batches: int):
        super().__init__(qcfg, GPTQConfig(act_order=True))
        self.layers, self.test_batches = layers, test_batches

    def quantize_stage(self, stage) -> None:
        if stage.layer_idx in self.layers and stage.name in self.qcfg.modules:
            self.sweep(stage)
        super().quantize_stage(stage)

    def sweep(self, stage) -> None:
        w = stage.linear.weight.detach().float()
        h_fit = accumulate_hessian(stage.inputs[: -self.test_batches])
        h_test = accumulate_hessian(stage.inputs[-self.test_batches :])
        d = h_fit.diagonal()
        group = self.qcfg.group_size_for(w.shape[1], stage.full_name)
        row = {
            "layer": stage.full_name,
            "diag_max/mean": float(d.max() / d.mean()),
            "diag_median/mean": float(d.median() / d.mean()),
            "share_diag_below_damp0.01": float((d < 0.01 * d.mean()).float().mean()),
        }
        errors = {}
        for name, gcfg in VARIANTS.items():
            if gcfg is None:
                qw = quantize_weight(w, self.qcfg, mse=name.endswith("mse"), name=stage.full_name)
            else:
                qw = gptq_quantize(w, h_fit, self.qcfg.bits, self.qcfg.sym, group, gcfg).qweight
            errors[name] = (layer_error(w, qw, h_test), layer_error(w, qw, h_fit))
        rtn_test = errors["rtn"][0]
        row["test_error_vs_rtn"] = {k: round(v[0] / rtn_test, 4) for k, v in errors.items()}
        row["fit_error_vs_rtn"] = {k: round(v[1] / errors["rtn"][1], 4) for k, v in errors.items()}
        row["rtn_test_error"] = rtn_test
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = cli.parser("scripts/gptq_layer_sweep.py", __doc__)
    ap.add_argument("--layers", default="0,1,5,10,15,20,25,29")
    ap.add_argument("--test-windows", type=int, default=16)
    ap.set_defaults(eval="none")  # nothing is evaluated; quant_config wants --out or --eval
    args = ap.parse_args()
    if args.test_windows % args.batch_size or args.test_windows >= args.nsamples:
        ap.error("--test-windows must be a multiple of --batch-size and smaller than --nsamples")
    qcfg = cli.quant_config(ap, args)
    model, tokenizer, _, _ = cli.load(ap, args, qcfg)
    tokens = cli.calibration_tokens(ap, args, tokenizer)
    algo = Sweep(qcfg, {int(i) for i in args.layers.split(",")}, args.test_windows // args.batch_size)
    calibrate(model, tokens, algo, args.batch_size, progress=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
    main()
