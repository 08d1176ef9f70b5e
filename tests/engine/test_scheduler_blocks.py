"""Block manager + scheduler without a model: random add / abort / finish / step sequences
never leak a block, keep ref counts equal to the live block tables, and prefix-cache hits
serve blocks whose tokens equal the sequence's own."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moet.engine.block_manager import BlockManager
from moet.engine.scheduler import Scheduler
from moet.engine.sequence import Sequence, SequenceStatus
from moet.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=64)


def make(bm_blocks=12, bs=4, seqs=3, tokens=16, chunked=True, caching=True):
    bm = BlockManager(bm_blocks, bs, enable_prefix_caching=caching)
    return bm, Scheduler(bm, max_num_seqs=seqs, max_num_batched_tokens=tokens, enable_chunked_prefill=chunked)


def step(sched: Scheduler, rng: random.Random, vocab: int, contents: dict) -> list[Sequence]:
    """Schedule, 'compute' (record which tokens each block holds), sample a random token for
    sampling sequences; returns the sequences that hit their length limit (finished here)."""
    out = sched.schedule()
    bs = sched.bm.block_size
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    ones = [s.num_new_tokens == 1 for s in out.scheduled]
    assert ones == sorted(ones, reverse=True), "decodes must lead the batch"
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
    done = []
    for s in out.scheduled:
        seq = s.seq
        assert seq.status == SequenceStatus.RUNNING and s.num_new_tokens >= 1
        assert len(seq.block_table) * bs >= seq.num_computed_tokens + s.num_new_tokens
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens):
            b = seq.block_table[p // bs]
            # never write into a block someone else shares
            assert sched.bm.ref_count[b] == 1, "write into a shared block"
            contents[(b, p % bs)] = seq.token_ids[p]
        # everything the sequence reads is its own token history
        for p in range(seq.num_computed_tokens):
            assert contents.get((seq.block_table[p // bs], p % bs)) == seq.token_ids[p], "prefix cache served wrong KV"
        samples = s.samples
        seq.num_computed_tokens += s.num_new_tokens
        sched.bm.commit_full_blocks(seq)
        if samples:
            seq.append_token(rng.randrange(vocab))
            if seq.num_output_tokens >= seq.max_new_tokens:
                done.append(seq)
    for seq in done:
        sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return done


def live(sched):
    return list(sched.running) + list(sched.waiting)


@settings(max_examples=300)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_random_operations_leak_nothing(seed, chunked, caching):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    max_len = 24
    blocks = rng.randint(-(-max_len // bs), 3 * -(-max_len // bs))
    bm, sched = make(blocks, bs, seqs=rng.randint(1, 4), tokens=rng.randint(4, 32) if chunked else max_len,
                     chunked=chunked, caching=caching)
    vocab = rng.choice([2, 5, 50])         # small vocabularies make prefix hits common
    contents: dict = {}
    next_id = 0
    for _ in range(rng.randint(20, 120)):
        op = rng.random()
        if op < 0.3:
            plen = rng.randint(1, max_len - 1)
            prompt = [rng.randrange(vocab) for _ in range(plen)]
            sched.add(Sequence(next_id, str(next_id), 0, prompt, SP, rng.randint(1, max_len - plen)))
            next_id += 1
        elif op < 0.4 and live(sched):
            sched.finish(rng.choice(live(sched)), SequenceStatus.FINISHED_ABORTED)
        elif op < 0.45 and sched.running:
            sched.finish(rng.choice(sched.running), SequenceStatus.FINISHED_STOPPED)
        else:
            step(sched, rng, vocab, contents)
        bm.check(live(sched))
    # drain: everything left finishes
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        step(sched, rng, vocab, contents)
        bm.check(live(sched))
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_count)


def test_preemption_recomputes_and_still_finishes():
    bm, sched = make(bm_blocks=6, bs=4, seqs=3, tokens=64)
    rng = random.Random(0)
    seqs = [Sequence(i, str(i), 0, [i] * 5, SP, 12) for i in range(3)]   # 17 tokens = 5 blocks each
    for s in seqs:
        sched.add(s)
    contents = {}
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched, rng, 7, contents)
        bm.check(live(sched))
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 and s.status == SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert bm.num_free_blocks == 6


def test_prefix_cache_hits_full_blocks_only_and_counts_them():
    bm, sched = make(bm_blocks=16, bs=4, seqs=4, tokens=64)
    rng = random.Random(1)
    contents = {}
    a = Sequence(0, "a", 0, list(range(10)), SP, 5)
    sched.add(a)
    step(sched, rng, 7, contents)              # prefill 10 tokens -> 2 full blocks registered
    b = Sequence(1, "b", 0, list(range(9)) + [99], SP, 1)   # shares 9 tokens = 2 full blocks
    c = Sequence(2, "c", 0, list(range(8)), SP, 1)          # exactly 2 blocks: only 1 may hit
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    got = {s.seq.request_id: (s.context_len, s.num_new_tokens) for s in out.scheduled}
    assert got["b"] == (8, 2) and got["c"] == (4, 4)
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[0] == a.block_table[0]
    assert bm.ref_count[a.block_table[0]] == 3
    assert bm.prefix_hits == 12 and bm.prefix_queries == 10 + 10 + 8
    assert bm.prefix_hit_rate == pytest.approx(12 / 28)


def test_without_chunked_prefill_a_prompt_is_never_split():
    bm, sched = make(bm_blocks=32, bs=4, seqs=4, tokens=12, chunked=False)
    for i, n in enumerate([8, 8, 3]):
        sched.add(Sequence(i, str(i), 0, [i] * n, SP, 4))
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [8]     # the second 8 does not fit in 4
    bm2, sched2 = make(bm_blocks=32, bs=4, seqs=4, tokens=12, chunked=True)
    for i, n in enumerate([8, 8, 3]):
        sched2.add(Sequence(i, str(i), 0, [i] * n, SP, 4))
    out = sched2.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [8, 4]  # chunked: the rest of the budget


def test_abort_frees_blocks_at_once():
    bm, sched = make(bm_blocks=8, bs=4, seqs=2, tokens=64)
    s = Sequence(0, "x", 0, list(range(13)), SP, 5)
    sched.add(s)
    sched.schedule()
    assert bm.num_free_blocks == 4
    sched.finish(s, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 8 and s.block_table == [] and not sched.has_unfinished()
