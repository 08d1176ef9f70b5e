"""An FP4 repair pool of part of the experts (store/repair_pool.py, ExpertSlots' fallback table):

  * a repair pass computes every pair from its FP4 row where the pool has one and from its W2 row
    elsewhere, against a float64 loop over the decoded weights of each;
  * promotion moves the hottest absent experts in (at most max_rows_per_repair a pass), the
    device slot then holds exactly the host's rows, and the tables stay consistent;
  * through the engine: a deterministic run, the pool's statistics, and the sizes that do not fit
    refused with the flag.
"""
import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.kernels.reference import _slot_weights
from moet.model import load_model
from moet.sampling_params import SamplingParams
from moet.store.repair_pool import RepairPool
from moet.testing.tiny_checkpoint import cached_checkpoint


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=16)


def partial_model(path, slots):
    return load_model(open_checkpoint(path), expert_format="w2", dtype=torch.float32, repair_tier=True,
                      repair_slots=slots)


def expected(block, x, table_fp4, fp4_pool, w2_pool, w2_table):
    """float64: sum over each token's routed experts of weight * SwiGLU expert, with the expert's
    FP4 weights where table_fp4 has a slot, else its W2 weights."""
    ids, w = block.select_experts(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            slot = int(table_fp4[e])
            gu, d = _slot_weights(fp4_pool, slot, torch.float64) if slot >= 0 else \
                _slot_weights(w2_pool, int(w2_table[e]), torch.float64)
            g, u = (gu.double() @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (d.double() @ (torch.nn.functional.silu(g) * u))
    return out, ids


def test_repair_pass_mixes_fp4_and_w2_rows(path):
    model = partial_model(path, 6)
    block = next(iter(model.moe_blocks().values()))
    e = block.experts
    assert not e.repair_complete and e.repair_pool.num_slots == 6 and e.repair_host_pool.num_slots == 16
    pool = RepairPool(model.moe_blocks(), max_rows_per_repair=100)
    pool.fill([[3, 9, 0, 14, 7, 1] + [x for x in range(16) if x not in (3, 9, 0, 14, 7, 1)]] * len(pool.slots))
    assert sorted(x for x in range(16) if int(e.repair_slot_table[x]) >= 0) == [0, 1, 3, 7, 9, 14]
    assert all(int(e.repair_fallback_table()[x]) == (x if int(e.repair_slot_table[x]) < 0 else -1) for x in range(16))
    x = torch.randn(7, model.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        w2 = block(x)
        with model.repair_tier():
            got = block(x)
    shared = block.shared_experts(x) if block.shared_experts is not None else 0
    want, ids = expected(block, x, e.repair_slot_table, e.repair_pool, e.pool, e.slot_table)
    assert torch.allclose((got - shared).double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, w2)
    in_pool = sum(int(e.repair_slot_table[int(i)]) >= 0 for i in ids.flatten())
    assert int(e.repair_miss_counter) == ids.numel() - in_pool       # pairs that found no FP4 row
    assert int(e.repair_route_counts.sum()) == ids.numel()


def test_promotion_moves_hot_experts_in_bounded(path):
    model = partial_model(path, 4)
    pool = RepairPool(model.moe_blocks(), max_rows_per_repair=3)
    pool.fill()
    e = pool.slots[0]
    assert pool.holder[0] == [0, 1, 2, 3] and pool.promotions == 4 * len(pool.slots)
    # a repair pass that routed only to experts 10..13 of layer 0
    e.repair_route_counts[10:14] = 5
    assert pool.after_repair() == 3                      # bounded
    assert sum(x >= 10 for x in pool.holder[0]) == 3
    assert pool.after_repair() == 1                      # the heat stays: the fourth follows
    assert sorted(pool.holder[0]) == [10, 11, 12, 13]
    for slot, x in enumerate(pool.holder[0]):            # the slot holds the host's rows of its expert
        assert int(e.repair_slot_table[x]) == slot and int(e.repair_fallback_table()[x]) == -1
        for f in e.repair_pool.__slots__:
            t = getattr(e.repair_pool, f)
            if isinstance(t, torch.Tensor):
                assert torch.equal(t[slot], getattr(e.repair_host_pool, f)[x]), f
    for x in range(4):
        assert int(e.repair_slot_table[x]) == -1 and int(e.repair_fallback_table()[x]) == x
    assert pool.after_repair() == 0                      # nothing hotter waits
    assert pool.stats()["fp4_pool_promotions"] == 4 * len(pool.slots) + 4


def engine(path, **kw):
    return LLMEngine.from_config(EngineConfig(model=path, expert_format="w2", dtype="float32", device="cpu",
                                              gate_tau=0.9, **kw))


def test_engine_with_a_partial_pool(path):
    from moet.store.pack_builder import expert_row_bytes, pack_layers
    spec = open_checkpoint(path).spec
    per_slot = len(pack_layers(spec)) * expert_row_bytes(spec, "fp4")
    gb = f"{6 * per_slot / 2**30:.9f}"
    prompts = [[(7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng = engine(path, fp4_pool_gb=gb)
        pool = eng.gate.repair_pool
        assert pool is not None and pool.num_slots == 6
        done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
        runs.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
        extra = eng.stats().extra
        assert eng.gate.counters.fires > 0 and extra["fp4_pool_promotions"] > 6 * len(pool.slots)
        assert 0 < extra["fp4_pool_hit_rate"] < 1 and extra["fp4_pool_slots_per_layer"] == 6
    assert runs[0] == runs[1]
    with pytest.raises(ConfigError, match="--fp4-pool-gb 0.000000001 holds 0 FP4 experts per MoE layer"):
        engine(path, fp4_pool_gb="0.000000001")
    with pytest.raises(ConfigError, match="does not fit beside the weights"):
        engine(path, fp4_pool_gb="100000")


def test_heat_outlives_the_engine(path, tmp_path, monkeypatch):
    """A partial pool's heat is saved at close (beside the packs, by checkpoint identity) and the
    next engine fills its slots hottest first; a file of another checkpoint is ignored."""
    monkeypatch.setenv("HOME", str(tmp_path))
    from moet.store.pack_builder import expert_row_bytes, pack_layers
    spec = open_checkpoint(path).spec
    gb = f"{6 * len(pack_layers(spec)) * expert_row_bytes(spec, 'fp4') / 2**30:.9f}"
    eng = engine(path, fp4_pool_gb=gb)
    eng.generate_all([("a", [(5 * j) % 250 for j in range(9)], SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True))])
    pool = eng.gate.repair_pool
    want = [sorted(order[:6]) for order in pool.hot_order()]
    assert pool.heat.sum() > 0
    eng.close()
    files = list((tmp_path / ".cache" / "moet" / "packs").glob("fp4-heat-*.json"))
    assert len(files) == 1
    again = engine(path, fp4_pool_gb=gb).gate.repair_pool
    assert [sorted(h) for h in again.holder] == want and torch.equal(again.heat, pool.heat)
    for e, holder in zip(again.slots, again.holder):    # refilled over a full pool: tables and holders agree
        assert sorted(x for x in range(again.num_experts) if int(e.repair_slot_table[x]) >= 0) == sorted(holder)
        assert all(int(e.repair_slot_table[x]) == slot for slot, x in enumerate(holder))
    assert not again.load_heat(str(files[0]), "ckpt-v1-fp-another")
