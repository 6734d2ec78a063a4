"""Speculative generation end to end on tiny random models, in both loops that speculate through the one
contract (``speculate.generate``'s static batch and the serving engine's continuous batch): greedy output
identical to plain greedy decoding for every lossless speculator (batch 1 and a batch of mixed prompt
lengths), KV bookkeeping of trees, and sampled output distributed as plain sampling from the target
(chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.model import random_model
from runtime.sampling import SamplingParams
from runtime.speculation import SpecState
from speculate.base import SpeculatorError
from speculate.draft import DraftModelSpeculator, layer_skip_draft, quantized_draft
from speculate.draft_vocab import SubsetHead, kept_tokens
from speculate.generate import speculative_generate, tree_metadata
from speculate.lookup_first import LookupFirstSpeculator
from speculate.medusa.heads import MedusaConfig, MedusaHeads
from speculate.medusa.speculator import MedusaSpeculator, build_tree
from speculate.ngram import NgramSpeculator, lookup
from speculate.verify import CandidateTree
from tests.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]
LOOPS = ["generate", "engine"]


def run_loop(loop: str, model, prompts, params, spec, **engine_config) -> tuple[list[list[int]], list[str], float]:
    """(tokens, finish reasons, acceptance rate of the drafted tokens) of one speculative run through `loop`: the static
    batch of speculate.generate, or the serving engine (small blocks and step budget, so requests join and
    leave while others decode). The engine run also checks that every KV block and every per-sequence
    speculator state was released."""
    if loop == "generate":
        out = speculative_generate(model, prompts, params, spec)
        return out.tokens, out.finish_reasons, out.stats.acceptance_rate
    settings = {"kv_cache_bytes": 1 << 22, "block_size": 4, "max_num_batched_tokens": 24, **engine_config}
    engine = LLMEngine(model, config=EngineConfig(**settings), speculator=spec)
    outs = engine.generate(prompts, params)
    assert engine.block_manager.num_used_blocks == 0, "target KV blocks leaked"
    inner = spec.inner if isinstance(spec, LookupFirstSpeculator) else spec
    if isinstance(inner, DraftModelSpeculator):
        assert not inner.seqs and inner.blocks.num_used_blocks == 0, "draft KV state leaked"
    rate = engine.num_spec_accepted / max(engine.num_spec_proposed, 1)
    return [o.output_ids for o in outs], [o.finish_reason for o in outs], rate


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated spans (so n-gram lookup finds matches) of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        span = torch.randint(2, CFG.vocab_size, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen)
        out.append((span.tolist() * (2 + i % 3))[: 5 + 3 * i])
    return out


def random_heads(model, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    cfg = MedusaConfig(num_heads=num_heads, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
    heads = MedusaHeads(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return heads.eval()


def speculators(model, k: int):
    tree = build_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]], size=8)
    every_third = torch.arange(0, CFG.vocab_size, 3)  # a self-draft whose head keeps a third of the tokens
    return {
        "ngram": NgramSpeculator(k=k),
        "ngram-fixed": NgramSpeculator(k=k, scaled=False),
        "draft": DraftModelSpeculator(model, random_model(CFG, seed=5), k=k),
        "layer-skip": DraftModelSpeculator(model, layer_skip_draft(model, 1), k=k),
        "draft+lookup": LookupFirstSpeculator(DraftModelSpeculator(model, random_model(CFG, seed=5), k=k), 2),
        "draft-subset": DraftModelSpeculator(model, model, k=k, head=SubsetHead(model, every_third)),
        "medusa": MedusaSpeculator(model, random_heads(model), tree),
        "medusa-chain": MedusaSpeculator(model, random_heads(model), CandidateTree.chain(3)),
    }


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "name", ["ngram", "ngram-fixed", "draft", "layer-skip", "draft+lookup", "draft-subset", "medusa", "medusa-chain"]
)
def test_greedy_output_equals_plain_greedy(name, loop):
    model = random_model(CFG, seed=0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = repetitive_prompts(4, seed=1)
    plain = generate(model, prompts, params).tokens
    for k in (1, 3):
        spec = speculators(model, k)[name]
        batched, _, accepted = run_loop(loop, model, prompts, params, spec)
        assert batched == plain, (name, k)
        single, _, _ = run_loop(loop, model, prompts[2:3], params, spec)
        assert single[0] == plain[2]
        assert sum(len(t) for t in batched) == 4 * 40
    assert accepted > 0 or name in ("draft", "medusa", "medusa-chain")


def staggered_run(engine: LLMEngine, prompts, params, first: int = 2) -> tuple[list[list[int]], list[str]]:
    """The first requests alone for a few steps, then the rest join: (tokens per request, each step's mode:
    "spec" when it verified drafts, "plain" when it decoded plainly above spec_max_batch, "" otherwise)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:first], params[:first])]
    tokens, modes = {}, []

    def step():
        plain, proposed = engine.num_plain_steps, engine.num_spec_proposed
        for out in engine.step():
            tokens[out.request_id] = out.output_ids
        modes.append(
            "plain" if engine.num_plain_steps > plain else "spec" if engine.num_spec_proposed > proposed else ""
        )

    for _ in range(6):
        step()
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[first:], params[first:])]
    while engine.has_unfinished():
        step()
    return [tokens[i] for i in ids], modes


