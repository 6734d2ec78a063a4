"""Tensor parallelism (Megatron-LM style) for runtime.model.Transformer on torch.distributed.

Each rank holds the same module classes built from a *shard config* (its own number of query heads, KV heads
and MLP columns) and loads a slice of the checkpoint into them; the only addition is an all-reduce hook:

- qkv_proj (fused q/k/v) is column-parallel, split by heads: rank r keeps the rows of its query heads and of
  the KV heads those query heads read (GQA groups stay whole), so attention and the KV cache are sharded by
  heads with no communication;
- o_proj is row-parallel: it keeps the matching input columns, and its output (a partial sum over the rank's
  heads) is all-reduced;
- gate_up_proj is column-parallel over the intermediate dimension (rank r keeps gate[i0:i1] and up[i0:i1]);
  down_proj is row-parallel over the same columns, all-reduced;
- embeddings, norms and lm_head are replicated (every rank computes the full logits, so every rank samples
  the same token with no broadcast).

Two all-reduces of [tokens, hidden] per layer per forward. Heads and intermediate columns are split into
contiguous ranges whose sizes differ by at most one KV head group / one column, so a 3-KV-head model runs on
2 ranks; with fewer KV heads than ranks each KV head is replicated on world / Hkv ranks (as vLLM does).
The compiled CPU decode step runs every layer in one C++ call and would skip the hooks, so it is off here.
Quantize after sharding by replacing modules and the hook is lost: shard quantized checkpoints' dense
weights first, or re-register ``all_reduce_outputs`` on the new modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime.config import ModelConfig
from runtime.model import Transformer


class TensorParallelError(ValueError):
    """A model that cannot be split over the requested number of ranks; the message says why."""


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The index-th of `parts` contiguous ranges covering 0..n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    q_heads: tuple[int, int]  # [start, end) of query heads
    kv_heads: tuple[int, int]  # [start, end) of KV heads
    columns: tuple[int, int]  # [start, end) of the MLP intermediate dimension


def plan_shard(config: ModelConfig, rank: int, world: int) -> Shard:
    """Which heads and MLP columns rank `rank` of `world` holds."""
    if world < 1 or not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is not in a world of {world}")
    H, Hkv = config.num_heads, config.num_kv_heads
    group = H // Hkv
    if Hkv >= world:  # whole GQA groups per rank
        kv = split_range(Hkv, world, rank)
        q = (kv[0] * group, kv[1] * group)
    elif world % Hkv == 0 and H % world == 0:  # each KV head replicated on world / Hkv ranks
        q = (rank * H // world, (rank + 1) * H // world)
        kv = (q[0] // group, q[0] // group + 1)
    else:
        raise TensorParallelError(
            f"cannot split {H} query / {Hkv} KV heads over {world} ranks: need KV heads >= ranks, or ranks a "
            f"multiple of KV heads and query heads a multiple of ranks"
        )
    if config.intermediate_size < world:
        raise TensorParallelError(f"intermediate size {config.intermediate_size} < {world} ranks")
    return Shard(rank, world, q, kv, split_range(config.intermediate_size, world, rank))


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's modules: its heads and MLP columns; head_dim and hidden size unchanged."""
    return replace(
        config,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.columns[1] - shard.columns[0],
    )


def shard_hf_state_dict(state: dict[str, Tensor], config: ModelConfig, shard: Shard) -> dict[str, Tensor]:
    """Slice an HF Llama-family state dict (unfused names) to one rank's part; replicated tensors pass through."""
    D = config.head_dim
    (q0, q1), (k0, k1), (c0, c1) = shard.q_heads, shard.kv_heads, shard.columns
    out = {}
    for name, t in state.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            t = t[q0 * D : q1 * D]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "v_proj.weight", "v_proj.bias")):
            t = t[k0 * D : k1 * D]
        elif name.endswith("self_attn.o_proj.weight"):
            t = t[:, q0 * D : q1 * D]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            t = t[c0:c1]
        elif name.endswith("mlp.down_proj.weight"):
            t = t[:, c0:c1]
        out[name] = t.contiguous()
    return out


def all_reduce_outputs(model: Transformer, group=None) -> list:
    """Sum o_proj's and down_proj's outputs over the ranks (their inputs are sharded, so each output is a
    partial sum); returns the hook handles."""

    def hook(module: nn.Module, inputs, output: Tensor) -> Tensor:
        dist.all_reduce(output, group=group)
        return output

    handles = []
    for layer in model.layers:
        handles.append(layer.self_attn.o_proj.register_forward_hook(hook))
        handles.append(layer.mlp.down_proj.register_forward_hook(hook))
    return handles


def build_shard(
    config: ModelConfig,
    state: dict[str, Tensor],
    rank: int,
    world: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    group=None,
) -> Transformer:
    """One rank's Transformer from a full HF state dict: sliced weights in the same classes, hooks on when
    world > 1 (a process group must be initialised)."""
    shard = plan_shard(config, rank, world)
    model = Transformer(shard_config(config, shard))
    model.load_hf_state_dict(shard_hf_state_dict(state, config, shard))
    model = model.set_dtype(dtype).to(device).eval()
    model.fast_decode = False  # the compiled step would bypass the all-reduce hooks
    if world > 1:
        all_reduce_outputs(model, group)
    return model
