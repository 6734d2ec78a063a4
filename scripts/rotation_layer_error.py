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
import torch.nn.functional as F

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


def quantize(w: torch.Tensor, args, gen: torch.Generator) -> torch.Tensor:
    """RTN round trip; with --shuffle-error the same error values per row (or group) at random columns."""
    q = rtn(w, args.bits, args.group_size, args.mse)
    if not args.shuffle_error:
        return q
    err = q - w
    width = err.shape[1] if args.shuffle_error == "row" else args.group_size
    err = err.reshape(err.shape[0], -1, width)
    idx = torch.argsort(torch.rand(err.shape, generator=gen), dim=-1)
    return w + torch.gather(err, -1, idx).reshape(w.shape)


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
def flip_signs(model, seed: int = 0):
    """An exact transform (sign flips only): random signs s on each norm's channels (norm weight and its readers'
    columns) and on the MLP's channels (up rows and down_proj's columns). Rotating afterwards rotates by
    diag(s) H instead of H (QuaRot's randomised Hadamard), at no run-time cost in online mode."""
    gen = torch.Generator().manual_seed(seed)

    def signs(n):
        return torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1

    for layer in model.layers:
        for norm, reader in (
            (layer.input_layernorm, layer.self_attn.qkv_proj),
            (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
        ):
            s = signs(norm.weight.shape[0])
            norm.weight.mul_(s)
            reader.weight.mul_(s[None, :])
        mlp = layer.mlp
        s = signs(mlp.intermediate_size)
        mlp.gate_up_proj.weight[mlp.intermediate_size :].mul_(s[:, None])
        mlp.down_proj.weight.mul_(s[None, :])
    return model


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

    def quantized(m, types, only=None):
        q = copy.deepcopy(m)
        gen = torch.Generator().manual_seed(args.seed)
        for j, layer in enumerate(q.layers):
            if only is not None and j != only:
                continue
            for name in types:
                mod = linear(layer, name)
                w = mod.weight
                if args.protect_first:  # the first tokens' outputs from the float weight (F.linear: same math)
                    w0 = w.data.clone()
                    mod.register_forward_hook(lambda mod, a, out, w0=w0: protect(mod, a[0], out, w0))
                w.data = quantize(w.data, args, gen).to(w.dtype)
        return q

    def protect(mod, x, out, w0):
        n = args.protect_first
        out = out.clone()
        out[:, :n] = F.linear(x[:, :n], w0, mod.bias)
        return out

    base0, base1 = nll(model), nll(rotated)
    if args.e2e_per_layer:
        print(f"NLL/token on {len(windows)} wiki {args.split} windows: float {base0:.4f}; RTN of one layer's linears:")
        worse = 0
        for i in range(len(model.layers)):
            a = nll(quantized(model, LINEAR_NAMES, i)) - base0
            b = nll(quantized(rotated, LINEAR_NAMES, i)) - base0
            worse += b > a
            print(f"  layer {i:2d}: plain {a:+.4f}  rotated {b:+.4f}  ({b - a:+.4f})", flush=True)
        print(f"rotation worse in {worse}/{len(model.layers)} layers")
        return
    print(f"NLL/token on {len(windows)} wiki {args.split} windows: float {base0:.4f}, rotated float {base1:.4f}")
    for types in ([] if args.e2e_all_only else [[t] for t in LINEAR_NAMES]) + [list(LINEAR_NAMES)]:
        a, b = nll(quantized(model, types)) - base0, nll(quantized(rotated, types)) - base0
        verdict = "same" if a == b else ("rotation better" if b < a else "rotation worse")
        print(f"  RTN {'+'.join(types):40s} plain {a:+.4f}  rotated {b:+.4f}  ({verdict})")


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--e2e-all-only", action="store_true", help="--e2e: only every linear at once")
    ap.add_argument("--signs", action="store_true", help="randomised Hadamard diag(s) H in online mode (exact)")
    ap.add_argument("--per-token", action="store_true", help="mean over tokens of each token's relative error")
    ap.add_argument(
        "--protect-first",
        type=int,
        default=0,
        metavar="K",
        help="--e2e: the first K tokens of each window go through the float weights (attention-sink test)",
    )
    ap.add_argument("--centered", action="store_true", help="inputs minus their mean over tokens (no bias part)")
    ap.add_argument("--e2e-per-layer", action="store_true", help="--e2e: one decoder layer at a time")
    ap.add_argument(
        "--shuffle-error",
        choices=["row", "group"],
        default=None,
        help="--e2e: permute each row's (or each group's) RTN error over its columns (same values, no structure)",
    )
    ap.add_argument("--token0", action="store_true", help="the first token's error (the attention sink) apart")
    ap.add_argument("--e2e", type=int, default=0, metavar="N", help="end-to-end NLL on N windows of 512, per type")
    return ap.parse_args()


@torch.no_grad()
def relative_error(w: torch.Tensor, x: torch.Tensor, args, gen: torch.Generator) -> float:
    """|x (W - Q(W))^T| / |x W^T| over the captured inputs (or per token, the first token, centered: --flags)."""
    q = quantize(w, args, gen)
    x = x[:1] if args.token0 else x
    x = x - x.mean(0) if args.centered else x
    if args.per_token:
        return float(((x @ (w - q).t()).norm(dim=1) / (x @ w.t()).norm(dim=1)).mean())
    return float((x @ (w - q).t()).norm() / (x @ w.t()).norm())


def describe(args) -> str:
    label = f"{args.bits}-bit g{args.group_size}{' mse' if args.mse else ''}, perturb {args.perturb}"
    label += ", first token only" if args.token0 else ""
    label += ", per-token mean" if args.per_token else ""
    label += ", centered inputs" if args.centered else ""
    label += f", error shuffled per {args.shuffle_error}" if args.shuffle_error else ""
    return label


def layer_table(model, rotated, layers, tokens: torch.Tensor, args) -> None:
    """Per layer and linear type, the plain and the rotated model's relative output error; then the means."""
    plain_x, rot_x = capture(model, tokens), capture(rotated, tokens)
    gen = torch.Generator().manual_seed(args.seed)
    label = describe(args)
    sums = {name: [0.0, 0.0, 0] for name in LINEAR_NAMES}
    if not args.summary:
        print(f"layer | {' | '.join(LINEAR_NAMES)}   (plain / rotated-{args.mode}; {label})")
    for i in layers:
        cells = []
        for name in LINEAR_NAMES:
            w0, w1 = linear(model.layers[i], name).weight, linear(rotated.layers[i], name).weight
            e0 = relative_error(w0, plain_x[(i, name)], args, gen)
            e1 = relative_error(w1, rot_x[(i, name)], args, gen)
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


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    model, _, path = load_model("smollm2-135m", torch.float32)
    layers = range(len(model.layers)) if args.layers == "all" else list(map(int, args.layers.split(",")))
    if args.grid_stats:
        grid_stats(model, layers)
    if args.perturb:
        perturb(model, args.perturb, args.seed)
    tok = CachedTokenizer(load_tokenizer(str(path)))
    tokens = torch.tensor(token_windows(tok, load_text("wiki", "eval"), args.tokens, 1))
    rotated = copy.deepcopy(model)
    if args.signs:
        flip_signs(rotated, args.seed)
    rotated = rotate_model(rotated, seed=args.seed, mode=args.mode, online=not args.no_online_hadamard)
    if args.e2e:
        end_to_end(model, rotated, tok, args)
        return
    layer_table(model, rotated, layers, tokens, args)


if __name__ == "__main__":
    main()