@pytest.mark.parametrize("name", ["ngram", "draft", "draft+lookup", "medusa"])
def test_engine_decodes_plainly_above_spec_max_batch(name):
    """spec_max_batch = 2: two requests speculate, three more join and every step with more than 2 decoding
    requests is a plain batched step, then speculation resumes as they finish. Greedy output stays plain greedy
    decoding's, and the speculator's per-request state is released."""
    model = random_model(CFG, seed=0)
    prompts = repetitive_prompts(5, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 50, 14, 12, 10)]
    plain = [generate(model, [p], sp).tokens[0] for p, sp in zip(prompts, params)]
    settings = {"kv_cache_bytes": 1 << 22, "block_size": 4, "max_num_batched_tokens": 24, "spec_max_batch": 2}
    spec = speculators(model, 3)[name]
    engine = LLMEngine(model, config=EngineConfig(**settings), speculator=spec)
    tokens, modes = staggered_run(engine, prompts, params)
    assert tokens == plain
    assert "spec" in modes[:6] and "plain" in modes and "spec" in modes[modes.index("plain") :], modes
    assert engine.block_manager.num_used_blocks == 0
    inner = spec.inner if isinstance(spec, LookupFirstSpeculator) else spec
    if isinstance(inner, DraftModelSpeculator):
        assert not inner.seqs and inner.blocks.num_used_blocks == 0


def test_draft_catches_up_after_plain_steps():
    """A draft identical to the target (fp32) has every draft accepted only if, after plain batched steps (above
    spec_max_batch), it catches up on the tokens it did not see: its proposals are then the target's own greedy
    tokens, where a draft that skipped them would be rejected. (64-token draft blocks: its first pool holds every
    row, so it catches up by feeding the missed tokens, not by a rebuilt pool's fresh prefill.)"""
    model = random_model(CFG, seed=0)
    prompts = repetitive_prompts(5, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 50, 14, 12, 10)]
    settings = {"kv_cache_bytes": 1 << 22, "block_size": 4, "max_num_batched_tokens": 24, "spec_max_batch": 2}
    spec = DraftModelSpeculator(model, model, k=3, block_size=64)
    engine = LLMEngine(model, config=EngineConfig(**settings), speculator=spec)
    tokens, modes = staggered_run(engine, prompts, params)
    assert tokens == [generate(model, [p], sp).tokens[0] for p, sp in zip(prompts, params)]
    assert "spec" in modes[:6] and "plain" in modes and "spec" in modes[modes.index("plain") :], modes
    assert engine.num_spec_proposed > 0 and engine.num_spec_accepted == engine.num_spec_proposed


@pytest.mark.parametrize("loop", LOOPS)
def test_greedy_stops_like_plain_decoding(loop):
    """EOS (token 1 here) and max_tokens end each row at the same token as plain decoding, mid-acceptance."""
    model = random_model(CFG, seed=3)
    prompts = repetitive_prompts(4, seed=2)
    for params in (SamplingParams(max_tokens=60), SamplingParams(max_tokens=60, stop_token_ids=[7, 9, 11])):
        plain = generate(model, prompts, params)
        for spec in speculators(model, 3).values():
            tokens, reasons, _ = run_loop(loop, model, prompts, params, spec)
            assert tokens == plain.tokens and reasons == plain.finish_reasons


