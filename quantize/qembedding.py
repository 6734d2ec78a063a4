"""A token embedding that reads its rows from the quantized tied lm_head: one packed tensor serves both.

With tied word embeddings the lm_head weight *is* the embedding table (SmolLM2-135M: 49152 x 576, a fifth of
the model). Quantizing only the head would leave a full-precision copy of the table for the embedding; instead
``QuantEmbedding`` keeps no weights of its own. ``forward(tokens)`` gathers the tokens' rows of codes from the
head's current layout (GPTQ-packed, torch's CPU int4 pack or the int8 group blocks) with their group scales and
zero points, and dequantizes only those rows: groups run along the hidden dim, so each row dequantizes on its
own, bit for bit equal to the same rows of ``head.qweight().dequantize()``. The Transformer then casts them to
its residual dtype, as it does with a dense embedding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quantize.qlinear import QuantLinear


class QuantEmbedding(nn.Module):
    """nn.Embedding stand-in over a QuantLinear lm_head [vocab, hidden]; holds a reference to the head only."""

    def __init__(self, head: QuantLinear):
        super().__init__()
        if not isinstance(head, QuantLinear):
            raise TypeError(f"QuantEmbedding reads a QuantLinear lm_head, got {type(head).__name__}")
        if head.bias is not None:
            raise ValueError("the lm_head has a bias: an embedding cannot share its rows (tied heads have none)")
        head.row_codes(torch.zeros(1, dtype=torch.long, device=head.scales.device))  # fails now if it cannot serve
        # a plain attribute, not a submodule: the model owns the head once (state_dict, .to(), named_modules)
        object.__setattr__(self, "head", head)
        head.serves_rows = True  # its automatic path must keep a layout single rows can be read from
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [...] -> fp32 [..., hidden]."""
        flat = tokens.reshape(-1)
        if flat.is_cpu and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(
                f"token ids must lie in [0, {self.num_embeddings}), got [{int(flat.min())}, {int(flat.max())}]"
            )
        return self.head.dequantize_rows(flat).reshape(*tokens.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole dequantized table in the head's compute dtype (for code that inspects .weight: costs a full
        dequantization; forward never builds it)."""
        return self.head.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the quantized lm_head ({self.head.extra_repr()})"


def tie_quantized_embedding(model) -> QuantEmbedding:
    """Make a tied model's embedding read the rows of its quantized lm_head, dropping the full-precision table.

    Raises ValueError when there is nothing to share: untied embeddings, or an lm_head that is not quantized."""
    if not model.config.tie_word_embeddings:
        raise ValueError(
            "the model's embeddings are not tied (tie_word_embeddings=False): the lm_head has its own weight"
        )
    if not isinstance(model.lm_head, QuantLinear):
        kind = type(model.lm_head).__name__
        raise ValueError(f"the lm_head is not quantized ({kind}); quantize it first (QuantConfig(lm_head=True))")
    head = model.lm_head
    if (head.out_features, head.in_features) != (model.config.vocab_size, model.config.hidden_size):
        raise ValueError(
            f"lm_head is [{head.out_features}, {head.in_features}], the embedding needs "
            f"[{model.config.vocab_size}, {model.config.hidden_size}]"
        )
    model.embed_tokens = QuantEmbedding(head)
    return model.embed_tokens


def shares_quantized_head(model) -> bool:
    """Whether the model's embedding reads its rows from the model's own quantized lm_head."""
    embed = getattr(model, "embed_tokens", None)
    return isinstance(embed, QuantEmbedding) and embed.head is getattr(model, "lm_head", None)
