"""Hadamard rotations in the manner of QuaRot (Ashkboos et al. 2024): make weights and activations easier to
quantize by rotating them, without changing the float model.

1. Fold every RMSNorm weight into the linears that read the norm (qkv_proj, gate_up_proj, lm_head); the norms
   keep unit weights. An RMSNorm with unit weight commutes with an orthogonal Q (||xQ|| = ||x||).
2. Rotate the residual stream by a randomised Hadamard matrix Q = diag(±1) H / sqrt(n): the embedding table
   becomes E Q; the readers of the stream (qkv_proj, gate_up_proj, lm_head) get W Q; the writers (o_proj,
   down_proj) get Qᵀ W. Every hidden state the model carries is then x Q. Offline: no cost at run time.
3. Online Hadamard on down_proj's input (the MLP's activations, where the largest outliers live): the MLP
   becomes a HadamardMLP that multiplies its activations by R = H / sqrt(n) before down_proj, whose weight is
   W R (so W R Rᵀ x = W x). R is a Kronecker product of small Hadamard factors, applied as two small matmuls.

A tied embedding cannot stay tied: the embedding must become E Q while the head becomes E diag(g) Q (g the
final norm's weight). The model is untied (``tie_word_embeddings`` False; the checkpoint carries ``lm_head``),
which costs one more vocab x hidden table when the head is not quantized.

Hadamard matrices of order 2^k (Sylvester) and 12 · 2^k, 144 · 2^k (Kronecker with Paley's order-12 matrix)
cover SmolLM2's widths (576 = 12 · 12 · 4, 1536 = 12 · 128); other widths are an error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quantize.qlinear import QuantLinear
from runtime.layout import decoder_linear_names
from runtime.model import MLP, AttentionMetadata, Linear, RMSNorm, Transformer


def paley12() -> Tensor:
    """A Hadamard matrix of order 12 by Paley's first construction from GF(11) (11 ≡ 3 mod 4):
    H = I + [[0, 1ᵀ], [-1, Q]] with Q the Jacobsthal matrix Q_ij = χ(j - i), χ the quadratic character."""
    q = 11
    squares = {(x * x) % q for x in range(1, q)}

    def chi(a: int) -> int:
        a %= q
        return 0 if a == 0 else (1 if a in squares else -1)

    S = torch.zeros(q + 1, q + 1)
    S[0, 1:] = 1
    S[1:, 0] = -1
    for i in range(q):
        for j in range(q):
            S[i + 1, j + 1] = chi(j - i)
    return torch.eye(q + 1) + S


def sylvester(n: int) -> Tensor:
    H = torch.ones(1, 1)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def hadamard_factors(n: int) -> tuple[Tensor, Tensor]:
    """(A, B) with A ⊗ B a ±1 Hadamard matrix of order n: A of order 1, 12 or 144, B of order 2^k."""
    a = 1
    while n % (12 * a) == 0 and (n // a) & (n // a - 1) != 0:
        a *= 12
    b = n // a
    if b & (b - 1) != 0 or a > 144:
        raise ValueError(f"no Hadamard matrix for width {n}: supported widths are 2^k, 12 * 2^k and 144 * 2^k")
    A = torch.ones(1, 1)
    for _ in range(round(math.log(a, 12))):
        A = torch.kron(A, paley12())
    return A, sylvester(b)


def hadamard(n: int) -> Tensor:
    """A ±1 Hadamard matrix of order n (H Hᵀ = n I)."""
    A, B = hadamard_factors(n)
    return torch.kron(A, B)


def random_hadamard(n: int, seed: int = 0) -> Tensor:
    """Q = diag(s) H / sqrt(n) with random signs s (seeded): orthogonal, fp64."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return signs[:, None] * hadamard(n).double() / math.sqrt(n)


class HadamardRotation(nn.Module):
    """x -> x R for R = (A ⊗ B) / sqrt(n): x viewed [..., a, b] becomes Aᵀ X B / sqrt(n)."""

    def __init__(self, n: int):
        super().__init__()
        A, B = hadamard_factors(n)
        self.n, self.a, self.b = n, A.shape[0], B.shape[0]
        self.register_buffer("At", A.t().contiguous(), persistent=False)
        self.register_buffer("B", B, persistent=False)
        self.scale = 1.0 / math.sqrt(n)

    def forward(self, x: Tensor) -> Tensor:
        X = x.reshape(-1, self.a, self.b)
        if self.a > 1:
            X = torch.matmul(self.At.to(x.dtype), X)
        return (torch.matmul(X, self.B.to(x.dtype)) * self.scale).reshape(x.shape)

    def matrix(self) -> Tensor:
        """R itself [n, n] in fp64 (what rotate_weight folds into down_proj)."""
        return torch.kron(self.At.t().contiguous().double(), self.B.double()) / math.sqrt(self.n)


class HadamardMLP(MLP):
    """The MLP with an online Hadamard rotation of down_proj's input; down_proj's weight carries R (same
    forward contract and the same linears, so quantizers and the calibration pass see them as usual)."""

    def __init__(self, mlp: MLP):
        nn.Module.__init__(self)
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.rotation = HadamardRotation(mlp.intermediate_size).to(mlp.down_proj.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.rotation(F.silu(gate) * up))


