"""Relative output error ||(W - RTN(W)) x|| / ||W x|| of each decoder linear, plain vs rotated (quantize.rotation),
on the inputs one wiki eval window gives each linear (forward pre-hooks). One linear at a time: shows which linears
a rotation helps or hurts before any full-model perplexity run (notes/issue-20.md).

    python scripts/rotation_layer_error.py --mode online --layers 1,2,15,25
    python scripts/rotation_layer_error.py --layers all --summary --perturb 0.3   # on-grid vs off-grid weights
    python scripts/rotation_layer_error.py --layers all --summary --mse            # RTN with the range search

--perturb F adds gaussian noise of std F x the weight's own 4-bit group-32 asymmetric step (the Q4_1 grid the
default model's weights were de-quantized from) to every decoder linear *before* rotating, which moves the weights
off that grid; both the plain and the rotated model then carry the same perturbed weights. --grid-stats prints how
many distinct values a g32 / g64 group of the (unperturbed) weights holds.

--e2e N: end to end instead of per linear: RTN (fake-quantized in place) of one linear type at a time in every
decoder layer, then of all of them, plain and rotated; prints the mean NLL per token on N wiki eval windows of 512
(float models first). Shows which linears' rotation costs perplexity even when their own output error drops.
"""

from __future__ import annotations

import argparse
import copy

import torch

from quantize.cli import CachedTokenizer
from quantize.grid import expand_groups, fake_quantize, group_params
from quantize.rotation import rotate_model
from runtime.data import load_text, token_windows
from runtime.layout import LINEAR_NAMES
from runtime.loader import load_model, load_tokenizer
from runtime.scoring import window_nlls

PATHS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj"}


def linear(layer, name: str):
    return layer.get_submodule(PATHS.get(name, f"mlp.{name}"))


def capture(model, tokens) -> dict:
    acts, handles = {}, []
    for i, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            mod = linear(layer, name)
            handles.append(mod.register_forward_pre_hook(lambda m, a, key=(i, name): acts.__setitem__(key, a[0][0])))
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return acts


def rtn(w: torch.Tensor, bits: int, group_size: int, mse: bool) -> torch.Tensor:
    """RTN round trip of w [out, in] (asymmetric, groups of group_size input columns; -1 = per channel)."""
    gs = w.shape[1] if group_size == -1 else group_size
    s, z = group_params(w.float(), bits, False, gs, mse=mse)
    return fake_quantize(w.float(), expand_groups(s, w.shape[1], gs), expand_groups(z, w.shape[1], gs), 2**bits - 1)


@torch.no_grad()
def perturb(model, factor: float, seed: int = 0) -> None:
    """w += N(0, (factor * step)^2), step = the 4-bit asymmetric step of w's own group of 32 input columns."""
    gen = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for name in LINEAR_NAMES:
            w = linear(layer, name).weight
            s, _ = group_params(w.float(), 4, False, 32)
            step = expand_groups(s, w.shape[1], 32)
            w.add_((factor * step * torch.randn(w.shape, generator=gen)).to(w.dtype))


