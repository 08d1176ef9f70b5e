"""The device expert cache + miss replay: a model whose MoE layers read a cache holding 10%,
25% or 50% of the experts (filled from the pack through a small host arena, evicting as it
goes) gives logits bit-identical to the fully resident model, step after step."""
import numpy as np
import pytest
import torch

from moet.errors import ConfigError
from moet.model import load_model
from moet.store import ExpertCache, HostArena, min_cache_slots, run_with_replay
from moet.store.expert_cache import cache_slots

CHUNK, DECODE = 2, 4


def _generate(model, prompt, cache=None, **replay_kw):
    """Prefill in chunks of CHUNK tokens, then greedy decode: every step's logits (+ residency)."""
    kv = model.new_cache(64, "cpu")
    steps, logits, start = [], [], 0
    chunks = [prompt[i:i + CHUNK] for i in range(0, len(prompt), CHUNK)]
    for n in range(len(chunks) + DECODE):
        ids = chunks[n] if n < len(chunks) else logits[-1][-1:].argmax(-1)
        step = lambda: model.forward(ids, start, kv)  # noqa: E731 (ids/start bound per step)
        if cache is None:
            out, res = step(), None
        else:
            out, res = run_with_replay(step, cache, scan=n < len(chunks), **replay_kw)
        logits.append(out)
        steps.append(res)
        start += ids.shape[0]
    return logits, steps


