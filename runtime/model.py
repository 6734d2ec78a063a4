"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

One forward serves prefill, decode, k+1-token verification and tree verification: the AttentionMetadata
(rope positions, cache slots, the mask) says which. Projections are fused (q/k/v and gate/up) so each
decoder layer does four matmuls; any module with ``forward(x)`` can stand in for a linear layer.

This module is the plain PyTorch model. A faster path (runtime.backends: the compiled CPU step) is a Backend
installed from outside with set_backend; its hooks may take over a whole step over the decoder layers, a linear,
an RMSNorm, or the head's row chunking, and decline (None) wherever they do not apply.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import ModelConfig, UnsupportedModelError
from runtime.layout import fused_layer_state, unfused_layer_state


@dataclass
class AttentionMetadata:
    """What one forward attends to.

    positions: [B, T] rope positions of the new tokens.
    slots: [B, T] cache slots the new k/v are written to (== positions for linear decoding; differs for
        tree verification, where siblings share a position but not a slot). Ignored without a cache.
    mask: [B, 1, T, S] bool, True = may attend; S = kv_len with a cache, T without. None when the
        attention needs no mask tensor: every query sees all kv_len keys, or (is_causal) the plain causal
        mask of T queries over T keys, which SDPA applies without materialising it.
    kv_len: number of cache slots attended to (a prefix of each sequence's cache).
    contiguous_start: set when every row writes the same slot range start..start+T-1 (a slice copy into
        the cache instead of a scatter).
    starts, counts, local_mask: what a backend's whole-step kernel (runtime.backends) reads, set by the builders
        that know them: row b's new tokens are its first counts[b] (None: all T), written at cache indices
        starts[b].. (slots for a contiguous cache, sequence indices through the block table for a paged one);
        token t sees every index before starts[b] and the new tokens j its local_mask[b or 0, t, j] allows
        (None: j <= t). starts None: the step does not run this forward.
    """

    positions: Tensor
    slots: Tensor
    mask: Tensor | None
    kv_len: int
    contiguous_start: int | None = None
    is_causal: bool = False
    starts: Tensor | None = None
    counts: Tensor | None = None
    local_mask: Tensor | None = None

    @staticmethod
    def causal(positions: Tensor, kv_len: int | None = None) -> AttentionMetadata:
        """Causal attention by position: a query at position p sees cache slots 0..p.

        With kv_len=None (no cache) keys are the new tokens themselves and are masked by their positions.
        """
        if kv_len is None:
            key_pos = positions[:, None, None, :]  # [B, 1, 1, T]
            kv = positions.shape[1]
        else:
            key_pos = torch.arange(kv_len, device=positions.device)[None, None, None, :]
            kv = kv_len
        mask = key_pos <= positions[:, None, :, None]  # [B, 1, T, S]
        return AttentionMetadata(positions=positions, slots=positions, mask=mask, kv_len=kv)

    @staticmethod
    def contiguous(batch: int, start: int, length: int, device, cached: bool = True) -> AttentionMetadata:
        """Every row's new tokens sit at positions start..start+length-1 (prefill, decode of equal-length
        rows, chain verification). The two common shapes need no mask tensor: a prefill from 0 is SDPA's
        own causal mask, and one new token per row sees every key before it."""
        positions = torch.arange(start, start + length, device=device).expand(batch, -1)
        if cached and start > 0 and length > 1:
            meta = AttentionMetadata.causal(positions, kv_len=start + length)
        else:
            meta = AttentionMetadata(positions, positions, None, start + length, is_causal=length > 1)
        meta.contiguous_start = start
        if cached:
            meta.starts = torch.full((batch,), start, dtype=torch.long)
        return meta


def decode_meta(positions: Tensor) -> AttentionMetadata:
    """Metadata for one new token per row at the given positions [B]."""
    values = positions.tolist()  # one host read (a few tensor ops here cost ~0.1 ms a step on cold caches)
    if all(p == values[0] for p in values):
        return AttentionMetadata.contiguous(len(values), values[0], 1, positions.device)
    meta = AttentionMetadata.causal(positions[:, None], kv_len=int(positions.max()) + 1)
    meta.starts = positions.cpu()
    return meta


