"""quantize.fast_copy's named copies: each name builds the layers and head it says (bits, groups, activations)."""

from __future__ import annotations

import pytest
import torch

from quantize.fast_copy import NAMED_COPIES, named_fast_copy
from quantize.qlinear import QuantLinear
from runtime.model import random_model
from tests.tiny_models import TINY_CONFIGS

EXPECTED = {  # name -> (layer bits, layer group, int8 activations, head bits or None, head int8 activations)
    "int8": (8, -1, False, None, False),
    "int4": (4, 64, False, None, False),
    "int4-int8head": (4, 64, False, 8, False),
    "w8a8": (8, -1, True, None, False),
    "w4a8": (4, 64, True, None, False),
    "w4a8-int8head": (4, 64, True, 8, False),
    "w4a8-w8a8head": (4, 64, True, 8, True),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_copy_layers_and_head(name):
    assert name in NAMED_COPIES
    base = random_model(TINY_CONFIGS["llama"], seed=0)
    bits, group, act, head_bits, head_act = EXPECTED[name]
    copy = named_fast_copy(base, name)
    layer = copy.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.act_quant == act
    qw = layer.qweight()
    assert (qw.bits, qw.group_size) == (bits, layer.in_features if group == -1 else group)  # -1: one group per row
    if head_bits is None:
        assert not isinstance(copy.lm_head, QuantLinear)
    else:  # int8 per channel; bf16 inputs, or int8 ones for a W8A8 head
        assert isinstance(copy.lm_head, QuantLinear) and copy.lm_head.qweight().bits == head_bits
        assert copy.lm_head.act_quant == head_act
    x = torch.randint(0, base.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.isfinite(copy(x)).all()