@pytest.mark.parametrize("loop", LOOPS)
def test_quant_draft_greedy_and_acceptance(loop):
    model = random_model(CFG, seed=0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = repetitive_prompts(3, seed=4)
    plain = generate(model, prompts, params).tokens
    spec = DraftModelSpeculator(model, quantized_draft(model, bits=8, group_size=32), k=3, name="quant-draft")
    tokens, _, acceptance = run_loop(loop, model, prompts, params, spec)
    assert tokens == plain
    assert acceptance > 0.8  # an int8 copy of the target agrees with it almost always


def seeded_run(loop: str, name: str | None, model, prompts, params) -> list[list[int]]:
    """Sampled tokens per prompt: plain decoding (name None: runtime.generate or the engine without a
    speculator) or speculative decoding with a fresh speculator `name` in `loop`."""
    if name is None and loop == "generate":
        return generate(model, prompts, params).tokens
    if name is None:
        return [
            o.output_ids
            for o in LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 22)).generate(prompts, params)
        ]
    if name == "medusa-typical":
        tree = build_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]], size=8)
        spec = MedusaSpeculator(model, random_heads(model), tree, acceptance="typical")
    else:
        spec = speculators(model, 3)[name]
    return run_loop(loop, model, prompts, params, spec)[0]


@pytest.mark.parametrize("name", [None, "ngram", "draft", "medusa", "medusa-chain", "medusa-typical"])
def test_seeded_request_gives_the_same_sample_alone_in_any_batch_and_in_every_loop(name):
    """One request (prompt, params, seed) among batch mates with other seeds, other params (a greedy one) and
    other lengths, in two orders, and alone: the same sampled tokens in each, and the same in both loops."""
    model = random_model(CFG, seed=0, std=0.3)  # peaked enough that drafts get accepted
    prompts = repetitive_prompts(5, seed=7)
    mine = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    mates = [SamplingParams(temperature=1.0, seed=i, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(5)]
    mates[1] = SamplingParams(max_tokens=30, ignore_eos=True)  # a greedy mate
    batch = mates[:3] + [mine] + mates[4:]
    got = {}
    for loop in LOOPS:
        alone = seeded_run(loop, name, model, [prompts[3]], [mine])[0]
        together = seeded_run(loop, name, model, prompts, batch)[3]
        reordered = seeded_run(loop, name, model, prompts[::-1], batch[::-1])[1]
        assert together == alone and reordered == alone, loop
        got[loop] = alone
    assert got["generate"] == got["engine"]
    assert len(set(got["generate"])) > 3  # really sampled
    plain = seeded_run("generate", None, model, [prompts[3]], [mine])[0]
    if name in ("medusa", "medusa-chain"):  # tree verification draws once per committed token, as plain sampling
        assert got["generate"] == plain
    elif name is not None:  # chain verification draws differently (acceptance tests, residuals): another sample
        assert got["generate"] != plain


@pytest.mark.parametrize("name", ["draft", "medusa"])
def test_engine_preemption_keeps_seeded_samples(name):
    """A KV pool so small that the engine preempts and recomputes sequences: each request's sampled tokens
    equal those of the static loop (the recomputed last token is fed to the next speculative step, nothing
    is drawn twice)."""
    model = random_model(CFG, seed=0, std=0.3)
    prompts = repetitive_prompts(6, seed=8)
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=30, ignore_eos=True) for i in range(6)]
    expected = speculative_generate(model, prompts, params, speculators(model, 3)[name]).tokens
    engine = LLMEngine(model, config=EngineConfig(num_blocks=24, block_size=4), speculator=speculators(model, 3)[name])
    assert [o.output_ids for o in engine.generate(prompts, params)] == expected
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_used_blocks == 0


