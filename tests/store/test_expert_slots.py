"""ExpertSlots (store/expert_slots.py), the one seam between a MoE block and its routed experts:
the block holds its own weights and that one object, nothing else; the loader's seam has every
expert resident; the expert cache's seam holds views of the cache's own tensors (the storage CUDA
graphs capture), keeps the engine's shared-experts stream and drops a CPU layout of the pool it
replaces; demand fetch is set and cleared on it; a second pool is refused until a layer knows how
to compute over two."""
import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.kernels.pools import DensePool
from moet.model import load_model
from moet.model.layers.moe import MoE
from moet.store import ExpertCache, HostArena
from moet.store.demand import attach_demand, detach_demand
from moet.store.expert_slots import ExpertSlots


@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3"])
def test_a_block_holds_its_weights_and_one_seam(qwen40_pack, ds_ckpt, model):
    if model == "qwen3":                    # no shared experts
        fmt, ref = "w2", qwen40_pack[1]
    else:                                   # shared experts, an MTP layer's block too
        fmt, ref = "fp4", load_model(open_checkpoint(ds_ckpt), expert_format="fp4", dtype=torch.float32)
    blocks = list(ref.moe_blocks().values())
    assert blocks
    for b in blocks:
        # what the block holds beyond nn.Module's own bookkeeping: its spec and the seam (and
        # shared_experts = None where the model has none); the router and the shared experts are
        # submodules, the weights their parameters
        own = {k for k in vars(b) if not k.startswith("_") and k != "training"}
        assert own - {"shared_experts"} == {"spec", "experts"}, own
        assert ("shared_experts" in own) == (model == "qwen3")
        assert {k for k, v in b._modules.items() if v is not None} == (
            {"gate"} if model == "qwen3" else {"gate", "shared_experts"})
        e = b.experts
        assert isinstance(e, ExpertSlots) and list(e.pools) == [fmt]
        assert torch.equal(e.slot_table, torch.arange(b.spec.router.num_experts, dtype=torch.int32))
        assert e.miss_counter.tolist() == [0] and e.route_counts is None and e.demand_fetch is None


def test_the_cache_hands_views_of_its_own_tensors(qwen40_pack):
    ckpt, _, pack = qwen40_pack
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    blocks = model.moe_blocks()
    assert all(b.experts.pool is None and (b.experts.slot_table == -1).all() for b in blocks.values())
    marker = object()                       # stands for the engine's CUDA stream (attach must keep it)
    stale = DensePool(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    for b in blocks.values():
        b.experts.shared_stream = marker
        b.experts.cpu_pool = stale
    cache = ExpertCache(pack, 30, "cpu", arena=HostArena(pack, 4, pin=False))
    cache.attach(blocks)
    for l, name in enumerate(pack.meta.layers):
        e = blocks[name].experts
        assert e.pools == {"w2": cache.pool} and e.pool is cache.pool and e.compute_pool() is cache.pool
        for mine, theirs in ((e.slot_table, cache.slot_table[l]), (e.miss_counter, cache.miss_counters[l:l + 1]),
                             (e.route_counts, cache.route_counts[l])):
            assert mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape
        assert e.shared_stream is marker and e.cpu_pool is None and e.demand_fetch is None
    cache.slot_table[0, 3] = 7              # the cache rewrites its table in place: the block sees it
    assert int(blocks[pack.meta.layers[0]].experts.slot_table[3]) == 7
    assert attach_demand(blocks, cache) == len(blocks)
    assert all(b.experts.demand_fetch.cache is cache for b in blocks.values())
    detach_demand(blocks)
    assert all(b.experts.demand_fetch is None for b in blocks.values())


def test_absent_seam_misses_everything_and_the_repair_tier_is_one_more_pool():
    e = ExpertSlots.absent(4)
    assert e.pool is None and e.compute_pool() is None and e.slot_table.tolist() == [-1] * 4
    pool = DensePool(torch.zeros(2, 4, 3), torch.zeros(2, 3, 2))
    e = ExpertSlots.resident("bf16", pool, "cpu")
    assert e.pool is pool and e.slot_table.tolist() == [0, 1] and e.compute_pool() is pool
    cpu = DensePool(torch.ones(2, 4, 3), torch.ones(2, 3, 2))
    e.cpu_pool = cpu
    assert e.compute_pool() is cpu and e.pool is pool
    assert e.repair_pool is None and e.tier() == (e.slot_table, cpu)
    e.repairing = True
    with pytest.raises(RuntimeError, match="without a repair tier"):
        e.tier()
    e.repairing = False
    fp4 = DensePool(torch.full((2, 4, 3), 2.0), torch.full((2, 3, 2), 2.0))
    holes = ExpertSlots.absent(2)                       # the expert store's primary: slots come and go
    holes.pools["bf16"], holes.primary = pool, "bf16"
    holes.add_repair_tier(fp4, torch.tensor([0, -1], dtype=torch.int32))
    assert holes.repair_fallback_table().tolist() == [-1, -1]    # expert 1: neither row (a miss)
    holes.slot_table[1] = 0
    assert holes.repair_fallback_table().tolist() == [-1, 0]     # follows the primary's table
    part = ExpertSlots.resident("bf16", pool, "cpu")
    part.add_repair_tier(DensePool(torch.zeros(1, 4, 3), torch.zeros(1, 3, 2)), torch.tensor([-1, 0], dtype=torch.int32))
    assert not part.repair_complete and part.repair_fallback_table().tolist() == [0, -1]
    part.assign_repair_slot(0, 0)
    part.assign_repair_slot(1, -1)
    assert part.repair_slot_table.tolist() == [0, -1] and part.repair_fallback_table().tolist() == [-1, 1]
    table = torch.tensor([1, 0], dtype=torch.int32)
    e.add_repair_tier(fp4, table)
    assert e.pool is pool and e.repair_pool is fp4 and sorted(e.pools) == ["bf16", "fp4"] and e.repair_complete
    assert e.tier() == (e.slot_table, cpu)            # the primary, until a repair pass
    e.repairing = True
    assert e.tier() == (table, fp4)
    with pytest.raises(RuntimeError, match="already has a repair tier"):
        e.add_repair_tier(fp4, table)
    shared = ExpertSlots(torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                         pools={"w2": pool, "fp4": fp4})        # two pools and no primary named
    with pytest.raises(RuntimeError, match="no primary tier"):
        shared.pool


def test_moe_layer_computes_through_the_seam(qwen40_pack):
    """Swapping the seam swaps what the layer computes with: every expert absent gives zero and
    counts every pair as a miss; the route log counts the routed pairs."""
    _, ref, _ = qwen40_pack
    block: MoE = next(iter(ref.moe_blocks().values()))
    x = torch.randn(3, block.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    resident = block.experts
    try:
        block.experts = ExpertSlots(torch.full_like(resident.slot_table, -1), torch.zeros(1, dtype=torch.int64),
                                    pools=dict(resident.pools),
                                    route_counts=torch.zeros(block.spec.router.num_experts, dtype=torch.int32))
        out = block._routed(x)
        k = block.spec.router.top_k
        assert not out.any() and int(block.experts.miss_counter) == 3 * k
        assert int(block.experts.route_counts.sum()) == 3 * k
    finally:
        block.experts = resident
    assert block._routed(x).any() and int(resident.miss_counter) == 0
