"""Block manager and scheduler bookkeeping under thousands of random add/step/finish/cancel operations,
checked exactly after every operation (no model: the "forward" just marks tokens computed)."""

from __future__ import annotations

import random

import pytest

from runtime.paged_cache import BlockManager, chain_hash
from runtime.sampling import SamplingParams
from runtime.scheduler import RequestRejectedError, Scheduler, SchedulerConfig, Sequence, SequenceStatus


def simulate(seed: int, num_ops: int, prefix_caching: bool, chunked: bool, policy: str = "continuous"):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([16, 24, 48]), block_size=rng.choice([1, 2, 4]),
                      enable_prefix_caching=prefix_caching)  # fmt: skip
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([3, 8, 32]),
                        chunked_prefill=chunked, policy=policy, max_model_len=64),
        bm,
    )  # fmt: skip
    live: dict[str, Sequence] = {}
    shared_prefixes = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]  # small vocab: many hits
    counts = {"add": 0, "reject": 0, "finish": 0, "cancel": 0, "preempt": 0, "steps": 0}
    for op_index in range(num_ops):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(shared_prefixes)[: rng.randrange(1, 13)] + [
                rng.randrange(4) for _ in range(rng.randrange(0, 10))
            ]
            seq = Sequence(f"r{op_index}", prompt, len(prompt), SamplingParams(max_tokens=rng.randrange(1, 20)))
            try:
                sched.add(seq)
                live[seq.request_id] = seq
                counts["add"] += 1
            except RequestRejectedError:
                counts["reject"] += 1
        elif op < 0.85:
            out = sched.schedule()
            counts["steps"] += 1
            counts["preempt"] += len(out.preempted)
            scheduled = [w.seq for w in out.work]
            assert len(set(map(id, scheduled))) == len(scheduled), "a sequence was scheduled twice"
            assert out.num_tokens <= sched.config.max_num_batched_tokens
            for w in out.work:
                seq = w.seq
                assert seq.status is SequenceStatus.RUNNING and w.num_tokens >= 1
                end = seq.num_computed_tokens + w.num_tokens
                assert len(seq.block_table) * bm.block_size >= end, "KV slots not allocated for the step"
                samples = w.samples
                seq.num_computed_tokens = end
                bm.register_full_blocks(seq, seq.token_ids, end)
                if samples:
                    seq.token_ids.append(rng.randrange(4))
                    if len(seq.output_ids) >= seq.params.max_tokens:
                        sched.finish(seq, "length")
                        live.pop(seq.request_id)
                        counts["finish"] += 1
        elif live:
            seq = live.pop(rng.choice(sorted(live)))
            sched.finish(seq, "abort")  # cancel, waiting or running
            counts["cancel"] += 1
        bm.check_invariants(live.values())
        for seq in live.values():  # hashes describe exactly the registered prefix of each table
            prev = None
            for i, h in enumerate(seq.block_hashes):
                prev = chain_hash(prev, tuple(seq.token_ids[i * bm.block_size : (i + 1) * bm.block_size]))
                assert h == prev
    # drain: everything finishes, the pool is full again
    while sched.has_unfinished():
        for seq in list(live.values()):
            sched.finish(seq, "abort")
            live.pop(seq.request_id)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_usable_blocks and bm.num_used_blocks == 0
    counts["prefix_hit_tokens"] = bm.prefix_hits
    bm.reset_prefix_cache()
    assert len(bm.free_ids) == bm.num_usable_blocks and not bm.hash_to_block
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_block_invariants(seed):
    counts = simulate(seed, num_ops=1500, prefix_caching=seed % 3 != 2, chunked=seed % 2 == 0,
                      policy="static" if seed == 5 else "continuous")  # fmt: skip
    assert counts["add"] > 50 and counts["steps"] > 500 and counts["finish"] > 10 and counts["cancel"] > 10


def test_random_operations_exercise_preemption_and_prefix_hits():
    totals = {"preempt": 0, "prefix_hit_tokens": 0}
    for seed in range(10, 14):
        counts = simulate(seed, num_ops=800, prefix_caching=True, chunked=True)
        for key in totals:
            totals[key] += counts[key]
    assert totals["preempt"] > 0 and totals["prefix_hit_tokens"] > 0, totals


def test_prefix_hits_compare_token_ids_not_only_hashes():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = Sequence("a", [1, 2, 3, 4, 5], 5, SamplingParams())
    bm.allocate(seq, 5)
    bm.register_full_blocks(seq, seq.token_ids, 4)
    assert bm.match_prefix([1, 2, 3, 4, 9]).num_blocks == 2
    assert bm.match_prefix([1, 2, 3, 4]).num_blocks == 1  # the last token is always recomputed
    bm.blocks[seq.block_table[1]].token_ids = (3, 7)  # a hash collision in disguise: ids differ
    assert bm.match_prefix([1, 2, 3, 4, 9]).num_blocks == 1
    bm.free(seq)
    with pytest.raises(AssertionError, match="double free"):
        seq.block_table = [1]
        bm.free(seq)


def test_lru_evicts_least_recently_freed_cached_block_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    seqs = []
    for i in range(2):
        seq = Sequence(str(i), [10 * i, 10 * i + 1, 10 * i + 2], 3, SamplingParams())
        bm.allocate(seq, 3)
        bm.register_full_blocks(seq, seq.token_ids, 2)
        seqs.append(seq)
    first_prefix_block = seqs[0].block_table[0]
    bm.free(seqs[0])
    bm.free(seqs[1])
    assert bm.num_free_blocks == 4 and len(bm.cached_free) == 2
    fresh = Sequence("x", [7] * 5, 5, SamplingParams())
    bm.allocate(fresh, 6)  # 3 blocks: 2 never-hashed, then the LRU cached one (seq 0's prefix)
    assert first_prefix_block in fresh.block_table
    assert bm.match_prefix([0, 1, 2]).num_blocks == 0 and bm.match_prefix([10, 11, 12]).num_blocks == 1


def test_chunked_long_prompt_does_not_stall_running_decodes():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), bm)
    old = Sequence("old", [1, 2, 3], 3, SamplingParams(max_tokens=50))
    sched.add(old)
    work = sched.schedule().work
    old.num_computed_tokens += work[0].num_tokens
    old.token_ids.append(5)  # now decoding
    long = Sequence("long", list(range(2, 102)), 100, SamplingParams(max_tokens=2))
    newer = Sequence("newer", [7, 8], 2, SamplingParams(max_tokens=50))
    sched.add(long)
    sched.add(newer)
    steps = 0
    while long.num_computed_tokens < 100:
        out = sched.schedule()
        tokens = {w.seq.request_id: w.num_tokens for w in out.work}
        assert out.num_tokens <= 8 and tokens["old"] == 1, tokens  # the decode runs every step
        if newer.status is SequenceStatus.RUNNING and newer.num_uncomputed == 1:
            assert tokens.get("newer") == 1, tokens  # so does a decode admitted after the long prompt
        for w in out.work:
            w.seq.num_computed_tokens += w.num_tokens
            if w.seq.num_computed_tokens == w.seq.num_tokens:
                w.seq.token_ids.append(9)
        steps += 1
    assert steps >= 100 // 8