@pytest.mark.parametrize("fraction,policy", [(0.10, "decayed"), (0.25, "decayed"), (0.25, "lru"), (0.50, "decayed")])
def test_cached_equals_resident_bit_for_bit(qwen40_pack, fraction, policy):
    ckpt, ref, pack = qwen40_pack
    rows = pack.num_layers * pack.num_experts
    slots = int(rows * fraction)
    assert slots >= min_cache_slots(pack.num_layers, ckpt.spec.router.top_k, 1)
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    assert all(m.experts.pool is None for m in model.moe_blocks().values())   # experts come from the store only
    arena = HostArena(pack, max(1, rows // 8), pin=False)                  # small: the arena evicts too
    cache = ExpertCache(pack, slots, "cpu", arena=arena, policy=policy)
    cache.attach(model.moe_blocks())
    g = torch.Generator().manual_seed(int(fraction * 100))
    for trial in range(2 if fraction < 0.2 else 1):                        # a cold, then a warm cache
        prompt = torch.randint(0, 256, (5,), generator=g)
        want, _ = _generate(ref, prompt)
        got, res = _generate(model, prompt, cache)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert max(r.passes for r in res) >= 2 and all(r.tolerated_misses == 0 for r in res)
    if fraction < 0.2:
        assert cache.rows_fetched > slots        # rows were evicted and fetched again
    assert (cache.slot_table >= 0).sum() == min(slots, cache.rows_fetched)
    assert arena.hits + arena.misses == cache.rows_fetched   # every fetch went through the arena
    st = cache.stats()
    assert st["expert_replay_passes_per_step"] > 1 and 0 <= st["expert_cache_hit_rate"] < 1
    assert st["expert_rows_fetched_total"] == cache.rows_fetched and st["expert_tolerated_misses_total"] == 0


def test_miss_tolerance_keeps_step_and_fetches(qwen40_pack):
    ckpt, ref, pack = qwen40_pack
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    cache = ExpertCache(pack, 40, "cpu")                                   # no arena: straight from the pack
    cache.attach(model.moe_blocks())
    ids = torch.randint(0, 256, (CHUNK,), generator=torch.Generator().manual_seed(5))
    want = ref.forward(ids, 0, ref.new_cache(8, "cpu"))
    kv = model.new_cache(8, "cpu")
    out, res = run_with_replay(lambda: model.forward(ids, 0, kv), cache, miss_tolerance=1000)
    assert res.passes == 1 and res.tolerated_misses == res.first_pass_misses > 0 and res.rows_fetched > 0
    assert not torch.equal(out, want)            # kept with misses: not the resident output
    out, res = run_with_replay(lambda: model.forward(ids, 0, kv), cache, miss_tolerance=1000)
    if res.first_pass_misses == 0:               # the fetched rows were the right ones
        assert torch.equal(out, want)
    out, res = run_with_replay(lambda: model.forward(ids, 0, kv), cache)  # strict from here on
    assert torch.equal(out, want) and res.tolerated_misses == 0


def test_step_larger_than_cache_refused(qwen40_pack):
    ckpt, _, pack = qwen40_pack
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    cache = ExpertCache(pack, 4, "cpu")
    cache.attach(model.moe_blocks())
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(6))
    kv = model.new_cache(16, "cpu")
    with pytest.raises(ConfigError, match="--expert-cache-slots"):
        run_with_replay(lambda: model.forward(ids, 0, kv), cache)


def test_needed_after_miss_falls_back_to_exact_layers(qwen40_pack):
    _, _, pack = qwen40_pack
    cache = ExpertCache(pack, 5, "cpu")
    routed = np.zeros((2, 40), dtype=np.int32)
    routed[0, [1, 2, 3]] = 1
    routed[1, [4, 5, 6]] = 1
    assert cache.needed_after_miss(np.array([1, 0]), routed).tolist() == [1, 2, 3]   # 6 > 5 slots
    cache6 = ExpertCache(pack, 6, "cpu")
    assert cache6.needed_after_miss(np.array([1, 0]), routed).tolist() == [1, 2, 3, 44, 45, 46]


def test_sizing_helpers():
    assert min_cache_slots(61, 8, 64) == 61 * 8 * 4 and min_cache_slots(2, 2, 1, num_drafts=1) == 8
    assert cache_slots(7, None, 4096, 100) == 7 and cache_slots(None, 1.0, 2**20, 100) == 100
    assert cache_slots(None, 2**20 * 10 / 2**30, 2**20, 100) == 10 and cache_slots(None, None, 1, 1) is None


def test_demand_fetch_one_pass_bit_identical_and_prefill_rows_go_first(qwen40_pack):
    """store/demand.py: each MoE layer fetches its experts just before it runs, so with a cache
    that holds one layer's experts (not both) every step runs in one pass, long prefill chunks
    included, bit-identical to resident; the pairs of fetched experts count as misses in the hit
    rate; rows a prefill brought in for an earlier layer are the first to make room."""
    from moet.store.demand import attach_demand, detach_demand
    ckpt, ref, pack = qwen40_pack
    e = pack.num_experts
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    blocks = model.moe_blocks()
    cache = ExpertCache(pack, e + 3, "cpu", arena=HostArena(pack, 8, pin=False))
    cache.attach(blocks)
    assert attach_demand(blocks, cache) == pack.num_layers
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (24,), generator=g)
    kv_ref, kv = ref.new_cache(64, "cpu"), model.new_cache(64, "cpu")
    want = ref.forward(prompt, 0, kv_ref)                   # one 24-token prefill step
    cache.scan_pass = True
    got, res = run_with_replay(lambda: model.forward(prompt, 0, kv), cache, scan=True)
    assert torch.equal(got, want) and res.passes == 1 and res.first_pass_misses == 0
    assert cache.demand_rows > e and cache.demand_missed_pairs > 0 and cache.stats()["expert_cache_hit_rate"] < 1
    # the last layer's rows are resident, and the slots an earlier layer's prefill rows held were reused
    last = (pack.num_layers - 1) * e
    assert (cache._table[last:last + e] >= 0).sum() >= len(np.unique(cache.route_counts[-1].numpy().nonzero()[0]))
    # victim order: a decode-used row survives while an earlier layer's prefill rows are evicted
    cache2 = ExpertCache(pack, 6, "cpu", arena=HostArena(pack, 8, pin=False))
    cache2.scan_pass = False
    cache2.demand(0, np.array([e - 2, e - 1]))              # rows a decode step used (layer 0)
    cache2.end_step(np.zeros((pack.num_layers, e), dtype=np.int32))
    cache2.scan_pass = True
    cache2.demand(0, np.array([0, 1, 2, 3]))                # a prefill's layer 0: fills the 4 free slots
    cache2.demand(1, np.array([5, 6]))                      # its layer 1: 2 slots from layer 0's rows
    res2 = cache2.resident()
    assert res2[0, [e - 2, e - 1]].all() and res2[1, [5, 6]].all()    # the decode rows were kept,
    assert res2[0, :4].sum() == 2                                       # two prefill rows made room
    with pytest.raises(ConfigError, match="one MoE layer needs"):
        cache2.demand(0, np.arange(7))
    detach_demand(blocks)
    assert all(m.experts.demand_fetch is None for m in blocks.values())
