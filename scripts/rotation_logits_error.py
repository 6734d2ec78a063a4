"""Where the rotated fp32 model's logits leave the exact ones (notes/issue-20.md, the logits bar).

On the slow test's tokens (tests/test_quant_rotation.py: 2 x 32 random tokens, seed 0), prints max |Δ logits| of:
  - the plain fp32 model against the fp64 model (the fp32 model's own rounding of the exact logits);
  - a *permuted* fp32 model (residual and MLP channels permuted: an exact transform, weights bit-identical, only
    the order of fp32 sums changes) against the plain fp32 model and against fp64: the floor any re-basing of the
    model meets when compared with the plain fp32 model (two equally accurate fp32 computations);
  - the rotated fp32 model (each mode) against the plain fp32 model and against fp64, and the rotated fp64 model
    against fp64 (the algebra alone), and with --hadamard-fp64 the rotated fp32 model whose online Hadamards run
    in fp64 (isolates their rounding from the rounding of the rotated weights).

    python scripts/rotation_logits_error.py
"""

from __future__ import annotations

import argparse
import copy

import torch

from quantize.rotation import HadamardRotation, rotate_model
from runtime.loader import load_model


@torch.no_grad()
def permute_model(model, seed: int = 0):
    """The same function with residual channels and MLP channels permuted (exact: no arithmetic on weights)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    p = torch.randperm(cfg.hidden_size, generator=gen)
    m = torch.randperm(cfg.intermediate_size, generator=gen)
    model.embed_tokens.weight.data = model.embed_tokens.weight.data[:, p].contiguous()
    if not cfg.tie_word_embeddings:
        model.lm_head.weight.data = model.lm_head.weight.data[:, p].contiguous()
    else:
        model.lm_head.weight = model.embed_tokens.weight
    model.norm.weight.data = model.norm.weight.data[p].contiguous()
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = norm.weight.data[p].contiguous()
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.weight.data = attn.qkv_proj.weight.data[:, p].contiguous()
        mlp.gate_up_proj.weight.data = torch.cat([mlp.gate_up_proj.weight.data[:, p].split(cfg.intermediate_size)[i][m]
                                                  for i in range(2)]).contiguous()  # fmt: skip
        for writer in (attn.o_proj, mlp.down_proj):
            writer.weight.data = writer.weight.data[p].contiguous()
            if writer.bias is not None:
                writer.bias.data = writer.bias.data[p].contiguous()
        mlp.down_proj.weight.data = mlp.down_proj.weight.data[:, m].contiguous()
    return model


FORWARD = HadamardRotation.forward


def hadamard_in_fp64(self, x):
    return FORWARD(self, x.double()).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hadamard-fp64", action="store_true")
    ap.add_argument("--token-seed", type=int, default=0, help="seed of the random tokens (0: the slow test's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _, _ = load_model("smollm2-135m", torch.float32)
    gen = torch.Generator().manual_seed(args.token_seed)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=gen)

    def md(a, b) -> str:
        return f"{float((a - b).abs().max()):.2e}"

    with torch.no_grad():
        ref = model(tokens)
        exact = copy.deepcopy(model).set_dtype(torch.float64)(tokens)
        print(f"plain fp32 vs fp64: {md(ref.double(), exact)}")
        for seed in (0, 1):
            perm = permute_model(copy.deepcopy(model), seed)(tokens)
            print(f"permuted fp32 (seed {seed}) vs plain fp32: {md(perm, ref)}; vs fp64: {md(perm.double(), exact)}")
        for mode in ("residual", "online"):
            rotated = rotate_model(copy.deepcopy(model), seed=0, mode=mode)
            out = rotated(tokens)
            r64 = copy.deepcopy(rotated).set_dtype(torch.float64)(tokens)
            print(f"rotated-{mode} fp32 vs plain fp32: {md(out, ref)}; vs fp64: {md(out.double(), exact)}; "
                  f"rotated fp64 vs fp64: {md(r64, exact)}")  # fmt: skip
            if args.hadamard_fp64:
                HadamardRotation.forward = hadamard_in_fp64
                try:
                    out = rotated(tokens)
                finally:
                    HadamardRotation.forward = FORWARD
                print(f"  with the online Hadamards in fp64: vs plain fp32 {md(out, ref)}; vs fp64 "
                      f"{md(out.double(), exact)}")  # fmt: skip


if __name__ == "__main__":
    main()