def test_engine_keeps_draft_state_per_request_and_frees_it():
    """The draft model's KV lives per request id in the engine: built at the request's first speculative step,
    freed when it finishes or is aborted (its blocks back in the draft's pool)."""
    model = random_model(CFG, seed=0)
    spec = speculators(model, 3)["draft"]
    engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 22, block_size=4), speculator=spec)
    prompts = repetitive_prompts(3, seed=9)
    a = engine.add_request(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True))
    b = engine.add_request(prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # prefill and first tokens: no draft state yet
    assert not spec.seqs
    engine.step()
    assert set(spec.seqs) == {a, b} and spec.blocks.num_used_blocks > 0
    engine.abort_request(a)
    assert set(spec.seqs) == {b}
    c = engine.add_request(prompts[2], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert not spec.seqs and spec.blocks.num_used_blocks == 0
    assert c not in engine.seqs


def test_draft_prefill_hook_gives_the_lazy_proposals():
    """DraftModelSpeculator.prefill (called by the static loop before its decode clock) writes the draft's prompt
    KV; the proposals after it equal those of a speculator that prefills lazily inside its first propose()."""
    model = random_model(CFG, seed=0)
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0.8, seed=3)
    state = lambda: SpecState(  # noqa: E731
        ids=[0, 1, 2], token_ids=prompts, hidden=None, params=[params] * 3,
        generators=[torch.Generator().manual_seed(7 + b) for b in range(3)],
    )  # fmt: skip
    draft = random_model(CFG, seed=5)
    eager, lazy = DraftModelSpeculator(model, draft, k=3), DraftModelSpeculator(model, draft, k=3)
    eager.prefill(state())
    assert [eager.seqs[b].committed for b in range(3)] == [len(p) - 1 for p in prompts]
    a, b = eager.propose(state()), lazy.propose(state())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.draft_probs, b.draft_probs)  # the same draft calls
    calls = []
    spec = DraftModelSpeculator(model, draft, k=3)
    spec.prefill = lambda st: calls.append([len(t) for t in st.token_ids])  # the loop's hook, once, before steps
    speculative_generate(model, prompts, SamplingParams(max_tokens=6, ignore_eos=True), spec)
    assert calls == [[len(p) + 1 for p in prompts]]  # prompt + the prefill's first token


def test_stats_are_consistent():
    model = random_model(CFG, seed=0)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    out = speculative_generate(model, repetitive_prompts(2, seed=6), params, NgramSpeculator(k=4))
    s = out.stats
    assert s.generated == 60
    # each step commits accepted + 1 per row, except that a row's last step may be cut short by max_tokens
    assert 0 <= s.accepted + s.row_steps - (s.generated - s.rows) <= s.rows * 4
    assert s.proposed_at[0] >= s.proposed_at[-1] and s.accepted_at[0] >= s.accepted_at[-1]
    assert sum(s.accepted_at) == s.accepted
    assert s.mean_tokens_per_step <= 1 + s.mean_accepted_per_step + 1e-12  # float division in both


def test_tree_metadata_positions_slots_and_mask():
    tree = CandidateTree.from_choices([(0,), (1,), (0, 0)])  # root; a, b children; c under a
    meta = tree_metadata(tree, torch.tensor([5, 3]))
    assert meta.positions.tolist() == [[4, 5, 5, 6], [2, 3, 3, 4]]
    assert meta.slots.tolist() == [[4, 5, 6, 7], [2, 3, 4, 5]]
    assert meta.kv_len == 8
    m = meta.mask[:, 0]
    assert m[0, 3].tolist() == [True] * 4 + [True, True, False, True]  # c sees prefix, root, a, itself
    assert m[0, 2].tolist() == [True] * 4 + [True, False, True, False]  # b sees prefix, root, itself
    assert m[1, 0].tolist() == [True, True, True, False, False, False, False, False]  # row 1 root


def test_ngram_lookup():
    seq = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])
    assert lookup(seq, 3, 3, 1).tolist() == [8, 9, 5]  # '5 6 7' matched at 0
    assert lookup(torch.tensor([1, 2, 3, 4]), 3, 3, 1).tolist() == []  # nothing repeats
    assert lookup(torch.tensor([4, 1, 2, 4, 1, 3, 4]), 2, 3, 1).tolist() == [1, 3]  # latest occurrence of 4
    # scaled: an n-token match drafts at most 2**n tokens
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 2, 3])
    assert lookup(seq, 8, 3, 1, scaled=True).tolist() == [4, 5, 6, 7, 8, 9, 9, 1]  # '1 2 3' -> 8 tokens
    assert lookup(seq, 8, 3, 1, scaled=False).tolist() == [4, 5, 6, 7, 8, 9, 9, 1]
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 3])
    assert lookup(seq, 8, 3, 1, scaled=True).tolist() == [4, 5]  # a one-token match drafts 2
    assert lookup(seq, 8, 3, 1, scaled=False).tolist() == [4, 5, 6, 7, 8, 9, 3]