class RotatedRMSNorm(RMSNorm):
    """RMSNorm whose output is rotated by a Hadamard R (x -> norm(x) R): the readers' weights carry R (W R).
    The norm's weight stays on the activation side, before the rotation (see rotate_model's mode "online")."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.eps, self.weight = norm.eps, norm.weight
        self.rotation = HadamardRotation(norm.weight.shape[0]).to(norm.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        return self.rotation(super().forward(x))


def _set(param: Tensor, value: Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


@torch.no_grad()
def fold_norms(model: Transformer) -> Transformer:
    """Fold each RMSNorm weight into its readers' input columns; norms keep unit weights. Unties the head."""
    for layer in model.layers:
        for norm, linear in (
            (layer.input_layernorm, layer.self_attn.qkv_proj),
            (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
        ):
            _set(linear.weight, linear.weight.double() * norm.weight.double()[None, :])
            norm.weight.data.fill_(1.0)
    head = Linear(model.config.hidden_size, model.config.vocab_size, bias=False).to(model.lm_head.weight.device)
    head.weight.data = (model.lm_head.weight.double() * model.norm.weight.double()[None, :]).to(
        model.lm_head.weight.dtype
    )
    model.lm_head = head  # a parameter of its own: no longer the embedding table
    model.norm.weight.data.fill_(1.0)
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)
    return model


MODES = ("residual", "online")


def check_layers(layers, n_layers: int, mode: str) -> None:
    if layers is None:
        return
    if mode != "online":
        raise ValueError("a subset of layers can be rotated only in mode 'online' (the residual mode rotates the "
                         "residual stream every layer shares)")  # fmt: skip
    bad = sorted(i for i in layers if not 0 <= i < n_layers)
    if bad or not layers:
        raise ValueError(f"layers {bad or list(layers)}: choose a non-empty subset of 0..{n_layers - 1}")


@torch.no_grad()
def rotate_model(
    model: Transformer, seed: int = 0, online: bool = True, mode: str = "residual", layers=None
) -> Transformer:
    """Rotate in place; the float function is unchanged up to rounding (products are formed in fp64).

    mode "residual" (QuaRot): fold norms, rotate the residual stream by a random Hadamard Q (offline), untie
    the head. mode "online": leave the residual stream and the norms as they are and rotate each norm's output
    online (RotatedRMSNorm; qkv_proj and gate_up_proj get W R): the norm weights keep damping the channels
    they damp (folding them into W exposes SmolLM2's two massive residual channels to the weights' rounding
    error). Either way, ``online`` adds the Hadamard on down_proj's input (HadamardMLP).

    ``layers`` (mode "online" only; None = all): the decoder layers to rotate; the others keep their plain
    weights. Each layer's rotation is self-contained in online mode (the residual stream is not rotated), so
    any subset is the same float function."""
    if mode not in MODES:
        raise ValueError(f"unknown rotation mode {mode!r}; choose from {MODES}")
    check_layers(layers, len(model.layers), mode)
    chosen = set(range(len(model.layers)) if layers is None else layers)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            raise ValueError(f"rotate before quantizing: {name} is already quantized")
    if any(
        isinstance(layer.mlp, HadamardMLP) or isinstance(layer.input_layernorm, RotatedRMSNorm)
        for layer in model.layers
    ):
        raise ValueError("the model is already rotated")
    # q/k norms (Qwen3) act after qkv_proj on head vectors: neither rotation reaches them
    if mode == "online":
        for i, layer in enumerate(model.layers):
            if i not in chosen:
                continue
            layer.input_layernorm = RotatedRMSNorm(layer.input_layernorm)
            layer.post_attention_layernorm = RotatedRMSNorm(layer.post_attention_layernorm)
            for norm, reader in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                _set(reader.weight, reader.weight.double() @ norm.rotation.matrix())
    else:
        fold_norms(model)
        Q = random_hadamard(model.config.hidden_size, seed)
        emb = model.embed_tokens.weight
        _set(emb, emb.double() @ Q)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for reader in (attn.qkv_proj, mlp.gate_up_proj):
                _set(reader.weight, reader.weight.double() @ Q)
            for writer in (attn.o_proj, mlp.down_proj):
                _set(writer.weight, Q.t() @ writer.weight.double())
                if writer.bias is not None:
                    _set(writer.bias, writer.bias.double() @ Q)
        _set(model.lm_head.weight, model.lm_head.weight.double() @ Q)
    if online:
        for i, layer in enumerate(model.layers):
            if i not in chosen:
                continue
            mlp = layer.mlp
            layer.mlp = HadamardMLP(mlp)
            _set(mlp.down_proj.weight, mlp.down_proj.weight.double() @ layer.mlp.rotation.matrix())
    return model