def prefill_meta(batch: int, length: int, device) -> AttentionMetadata:
    return AttentionMetadata.contiguous(batch, 0, length, device)


class Backend:
    """The plain PyTorch path: every hook declines. A faster backend (runtime.backends) overrides the hooks it can
    run; each returns None where it does not apply, and the plain layers run instead."""

    def decoder_layers(self, model: Transformer, x: Tensor, meta: AttentionMetadata, cache) -> Tensor | None:
        """Every decoder layer over the residual stream x [B, T, hidden] in one call -> the stream after the last."""
        return None

    def linear(self, layer: Linear, x: Tensor) -> Tensor | None:
        """layer(x) [..., out_features] in the weight's dtype, as F.linear gives it."""
        return None

    def linear_widened(self, layer: Linear, x: Tensor) -> Tensor | None:
        """layer(x).float() [..., out_features]: the weight-dtype outputs widened to fp32 in the same pass."""
        return None

    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor | None:
        """norm(x) [..., dim]."""
        return None

    def head_chunk_rows(self, h: Tensor) -> int | None:
        """At most this many rows per lm_head call over h [..., hidden] (None: one call)."""
        return None

    def rows_independent(self, model: Transformer, tokens_per_row: int, cache) -> bool:
        """Whether a forward of up to tokens_per_row new tokens per row over cache gives every row the same bits as
        that row's forward alone (so callers that need batch-independent results may batch rows). The plain layers
        round by the batch's shape (GEMM blocking, padding): no."""
        return False


_backend = Backend()