def test_lookup_first_drafts_by_lookup_where_it_matches_and_asks_the_draft_only_for_the_rest():
    """Row 0 repeats its last two tokens (lookup drafts what followed them, q one-hot, no draft forward for it);
    row 1 repeats nothing (its drafts and q are exactly the draft model's proposal for it alone)."""
    model = random_model(CFG, seed=0)
    draft = DraftModelSpeculator(model, random_model(CFG, seed=5), k=3)
    spec = LookupFirstSpeculator(draft, min_ngram=2)
    seqs = [[9, 4, 7, 8, 5, 4, 7], [2, 3, 4, 5, 6]]
    state = SpecState(["a", "b"], seqs, None, [SamplingParams(temperature=1.0)] * 2,
                      [torch.Generator().manual_seed(s) for s in (1, 2)])  # fmt: skip
    fed = []
    original = draft._forward
    draft._forward = lambda rows, feeds, index: fed.append(feeds) or original(rows, feeds, index)
    got = spec.propose(state)
    assert got.drafted() == [3, 3]
    assert got.tokens[0].tolist() == [8, 5, 4]  # '4 7' occurred at 1: what followed it, up to min(k, 2**2)
    assert torch.equal(got.draft_probs[0], torch.nn.functional.one_hot(got.tokens[0], CFG.vocab_size).float())
    assert all(len(f) == 1 for f in fed) and "a" not in draft.seqs  # the draft saw row 1 alone
    alone = DraftModelSpeculator(model, random_model(CFG, seed=5), k=3)
    ref = alone.propose(SpecState(["b"], seqs[1:], None, [SamplingParams(temperature=1.0)],
                                  [torch.Generator().manual_seed(2)]))  # fmt: skip
    assert torch.equal(got.tokens[1], ref.tokens[0]) and torch.equal(got.draft_probs[1], ref.draft_probs[0])
    # the proposals by source (the cost model prices lookups and model drafts apart): row 0 by lookup, row 1 by the
    # draft model with its 3 drafts; then one call where both rows ask the draft
    assert spec.sources() == {"lookup_rows": 1, "model_rows": 1, "model_drafted": 3}
    spec.propose(SpecState(["c", "d"], [[1, 2, 3], [5, 6, 7]], None, [SamplingParams(temperature=1.0)] * 2,
                           [torch.Generator().manual_seed(s) for s in (3, 4)]))  # fmt: skip
    assert spec.sources() == {"lookup_rows": 1, "model_rows": 3, "model_drafted": 9} and draft.sources() == {}
    with pytest.raises(SpeculatorError, match="chain"):
        LookupFirstSpeculator(MedusaSpeculator(model, random_heads(model), build_tree([[0.5]], 2)))


def test_bad_inputs_give_clear_errors():
    model = random_model(CFG, seed=0)
    other_vocab = random_model(TINY_CONFIGS["llama-tied-mha"], seed=0)  # 80 tokens vs 96
    with pytest.raises(SpeculatorError, match="vocabulary"):
        DraftModelSpeculator(model, other_vocab, k=2)
    for k in (0, -1):
        with pytest.raises(SpeculatorError, match="k must be an integer >= 1"):
            NgramSpeculator(k=k)
        with pytest.raises(SpeculatorError, match="k must be an integer >= 1"):
            DraftModelSpeculator(model, layer_skip_draft(model, 1), k=k)
    with pytest.raises(SpeculatorError, match="layer-skip draft needs"):
        layer_skip_draft(model, CFG.num_layers)
    with pytest.raises(SpeculatorError, match="exceeds the 2 Medusa heads"):
        MedusaSpeculator(model, random_heads(model, num_heads=2), CandidateTree.chain(3))


def test_medusa_checkpoint_for_another_model_is_refused(tmp_path):
    from speculate.medusa.heads import MedusaCheckpointError, load_medusa, model_fingerprint

    model = random_model(CFG, seed=0)
    heads = random_heads(model)
    heads.config.base_fingerprint = model_fingerprint(model)
    heads.save(tmp_path / "heads")
    loaded = load_medusa(tmp_path / "heads", model)
    h = torch.randn(2, CFG.hidden_size)
    assert torch.equal(loaded(h, model.lm_head), heads(h, model.lm_head))
    same_shape_other_weights = random_model(CFG, seed=1)
    with pytest.raises(MedusaCheckpointError, match="trained for another model"):
        load_medusa(tmp_path / "heads", same_shape_other_weights)
    with pytest.raises(MedusaCheckpointError, match="hidden size"):
        load_medusa(tmp_path / "heads", random_model(TINY_CONFIGS["llama-tied-mha"], seed=0))
    with pytest.raises(MedusaCheckpointError, match="not a Medusa checkpoint"):
        load_medusa(tmp_path / "missing", model)


