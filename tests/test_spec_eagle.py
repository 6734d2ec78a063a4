"""EAGLE-style draft head: greedy speculative output identical to plain greedy decoding (tiny random model,
untrained head; a tree wide enough to always accept), the dynamic tree built from the head's own
confidence (checked against the head's distributions computed directly), checkpoint round trip, and the
training loss's windows."""

from __future__ import annotations

import pytest
import torch

from runtime.decoding import generate
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.base import SpecState, SpeculatorError
from speculate.eagle.head import EagleCheckpointError, EagleConfig, EagleHead, load_eagle
from speculate.eagle.speculator import EagleSpeculator
from speculate.eagle.train import eagle_loss, teacher, windowed
from speculate.generate import speculative_generate
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]


def random_head(model, seed: int = 0) -> EagleHead:
    head = EagleHead(EagleConfig.for_model(model))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return head.eval()


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 4], [20, 21, 22, 23, 24, 25, 26]]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", [(3, 3, 2, 6), (2, 96, 1, 192)])
def test_greedy_output_equals_plain(batch, shape):
    depth, topk, frontier, size = shape
    model = random_model(CFG, seed=0)
    prompts = PROMPTS[:batch]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = generate(model, prompts, params).tokens
    spec = EagleSpeculator(model, random_head(model), depth=depth, topk=topk, frontier=frontier, tree_size=size)
    out = speculative_generate(model, prompts, params, spec)
    assert out.tokens == ref
    if size >= topk * (1 + frontier):  # every token is a depth-1 candidate: a draft accepted at every step
        # that offers the tree (a row's last step may withdraw it: deeper than the tokens left, runtime.speculation)
        stats = out.stats
        assert stats.accepted_at[0] == stats.proposed_at[0] >= stats.row_steps - stats.rows > 0


def test_tree_follows_head_confidence():
    model = random_model(CFG, seed=1)
    head = random_head(model, seed=3)
    spec = EagleSpeculator(model, head, depth=2, topk=3, frontier=1, tree_size=4)
    hidden = torch.randn(1, CFG.hidden_size)
    state = SpecState(
        ids=[0], token_ids=[[5, 6, 7]], hidden=hidden, params=[SamplingParams()], generators=[torch.Generator()]
    )
    p = spec.propose(state)
    with torch.no_grad():  # the oracle: the head's distributions computed directly, level by level
        x0 = head.inputs(model.embed_tokens(torch.tensor([7])), hidden)
        lp1 = torch.log_softmax(model.logits(head(x0[None])[0, -1:]), -1)[0]
        top1 = lp1.topk(3)
        o0 = head(x0[None])[0, -1]
        x1 = head.inputs(model.embed_tokens(top1.indices[:1]), o0[None])
        lp2 = torch.log_softmax(model.logits(head(torch.stack([x0, x1], 1))[:, -1]), -1)[0]
        top2 = lp2.topk(3)
    scores = {(r,): float(top1.values[r]) for r in range(3)}
    scores.update({(0, r): float(top1.values[0] + top2.values[r]) for r in range(3)})
    best = sorted(scores, key=lambda c: (-scores[c], len(c)))[:4]
    assert sorted(p.tree.choices[1:]) == sorted(best)
    want = {(r,): int(top1.indices[r]) for r in range(3)} | {(0, r): int(top2.indices[r]) for r in range(3)}
    assert p.tokens[0, 0] == 7
    assert [int(t) for t in p.tokens[0, 1:]] == [want[c] for c in p.tree.choices[1:]]


def test_bad_settings_and_checkpoints(tmp_path):
    model = random_model(CFG, seed=0)
    with pytest.raises(SpeculatorError, match="depth"):
        EagleSpeculator(model, random_head(model), depth=0)
    head = random_head(model)
    head.save(tmp_path / "h")
    loaded = load_eagle(tmp_path / "h", model)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(EagleCheckpointError, match="another model"):
        load_eagle(tmp_path / "h", random_model(CFG, seed=9))
    with pytest.raises(EagleCheckpointError, match="not an EAGLE checkpoint"):
        load_eagle(tmp_path / "missing", model)


def test_training_windows_and_loss():
    x = torch.arange(2 * 11).view(2, 11)
    w = windowed(x, 3, 1)  # offset 1: positions 1..9 in windows of 3
    assert w.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [12, 13, 14], [15, 16, 17], [18, 19, 20]]
    model = random_model(CFG, seed=0)
    model.requires_grad_(False)
    head = random_head(model)
    head.train()
    tokens = torch.randint(2, CFG.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    hidden, logp, subset = teacher(model, tokens, 8)
    assert logp.shape[:2] == (2, 14) and subset is not None and logp.exp().sum(-1).allclose(torch.ones(2, 14))
    loss, top1 = eagle_loss(head, model, tokens, hidden, logp, subset, window=4, offset=0)
    loss.backward()
    assert loss.item() > 0 and len(top1) == 2 and head.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():  # ends: a row whose answer ends at token 1 adds nothing; a full-length end changes nothing
        full = eagle_loss(head, model, tokens, hidden, logp, subset, 4, 0, ends=torch.tensor([14, 14]))[0]
        cut = eagle_loss(head, model, tokens, hidden, logp, subset, 4, 0, ends=torch.tensor([14, 1]))[0]
        alone = eagle_loss(head, model, tokens[:1], hidden[:1], logp[:1], subset, 4, 0)[0]
    assert full.item() == pytest.approx(loss.item(), rel=1e-5) and cut.item() == pytest.approx(alone.item(), rel=1e-5)
