"""Relative output error ||(W - RTN(W)) x|| / ||W x|| of each decoder linear, plain vs rotated (quantize.rotation),
on the inputs one wiki eval window gives each linear (forward pre-hooks). One linear at a time: shows which linears
a rotation helps or hurts before any full-model perplexity run (notes/issue-20.md).

    python scripts/rotation_layer_error.py --mode online --layers 1,2,15,25
"""

from __future__ import annotations

import argparse
import copy

import torch

from quantize.awq import fake_quantize_weight
from quantize.cli import CachedTokenizer
from quantize.config import QuantConfig
from quantize.rotation import rotate_model
from runtime.data import load_text, token_windows
from runtime.layout import LINEAR_NAMES
from runtime.loader import load_model, load_tokenizer

PATHS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj"}


def capture(model, tokens) -> dict:
    acts, handles = {}, []
    for i, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            mod = layer.get_submodule(PATHS.get(name, f"mlp.{name}"))
            handles.append(mod.register_forward_pre_hook(lambda m, a, key=(i, name): acts.__setitem__(key, a[0][0])))
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return acts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="online", choices=["online", "residual"])
    ap.add_argument("--layers", default="1,2,15,25")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _, path = load_model("smollm2-135m", torch.float32)
    tok = CachedTokenizer(load_tokenizer(str(path)))
    tokens = torch.tensor(token_windows(tok, load_text("wiki", "eval"), args.tokens, 1))
    rotated = rotate_model(copy.deepcopy(model), mode=args.mode)
    plain_x, rot_x = capture(model, tokens), capture(rotated, tokens)
    cfg = QuantConfig(bits=4, group_size=args.group_size)

    @torch.no_grad()
    def rel(w, x) -> float:
        q = fake_quantize_weight(w, cfg, args.group_size)
        return float((x @ (w - q).t()).norm() / (x @ w.t()).norm())

    print(f"layer | {' | '.join(LINEAR_NAMES)}   (plain / rotated-{args.mode})")
    for i in map(int, args.layers.split(",")):
        cells = []
        for name in LINEAR_NAMES:
            p = PATHS.get(name, f"mlp.{name}")
            w0, w1 = model.layers[i].get_submodule(p).weight, rotated.layers[i].get_submodule(p).weight
            cells.append(f"{rel(w0, plain_x[(i, name)]):.3f} / {rel(w1, rot_x[(i, name)]):.3f}")
        print(f"{i} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