def test_build_tree_is_best_first_and_prefix_closed():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    tree = build_tree(acc, size=5)
    # scores: (0)=.6 (0,0)=.3 (1)=.2 (0,0,0)=.12 (0,1)=.12 (2)=.1 ...
    assert set(tree.choices[1:]) == {(0,), (0, 0), (1,), (0, 0, 0), (0, 1)}
    assert len(build_tree(acc, size=30)) == 31


def test_build_tree_prefers_measured_paths_over_the_product_of_marginals():
    """Heads right on the same positions: the measured path (0, 0, 0) beats (1,) and (2,), which the product of
    marginals (0.6 x 0.5 x 0.4 = 0.12 < 0.2) ranks above it."""
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    paths = [[[0], 0.6], [[0, 0], 0.5], [[0, 0, 0], 0.4], [[1], 0.2], [[2], 0.1], [[0, 1], 0.05]]
    tree = build_tree(acc, size=3, paths=paths)
    assert tree.choices[1:] == [(0,), (0, 0), (0, 0, 0)]
    assert set(build_tree(acc, size=3).choices[1:]) == {(0,), (0, 0), (1,)}
    assert build_tree(acc, size=2, max_depth=1, paths=paths).choices[1:] == [(0,), (1,)]
    assert len(build_tree(acc, size=10, paths=paths)) == 11  # more nodes than measured paths: the marginals


def test_held_out_tables_equal_a_count_by_hand():
    """accuracy and joint path frequencies of random heads on random hidden states, against loops over positions;
    row 1 ends its answer at position 5 (an end-of-turn token): predictions of later tokens do not count."""
    from speculate.medusa.train import MAX_TOP, held_out_tables
    from speculate.training import answer_ends

    cfg = TINY_CONFIGS["llama"]
    model = random_model(cfg, seed=2)
    heads = random_heads(model, num_heads=2)
    hidden = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    eos = model.config.eos_token_ids[0]
    other = next(t for t in range(cfg.vocab_size) if t not in model.config.eos_token_ids)
    tokens = torch.full((2, 9), other)
    tokens[0, 0] = eos  # position 0 (the prompt's last token) never ends an answer
    tokens[1, 5] = eos
    ends = answer_ends(tokens, model.config.eos_token_ids)
    assert ends.tolist() == [9, 5]
    accuracy, paths = held_out_tables(heads, model, [(tokens[:1], hidden[:1]), (tokens[1:], hidden[1:])])
    target = model.logits(hidden).argmax(-1)
    order = heads(hidden, model.lm_head).argsort(-1, descending=True)  # [K, B, T, V]
    K, T = 2, hidden.shape[1]

    def rank(k, b, t):  # head k's rank of the target's token t + 1 + k (MAX_TOP: not in its top, or past the end)
        if t + 1 + k > ends[b]:
            return MAX_TOP
        r = order[k - 1, b, t].tolist().index(int(target[b, t + k]))
        return r if r < MAX_TOP else MAX_TOP

    for k in (1, 2):
        valid = [(b, t) for b in range(2) for t in range(T - k) if t + 1 + k <= ends[b]]
        for i in range(MAX_TOP):
            assert accuracy[k - 1][i] == pytest.approx(sum(rank(k, b, t) == i for b, t in valid) / len(valid))
    counts: dict = {}
    positions = [(b, t) for b in range(2) for t in range(T - K) if t + 2 <= ends[b]]
    for b, t in positions:
        r = (rank(1, b, t), rank(2, b, t))
        for d in (1, 2):
            if r[d - 1] == MAX_TOP:
                break
            counts[r[:d]] = counts.get(r[:d], 0) + 1
    assert {tuple(p): v for p, v in paths} == pytest.approx({p: n / len(positions) for p, n in counts.items()})
    assert all(tuple(p[:-1]) in {tuple(q) for q, _ in paths[:i]} for i, (p, _) in enumerate(paths) if len(p) > 1)


# ---- end-to-end distribution: speculative sampling vs plain sampling of the target ---------------------

SMALL = TINY_CONFIGS["llama"]