def install_online_hadamard(model: Transformer, rotation: dict) -> Transformer:
    """Re-install the online rotations a checkpoint's weights were rotated for (loading a rotated checkpoint);
    a record without ``layers`` rotated every layer."""
    layers = rotation.get("layers")
    for i, layer in enumerate(model.layers):
        if layers is not None and i not in layers:
            continue
        if rotation.get("online_down") and not isinstance(layer.mlp, HadamardMLP):
            layer.mlp = HadamardMLP(layer.mlp)
        if rotation.get("mode") == "online" and not isinstance(layer.input_layernorm, RotatedRMSNorm):
            layer.input_layernorm = RotatedRMSNorm(layer.input_layernorm)
            layer.post_attention_layernorm = RotatedRMSNorm(layer.post_attention_layernorm)
    return model


def rotation_record(seed: int, online: bool, mode: str = "residual", layers=None) -> dict:
    """What a checkpoint's quantization_config says about its rotation (the loader re-installs online ones)."""
    record = {"method": "hadamard", "mode": mode, "online_down": online, "seed": seed}
    record["untied_head"] = mode == "residual"
    if layers is not None:
        record["layers"] = sorted(layers)
    return record


def choose_layers_cost(num_layers: int) -> float:
    """Full-model passes choose_layers costs over its windows (layer and head passes, a head counting as
    HEAD_PASS_LAYERS layers): one float pass, then for each layer i two passes from i to the end."""
    layer_passes = num_layers + num_layers * (num_layers + 1)
    return (layer_passes + 2 * num_layers * HEAD_PASS_LAYERS) / (num_layers + HEAD_PASS_LAYERS)


HEAD_PASS_LAYERS = 8  # a SmolLM2-135M head (49152 x 576) costs about 8 of its decoder layers; an estimate only


@torch.no_grad()
def choose_layers(
    model: Transformer,
    windows: list[list[int]],
    round_trip: Callable[[Tensor, str], Tensor],
    seed: int = 0,
    online: bool = True,
    batch_size: int = 4,
) -> tuple[list[int], list[dict]]:
    """The decoder layers whose online rotation lowers the loss of quantizing that layer: for each layer i, the
    summed NLL of ``windows`` with only layer i's linears replaced by ``round_trip(weight, name)`` (their
    quantize-dequantize), once in the plain model and once in the online-rotated one; a layer is chosen when
    the rotated loss is lower. One layer at a time because in online mode each layer's rotation is
    self-contained (any subset is the same float model). Returns (chosen layers, one record per layer).

    For the same reason layer i's input is the float model's in both, so each evaluation starts from layer i's
    input, captured once: L(L+1) layer passes instead of 2L full-model ones (1.6x fewer multiply-adds on
    SmolLM2, choose_layers_cost), batch_size windows at a time, the same losses up to summation order."""
    rotated = rotate_model(copy.deepcopy(model), seed=seed, online=online, mode="online")
    names = decoder_linear_names(len(model.layers))
    batches = [torch.tensor(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)]
    inputs = [layer_inputs(model, batch) for batch in batches]  # [batch][layer] residual stream entering it

    def loss_with_layer_quantized(m: Transformer, i: int) -> float:
        linears = {name: m.get_submodule(name) for name in names if name.startswith(f"layers.{i}.")}
        saved = {name: lin.weight.data for name, lin in linears.items()}
        for name, lin in linears.items():
            lin.weight.data = round_trip(lin.weight.data, name).to(lin.weight.dtype)
        try:
            return sum(suffix_nll(m, i, batch, xs[i]) for batch, xs in zip(batches, inputs))
        finally:
            for name, lin in linears.items():
                lin.weight.data = saved[name]

    chosen, records = [], []
    for i in range(len(model.layers)):
        plain, turned = loss_with_layer_quantized(model, i), loss_with_layer_quantized(rotated, i)
        records.append({"layer": i, "plain_nll": plain, "rotated_nll": turned})
        if turned < plain:
            chosen.append(i)
    return chosen, records


def _causal(model: Transformer, tokens: Tensor):
    meta = AttentionMetadata.contiguous(tokens.shape[0], 0, tokens.shape[1], tokens.device)
    cos, sin = model.rope(meta.positions, model.compute_dtype)
    return meta, cos, sin


def layer_inputs(model: Transformer, tokens: Tensor) -> list[Tensor]:
    """[B, T] token windows -> the residual stream entering each decoder layer, [B, T, H] per layer."""
    meta, cos, sin = _causal(model, tokens)
    x = model.embed_tokens(tokens).to(model.residual_dtype or model.compute_dtype)
    out = []
    for layer in model.layers:
        out.append(x)
        x = layer(x, cos, sin, meta, None)
    return out


def suffix_nll(model: Transformer, start: int, tokens: Tensor, x: Tensor) -> float:
    """Summed NLL of the windows tokens [B, T] (every predicted token), running model's layers from `start` on
    the residual stream x [B, T, H] that enters it."""
    meta, cos, sin = _causal(model, tokens)
    for layer in model.layers[start:]:
        x = layer(x, cos, sin, meta, None)
    logits = model.logits(model.norm(x))
    return float(F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum"))
