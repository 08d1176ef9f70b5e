"""The confidence gate with the expert store (engine/expert_residency.py): the FP4 rows come from
their own pack (tag fp4, beside the W2 pack) through their own host arena, into a device pool of
every expert (filled at start) or of part of them (store/repair_pool.py promotes from the pack).

With the W2 device cache capped so that steps miss, greedy generation with the gate firing gives
token ids and logprobs bit-identical to the same engine with every W2 expert resident and the same
FP4 pool, under miss replay (repair passes replayed, the pool's counters restored before each pass:
without that the heat, hence the promotions, differ) and under demand fetch. The pool's sizing with
the store, and sizes that do not fit, are refused with the flag before any weight is read.
"""
import glob
import os

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.sampling_params import SamplingParams
from moet.store.pack_builder import expert_row_bytes, pack_layers
from moet.testing.tiny_checkpoint import cached_checkpoint

EXPERTS = 16
# a schedule the capped cache does not change (2 MoE layers x top_k 2 x 4 tokens <= 20 slots)
KW = dict(expert_format="w2", dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=4)
SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
GATES = {"every step": dict(gate_tau=0.9), "refresh 3": dict(gate_tau=0.0, gate_refresh=3)}


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=EXPERTS)


def pool_gb(path, slots):
    spec = open_checkpoint(path).spec
    return f"{slots * len(pack_layers(spec)) * expert_row_bytes(spec, 'fp4') / 2**30:.9f}"


def generate(path, home, **kw):
    """(ids and logprobs per prompt, stats extra, gate counters); a fresh HOME: no saved heat."""
    os.environ["HOME"] = str(home)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 8, 11, 3)]
    eng = LLMEngine.from_config(EngineConfig(model=path, **KW, **kw))
    try:
        done = eng.generate_all([(str(i), p, SP) for i, p in enumerate(prompts)])
        out = [(done[str(i)].outputs[0].token_ids,
                [{t: lp.logprob for t, lp in d.items()} for d in done[str(i)].outputs[0].logprobs])
               for i in range(len(prompts))]
        return out, eng.stats().extra, eng.gate.counters
    finally:
        eng.close()


@pytest.mark.parametrize("pool,demand,gate", [("partial", False, "every step"), ("partial", True, "refresh 3"),
                                              ("full", False, "refresh 3"), ("full", True, "every step")])
def test_gate_over_a_capped_cache_is_the_resident_gate(path, tmp_path, monkeypatch, pool, demand, gate):
    monkeypatch.setenv("HOME", str(tmp_path))
    kw = dict(GATES[gate], **({"fp4_pool_gb": pool_gb(path, 6)} if pool == "partial" else {}))
    want, _, wc = generate(path, tmp_path / "resident", **kw)
    packs = tmp_path / "packs"
    got, st, gc = generate(path, tmp_path / "store", pack_dir=str(packs), expert_cache_slots=20,
                           expert_demand_fetch=demand, **kw)
    assert got == want                                     # exact: ids and logprobs
    assert gc == wc and gc.repaired > 0 and gc.recomputed_rows > gc.repaired * (gate == "refresh 3")
    assert st["expert_cache_slots"] == 20 and st["expert_tolerated_misses_total"] == 0
    assert (st["expert_first_pass_misses_total"] > 0) != demand      # replay ran, or demand fetch did
    assert glob.glob(str(packs / "*" / "fp4-*.pack")) and glob.glob(str(packs / "*" / "w2-*.pack"))
    assert st["fp4_pack_bytes_read"] > 0 and st["fp4_host_arena_slots"] > 0
    if pool == "partial":
        assert st["fp4_pool_slots_per_layer"] == 6 and 0 < st["fp4_pool_hit_rate"] < 1
        assert st["fp4_pool_promotions"] > 6 * 2
        assert glob.glob(str(packs / "fp4-heat-*.json"))          # the heat, beside the packs
    else:
        assert st["fp4_pool_hit_rate"] == 1.0 and "fp4_pool_promotions" not in st


def test_store_pool_sizing_and_refusals(path, tmp_path, monkeypatch):
    import moet.model
    from moet.engine.confidence_gate import repair_tier_plan
    from moet.store.repair_pool import STORE_POOL_SHARE
    from moet.engine.expert_residency import estimated_weight_bytes
    from moet.store.host_arena import available_host_bytes

    ckpt = open_checkpoint(path)
    cpu = torch.device("cpu")
    cfg = EngineConfig(model=path, pack_dir=str(tmp_path), **KW)
    slots, why = repair_tier_plan(cfg, ckpt, cpu, torch.float32, "pack_dir is set")
    dense, _ = estimated_weight_bytes(ckpt, "w2", torch.float32)
    layer_slot = 2 * expert_row_bytes(ckpt.spec, "fp4")
    assert slots == min(EXPERTS, (available_host_bytes() // 2 - dense) // STORE_POOL_SHARE // layer_slot)
    assert "filled from the FP4 pack" in why and "pack_dir is set" in why
    monkeypatch.setattr(moet.model, "load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError, match="--fp4-pool-gb 100000 does not fit .* expert store"):
        LLMEngine.from_config(EngineConfig(model=path, pack_dir=str(tmp_path), fp4_pool_gb="100000", **KW))
    with pytest.raises(ConfigError, match="holds 1 FP4 experts per MoE layer, fewer than the 2"):
        LLMEngine.from_config(EngineConfig(model=path, pack_dir=str(tmp_path), fp4_pool_gb=pool_gb(path, 1), **KW))