# the engine runs 4000 requests (~20-26 s each on AVX2): its cases run under -m slow. By default the static loop
# covers all three, and test_spec_seeds_default_model ties the engine to it (a seeded sampled n-gram request draws
# the same tokens in the engine as in the static loop; both call the one verifier)
@pytest.mark.parametrize(
    "kind,loop",
    [
        pytest.param(k, loop, marks=pytest.mark.slow) if loop == "engine" else (k, loop)
        for k in ["draft", "draft+lookup", "draft-subset", "medusa"]
        for loop in LOOPS
    ],
)
def test_sampled_two_token_continuations_match_plain_sampling(kind, loop):
    """Temperature 1, a tiny random target and a different tiny draft (or random Medusa heads, or the draft behind
    prompt lookup: the prompt ends with a token it holds earlier, so the first step drafts by lookup and the next
    one mixes lookup rows and draft rows, by each row's first token). The target's
    exact two-token distribution is computed by enumeration (V + 1 forwards); 4000 speculative runs in one
    batch (the engine: 4000 requests) are compared by chi-square (cells with expected count < 5 pooled).
    draft-subset: the draft's head over half the vocabulary (speculate.draft_vocab; q is zero elsewhere).
    alpha = 1e-3 per test, eight tests: false-failure rate <= 0.8% per fresh seed (the seeds are fixed)."""
    from runtime.model import Transformer

    cfg = SMALL
    target = random_model(cfg, seed=11, std=0.3)  # std 0.3: peaked enough that 2-token cells are populated
    prompt = [3, 17, 42, 3] if kind == "draft+lookup" else [3, 17, 42, 5]
    # max_tokens 4: the step after the first token may draft k = 2 (drafts never run past max_tokens); the
    # first two tokens are compared. One seed per row: rows with one seed would draw identically.
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=123 + i) for i in range(4000)]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1].double(), -1)  # [V]
        seqs = torch.tensor([prompt + [t] for t in range(cfg.vocab_size)])
        p2 = torch.softmax(target(seqs)[:, -1].double(), -1)  # [V, V]
    joint = (p1[:, None] * p2).flatten()
    if kind.startswith("draft"):
        draft = random_model(cfg, seed=12, std=0.3)
        kept = torch.arange(0, cfg.vocab_size, 2)  # the target's likely tokens are drafted only where even
        head = SubsetHead(draft, kept) if kind == "draft-subset" else None
        spec = DraftModelSpeculator(target, draft, k=2, head=head)
        spec = LookupFirstSpeculator(spec, min_ngram=1) if kind == "draft+lookup" else spec
    else:
        spec = MedusaSpeculator(
            target, random_heads(target, num_heads=2, seed=3), build_tree([[0.5, 0.3], [0.5, 0.3]], 4)
        )
    n = 4000
    engine = {"max_num_seqs": n, "max_num_batched_tokens": 8 * n, "num_blocks": 2 * n + 1, "block_size": 8}
    tokens, _, acceptance = run_loop(loop, target, [prompt] * n, params, spec, **engine)
    pairs = torch.tensor([t[0] * cfg.vocab_size + t[1] for t in tokens])
    counts = torch.bincount(pairs, minlength=joint.numel()).double()
    expected = joint * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert acceptance > 0  # speculation actually happened
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-3
    assert isinstance(target, Transformer)


def test_cli_bad_input_exits_with_one_clear_error(capsys, tmp_path):
    from argparse import Namespace

    from evals.speculation.bench_spec import BenchError, parse_method
    from speculate.cli import build_speculator, generate_speculative

    model = random_model(CFG, seed=0)
    args = Namespace(speculator="ngram", num_speculative_tokens=0, draft_model=None, medusa_heads=None)
    with pytest.raises(SystemExit) as exit_info:
        generate_speculative(model, tmp_path, None, [[1, 2]], SamplingParams(), args)
    assert exit_info.value.code == 2
    assert "k must be an integer >= 1, got 0" in capsys.readouterr().err
    args = Namespace(speculator="medusa", num_speculative_tokens=2, draft_model=None, medusa_heads=str(tmp_path))
    with pytest.raises(SystemExit):
        generate_speculative(model, tmp_path, None, [[1, 2]], SamplingParams(), args)
    assert "not a Medusa checkpoint" in capsys.readouterr().err
    with pytest.raises(SpeculatorError, match="unknown speculator 'eagel'"):
        build_speculator("eagel", model)
    with pytest.raises(ValueError, match=r"not an EAGLE checkpoint .* `python -m speculate\.eagle\.train`"):
        build_speculator("eagle", model, tmp_path / "model")  # no head trained for this model
    with pytest.raises(SpeculatorError, match="typical acceptance is a Medusa mode"):
        build_speculator("ngram", model, acceptance="typical")
    with pytest.raises(SpeculatorError, match="expected layers:N"):
        build_speculator("draft", model, draft_model="layers:x")
    with pytest.raises(BenchError, match="unknown speculator 'ngrm' in method 'ngrm:k=2'"):
        parse_method("ngrm:k=2")
    with pytest.raises(BenchError, match="must be an integer"):
        parse_method("ngram:k=two")