def set_backend(backend: Backend) -> Backend:
    """Install the backend every model in this process runs through; returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


def current_backend() -> Backend:
    return _backend


class Linear(nn.Linear):
    """nn.Linear whose forward a backend may run (runtime.backends: short CPU inputs through the compiled CPU step's
    kernels, whose rows do not depend on the other rows of the call)."""

    def forward(self, x: Tensor) -> Tensor:
        fast = _backend.linear(self, x)
        return F.linear(x, self.weight, self.bias) if fast is None else fast


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        fast = _backend.rms_norm(self, x)
        if fast is not None:
            return fast
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 like the reference implementation, then cast to the weight's (compute) dtype:
        # equals the reference when the residual stream has the weights' dtype, and casts down when the
        # residual stream is kept in fp32.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(self.weight.dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling of cos/sin, per rope_scaling type."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high_ff) & (wavelen <= old_ctx / low_ff)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(config, scaling, factor)
    raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}")


def yarn_inv_freq(config: ModelConfig, scaling: dict, factor: float) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, blend linearly between (Peng et al. 2023)."""
    dim, base = config.head_dim, config.rope_theta
    original_max = scaling.get("original_max_position_embeddings") or config.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x: [B, T, H, D]; cos: [B, T, 1, D]; signed_sin: [B, T, 1, 2, D/2] = (-sin, +sin) of the two halves.

    The reference's x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): swapping the halves
    (one flip) and multiplying by the signed sin gives the same products and the same sum, bit for bit,
    in fewer ops than negate + concatenate."""
    rotated = x.unflatten(-1, (2, -1)).flip(-2).mul_(signed_sin).flatten(-2)
    return (x * cos).add_(rotated)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, cache) -> Tensor:
        B, T, _ = x.shape
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # reshape, not view: a stand-in linear (QuantLinear, a CUDA kernel) may return any layout
        qk = qk.reshape(B, T, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        # one rope over q and k heads together (fewer small ops per layer in decode)
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if cache is not None and hasattr(cache, "attend"):
            out = cache.attend(self.layer_idx, q, k, v, meta)  # [B, H, T, D]; writes k/v itself
        else:
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v, meta)  # [B, Hkv, S, D]
            if T == 1 and meta.mask is None:
                # one-token decode: the query heads sharing a kv head become rows of one [g, D] query block,
                # which SDPA runs ~1.7x faster than its enable_gqa path (same products per row)
                g = self.num_heads // self.num_kv_heads
                out = F.scaled_dot_product_attention(q.reshape(B, self.num_kv_heads, g, self.head_dim), k, v)
                # reshape, not view: CUDA's SDPA returns [B, Hkv, g, D] laid out as [B, g, Hkv, D]
                out = out.reshape(B, self.num_heads, 1, self.head_dim)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=meta.mask, is_causal=meta.is_causal, enable_gqa=True
                )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, cache) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # None: the residual stream has the weights' dtype (the reference behaviour). torch.float32 with
        # bf16 weights keeps the sum of layer outputs in fp32 (mixed precision: fewer bf16 argmax flips).
        self.residual_dtype: torch.dtype | None = None
        self.fast_decode = True  # whether a backend may run whole steps (False: the Python layers, e.g. under TP hooks)
        inv_freq, self.rope_attention_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos [B, T, 1, D] and the signed sin [B, T, 1, 2, D/2] that apply_rope takes."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2], fp32 like the reference
        scale = self.rope_attention_scale
        cos, sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, :, None, :], torch.stack((-sin, sin), dim=-2)[:, :, None]

    def step_layers(self) -> list[tuple] | None:
        """Per layer (input norm, post-attention norm, qkv, o, gate_up, down) for a backend's whole-step kernel
        (runtime.backends), or None when a layer is not one it implements (q/k norms, a stand-in layer or
        norm of another type; stand-in linears say for themselves whether the step can run them)."""
        out = []
        for layer in self.layers._modules.values():  # the modules' own dicts: this runs every decode step
            mods = layer._modules
            attn, mlp = mods["self_attn"], mods["mlp"]
            if (
                type(layer) is not DecoderLayer
                or type(attn) is not Attention
                or type(mlp) is not MLP
                or type(mods["input_layernorm"]) is not RMSNorm
                or type(mods["post_attention_layernorm"]) is not RMSNorm
                or attn._modules.get("q_norm") is not None
            ):
                return None
            a, f = attn._modules, mlp._modules
            out.append((mods["input_layernorm"], mods["post_attention_layernorm"], a["qkv_proj"], a["o_proj"],
                        f["gate_up_proj"], f["down_proj"]))  # fmt: skip
        return out

    def forward(
        self,
        tokens: Tensor,
        meta: AttentionMetadata | None = None,
        cache=None,
        hidden_only: bool = False,
    ) -> Tensor:
        """tokens [B, T] -> logits [B, T, V] (or final-norm hidden states [B, T, H] if hidden_only).

        Without meta the tokens are one causal sequence per row starting at position 0, no cache.
        """
        if meta is None:
            meta = AttentionMetadata.contiguous(tokens.shape[0], 0, tokens.shape[1], tokens.device, cache is not None)
        x = self.embed_tokens(tokens).to(self.residual_dtype or self.compute_dtype)
        fast = _backend.decoder_layers(self, x, meta, cache)
        if fast is not None:  # the backend's whole step: the same layers, no per-op dispatch
            x = fast
        else:
            cos, sin = self.rope(meta.positions, self.compute_dtype)
            for layer in self.layers:
                x = layer(x, cos, sin, meta, cache)
        x = self.norm(x)
        return x if hidden_only else self.logits(x)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The decoder layers' dtype (also the KV cache's); norms are never quantized, so ask one."""
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def head_dtype(self) -> torch.dtype:
        """The dtype the lm_head computes in (a quantized head says so itself; reading .weight would dequantize)."""
        return getattr(self.lm_head, "compute_dtype", None) or self.lm_head.weight.dtype

    def logits(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states [..., H] -> fp32 logits [..., V] (a 16-bit head's outputs, widened).

        A backend may cap the rows per head call (the CPU step: its kernels' MAX_ROWS), so every row takes its
        row-invariant path (Linear.forward): a position's logits are the same bits in a decode step, a verification
        or any batch, however many rows the call has (F.linear, which larger calls would run, sums in another order)."""
        h = hidden.to(self.head_dtype)
        rows = h.numel() // max(h.shape[-1], 1)
        chunk = _backend.head_chunk_rows(h)
        if chunk is None or rows <= chunk:
            return self._head_fp32(h)
        flat = h.reshape(rows, h.shape[-1])
        out = None
        for i in range(0, rows, chunk):
            part = self._head_fp32(flat[i : i + chunk])
            if out is None:
                out = torch.empty(rows, part.shape[-1], dtype=torch.float32)
            out[i : i + part.shape[0]] = part
        return out.view(*h.shape[:-1], -1)

    def _head_fp32(self, h: Tensor) -> Tensor:
        """lm_head(h).float(): widened as the backend computes it where it can (a plain Linear head)."""
        if type(self.lm_head) is Linear:
            wide = _backend.linear_widened(self.lm_head, h)
            if wide is not None:
                return wide
        return self.lm_head(h).float()

    def set_dtype(self, dtype: torch.dtype, mixed: bool = True, head_dtype: torch.dtype | None = None) -> Transformer:
        """Cast to a compute dtype. With mixed=True and a 16-bit dtype the final norm stays fp32 and the residual
        stream is fp32 (the sum of layer outputs keeps fp32 precision), which lifts bf16's greedy argmax agreement
        with fp32 at no cost in bytes read per token. The embedding and lm_head (tied on SmolLM2) take head_dtype,
        by default the compute dtype: an fp32 head would be 113 of the ~325 MB a bf16 token reads on the default
        model. head_dtype=torch.float32 keeps them fp32 (measured gain and cost: notes/issue-27.md).
        mixed=False is plain bf16, identical to transformers."""
        self.to(dtype)
        self.residual_dtype = None
        if mixed and dtype != torch.float32:
            head = head_dtype or dtype
            self.embed_tokens.to(head)
            self.lm_head.to(head)
            self.norm.float()
            self.residual_dtype = torch.float32
        return self

    # ---- checkpoint loading -------------------------------------------------------------------------

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load an HF Llama-family state dict (a dict, or a mapping that reads each tensor when asked), fusing
        q/k/v and gate/up. Tensors are copied (cast to each parameter's dtype) one layer at a time, so a lazy
        mapping never holds more than a layer beside the model. Missing or extra tensors are an error."""
        cfg = self.config

        def take(name: str) -> Tensor:
            for key in (f"model.{name}", name):
                if key in state:
                    return state[key]
            raise KeyError(f"checkpoint is missing tensor {name!r}")

        loaded: set[str] = set()

        def put(tensors: dict[str, Tensor]) -> None:
            for name, tensor in tensors.items():
                target = self.get_parameter(name)
                if target.shape != tensor.shape:
                    shapes = f"checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                    raise ValueError(f"tensor {name!r}: {shapes}")
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                loaded.add(name)

        put({"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")})
        if not cfg.tie_word_embeddings:
            put({"lm_head.weight": take("lm_head.weight")})
        for i in range(cfg.num_layers):
            put({f"layers.{i}.{name}": t for name, t in fused_layer_state(cfg, take, f"layers.{i}.").items()})
        expected = set(self.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        if loaded != expected:
            raise KeyError(f"state dict mismatch: {sorted(expected ^ loaded)[:5]}")

    def hf_state_dict(self, skip: Collection[str] = ()) -> dict[str, Tensor]:
        """Inverse of load_hf_state_dict: unfused HF names (for saving and for HF oracles in tests).

        skip: module names ("layers.0.mlp.down_proj", "lm_head", "embed_tokens") whose tensors the caller
        writes itself: left out without reading their ``.weight`` (which a quantized layer would dequantize in
        full, a second copy of the model in fp32)."""
        cfg = self.config
        out = {} if "embed_tokens" in skip else {"model.embed_tokens.weight": self.embed_tokens.weight.detach()}
        out["model.norm.weight"] = self.norm.weight.detach()
        if not cfg.tie_word_embeddings and "lm_head" not in skip:
            out["lm_head.weight"] = self.lm_head.weight.detach()
        for i, layer in enumerate(self.layers):
            inside = {name.removeprefix(f"layers.{i}.") for name in skip if name.startswith(f"layers.{i}.")}
            out.update(unfused_layer_state(cfg, layer, f"model.layers.{i}.", inside))
        return {k: v.contiguous() for k, v in out.items()}


def random_model(config: ModelConfig, seed: int = 0, std: float = 0.1) -> Transformer:
    """A random-weight model for unit tests (norm weights randomised too so a wrong norm shows)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval()