@torch.no_grad()
def grid_stats(model, layers) -> None:
    for gs in (32, 64):
        counts = []
        for i in layers:
            for name in LINEAR_NAMES:
                w = linear(model.layers[i], name).weight
                g = w[:, : w.shape[1] // gs * gs].reshape(-1, gs)
                counts.append(torch.tensor([row.unique().numel() for row in g[:: max(1, g.shape[0] // 2000)]]))
        c = torch.cat(counts).float()
        print(f"distinct values per g{gs} group: mean {c.mean():.1f}, max {int(c.max())} (of {gs})")


@torch.no_grad()
def end_to_end(model, rotated, tok, args) -> None:
    windows = token_windows(tok, load_text("wiki", args.split), 512, args.e2e)
    ntok = len(windows) * 511

    def nll(m) -> float:
        return sum(window_nlls(m, windows, 1)) / ntok

    def quantized(m, types):
        q = copy.deepcopy(m)
        for layer in q.layers:
            for name in types:
                w = linear(layer, name).weight
                w.data = rtn(w.data, args.bits, args.group_size, args.mse).to(w.dtype)
        return q

    base0, base1 = nll(model), nll(rotated)
    print(f"NLL/token on {len(windows)} wiki {args.split} windows: float {base0:.4f}, rotated float {base1:.4f}")
    for types in [[t] for t in LINEAR_NAMES] + [list(LINEAR_NAMES)]:
        a, b = nll(quantized(model, types)) - base0, nll(quantized(rotated, types)) - base0
        verdict = "same" if a == b else ("rotation better" if b < a else "rotation worse")
        print(f"  RTN {'+'.join(types):40s} plain {a:+.4f}  rotated {b:+.4f}  ({verdict})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="online", choices=["online", "residual"])
    ap.add_argument("--layers", default="1,2,15,25", help="comma list or 'all'")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mse", action="store_true", help="RTN with the MSE range search (quantize.rtn --mse)")
    ap.add_argument("--perturb", type=float, default=0.0, help="noise std in units of the g32 4-bit step")
    ap.add_argument("--no-online-hadamard", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary", action="store_true", help="only the per-linear-type means over the layers")
    ap.add_argument("--grid-stats", action="store_true")
    ap.add_argument("--split", default="eval", choices=["eval", "calib"], help="--e2e's windows (wiki text)")
    ap.add_argument("--token0", action="store_true", help="the first token's error (the attention sink) apart")
    ap.add_argument("--e2e", type=int, default=0, metavar="N", help="end-to-end NLL on N windows of 512, per type")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _, path = load_model("smollm2-135m", torch.float32)
    layers = range(len(model.layers)) if args.layers == "all" else list(map(int, args.layers.split(",")))
    if args.grid_stats:
        grid_stats(model, layers)
    if args.perturb:
        perturb(model, args.perturb, args.seed)
    tok = CachedTokenizer(load_tokenizer(str(path)))
    tokens = torch.tensor(token_windows(tok, load_text("wiki", "eval"), args.tokens, 1))
    rotated = rotate_model(copy.deepcopy(model), seed=args.seed, mode=args.mode, online=not args.no_online_hadamard)
    if args.e2e:
        end_to_end(model, rotated, tok, args)
        return
    plain_x, rot_x = capture(model, tokens), capture(rotated, tokens)

    @torch.no_grad()
    def rel(w, x) -> float:
        q = rtn(w, args.bits, args.group_size, args.mse)
        x = x[:1] if args.token0 else x
        return float((x @ (w - q).t()).norm() / (x @ w.t()).norm())

    label = f"{args.bits}-bit g{args.group_size}{' mse' if args.mse else ''}, perturb {args.perturb}"
    label += ", first token only" if args.token0 else ""
    sums = {name: [0.0, 0.0, 0] for name in LINEAR_NAMES}
    if not args.summary:
        print(f"layer | {' | '.join(LINEAR_NAMES)}   (plain / rotated-{args.mode}; {label})")
    for i in layers:
        cells = []
        for name in LINEAR_NAMES:
            w0, w1 = linear(model.layers[i], name).weight, linear(rotated.layers[i], name).weight
            e0, e1 = rel(w0, plain_x[(i, name)]), rel(w1, rot_x[(i, name)])
            sums[name][0] += e0
            sums[name][1] += e1
            sums[name][2] += e1 < e0
            cells.append(f"{e0:.3f} / {e1:.3f}")
        if not args.summary:
            print(f"{i} | " + " | ".join(cells))
    n = len(layers)
    print(f"mean over {n} layers ({label}; plain / rotated-{args.mode}, rotation better in k of {n}):")
    for name, (a, b, k) in sums.items():
        print(f"  {name:13s} {a / n:.4f} / {b / n:.4f}  ({b / a - 1:+.1%}; better in {k}/{n})")


if __name__ == "__main__":
    main()