@pytest.mark.parametrize("name", ["ngram", "draft", "medusa"])
def test_samples_of_one_prompt_share_its_prefill_and_equal_each_run_alone(name):
    """n seeded samples of one prompt (one prefill, each row's cache a copy: speculate.generate.prefill_rows) give
    each row the tokens it gets alone."""
    model = random_model(CFG, seed=0, std=0.3)
    prompt = repetitive_prompts(4, seed=3)[3]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(6)]
    spec = speculators(model, 3)[name]
    together = speculative_generate(model, [prompt] * len(params), params, spec).tokens
    assert together == [speculative_generate(model, [prompt], [p], spec).tokens[0] for p in params]
    assert len({tuple(t) for t in together}) > 1  # really sampled


def test_a_request_with_one_token_left_takes_a_plain_step_under_a_limit():
    """With spec_max_batch set, a request that may add only one more token has nothing to draft: it decodes
    plainly instead of asking the speculator (whose draft would first prefill the whole request). Without a limit
    it still verifies, so seeded draws stay those of the static loop."""
    model = random_model(CFG, seed=0)
    prompt, params = repetitive_prompts(1, seed=4)[0], SamplingParams(max_tokens=2, ignore_eos=True)
    for limit, asked in ((4, False), (None, True)):
        spec = speculators(model, 3)["draft"]
        calls = []
        real = spec.propose
        spec.propose = lambda state, calls=calls, real=real: calls.append(len(state.ids)) or real(state)
        engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 22, spec_max_batch=limit), speculator=spec)
        assert engine.generate([prompt], params)[0].output_ids == generate(model, [prompt], params).tokens[0]
        assert bool(calls) is asked, (limit, calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subset_head_of_a_quantized_head_keeps_its_codes(dtype):
    """A quantized draft's int8 head (speculate.draft.quantized_draft) restricted to kept ids stays quantized: the
    kept rows' codes and scales, whose logits are the full quantized head's there (not a dequantized copy's)."""
    from quantize.qlinear import QuantLinear
    from speculate.draft import quantized_draft

    base = random_model(CFG, seed=0)
    draft = quantized_draft(base if dtype == torch.float32 else base.set_dtype(dtype), 4, group_size=32, head_bits=8)
    kept = torch.tensor([1, 5, 6, 40, 95])
    head = SubsetHead(draft, kept)
    assert isinstance(head.head, QuantLinear) and head.head.bits == 8
    assert torch.equal(head.head.codes, draft.lm_head.codes[kept])
    h = torch.randn(3, CFG.hidden_size)
    full, part = draft.logits(h), head.logits(h)
    torch.testing.assert_close(part[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    rest = torch.ones(CFG.vocab_size, dtype=torch.bool)
    rest[kept] = False
    assert bool(torch.isneginf(part[:, rest]).all())


def test_subset_head_keeps_its_tokens_logits_and_rules_out_the_rest():
    """The draft's head over kept ids equals its full head there (the same rows; summation order may differ with
    the matmul's width) and gives -inf elsewhere, so its q is zero outside; kept_tokens keeps the special ids and
    the most frequent, sorted."""
    model = random_model(CFG, seed=0)
    kept = torch.tensor([1, 5, 6, 40, 95])
    head = SubsetHead(model, kept)
    h = torch.randn(3, CFG.hidden_size)
    full, part = model.logits(h), head.logits(h)
    assert part.shape == full.shape
    torch.testing.assert_close(part[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    rest = torch.ones(CFG.vocab_size, dtype=torch.bool)
    rest[kept] = False
    assert bool(torch.isneginf(part[:, rest]).all())
    ranking = torch.tensor([7, 3, 9, 0, 1, 2, 4, 5, 6, 8])
    assert kept_tokens(ranking, 4, 10, always=[8]).tolist() == [3, 7, 8, 9]
    assert kept_tokens(ranking, 3, 6, always=[2, 99]).tolist() == [0, 2, 3]  # ids past the head dropped
    with pytest.raises(ValueError, match="1..9 tokens"):
        kept_tokens(ranking, 10, 10, always=[])
