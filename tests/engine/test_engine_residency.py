"""The engine over the expert store (engine/expert_residency.py): with the device cache capped to
10%, 25%, 50% of the experts, batched greedy generation with chunked prefill gives token ids and
logprobs bit-identical to every expert resident; miss_tolerance keeps steps with misses and says
so; a pack one LLM built is reused by the next; a corrupt pack is refused or repaired through the
LLM path; close() saves the hot set and releases the pack."""
import asyncio
import os

import pytest
import torch

from moet.engine.async_engine import AsyncEngine
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

ROWS = 2 * 40          # 2 MoE layers x 40 experts; top_k 2 -> 4 rows per token per step
# chunked prefill of 2 tokens per step, 2 sequences at once: 3 prompts interleave prefill and decode
# fp4_gate off: resident and stored runs compare bare W2 (the gate with the store: test_gate_through_store.py)
KW = dict(expert_format="w2", dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=2,
          num_kv_blocks=64, block_size=4, fp4_gate=False)
SP = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=40)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)      # fresh random token ids, different lengths
    return [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 7, 3)]


@pytest.fixture(scope="module")
def resident(path, prompts):
    llm = LLM(path, **KW)
    assert llm.engine.residency is None        # no store flag on CPU: today's all-resident path
    return llm.generate(prompts, SP, use_tqdm=False)


def _logprob_lists(out):
    o = out.outputs[0]
    gen = [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs]
    prm = [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs]
    return o.token_ids, o.cumulative_logprob, gen, prm


def assert_identical(got, want):
    for a, b in zip(got, want):
        assert _logprob_lists(a) == _logprob_lists(b)       # exact float equality, ids and logprobs


@pytest.mark.parametrize("demand", [False, True])
@pytest.mark.parametrize("fraction", [0.10, 0.25, 0.50])
def test_capped_cache_bit_identical_to_resident(path, prompts, resident, tmp_path, fraction, demand):
    """Miss replay (demand fetch off: on CPU every pass is eager, so this is the only way to run the
    replay here) and demand fetch (store/demand.py: the default; no pass misses, no replay): both
    give the fully resident ids and logprobs bit for bit."""
    slots = int(ROWS * fraction)
    with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=slots, expert_demand_fetch=demand, **KW) as llm:
        res = llm.engine.residency
        assert res is not None and res.cache.num_slots == slots
        # the scheduler's budget was not lowered (2 tokens x 4 rows <= 8 slots): same schedule as resident
        assert llm.engine.scheduler.max_num_batched_tokens == 2
        got = llm.generate(prompts, SP, use_tqdm=False)
        assert_identical(got, resident)
        st = llm.engine.stats().extra
    assert st["expert_cache_slots"] == slots and st["expert_cache_resident"] == slots
    assert 0 <= st["expert_cache_hit_rate"] < 1 and st["expert_tolerated_misses_total"] == 0
    if demand:      # every miss fetched before its layer ran: one pass per step
        assert st["expert_first_pass_misses_total"] == 0 and st["expert_replays_total"] == 0
        assert st["expert_demand_rows_total"] > 0
    else:
        assert st["expert_first_pass_misses_total"] > 0 and st["expert_replays_total"] > 0
        assert st["expert_demand_rows_total"] == 0
    assert st["expert_bytes_fetched_total"] == st["expert_rows_fetched_total"] * res.pack.layout.row_bytes > 0
    assert st["expert_bytes_fetched_per_token"] > 0
    assert os.path.exists(res.pack.paths.hot_set) and res.pack.fd == -1     # close(): hot set saved, pack released
    # prefetch is on by default: layer 1's experts were predicted from layer 0 and scored
    assert st["expert_prefetch_predicted_total"] > 0
    assert 0 < st["expert_prefetch_precision"] <= 1 and 0 < st["expert_prefetch_recall"] <= 1
    assert 0 <= st["expert_prefetch_misses_saved_total"] <= st["expert_prefetch_rows_total"]
    assert st["expert_prefetch_rows_total"] <= st["expert_rows_fetched_total"]


@pytest.mark.parametrize("fraction", [0.10, 0.25])
def test_prefetch_off_bit_identical_and_unscored(path, prompts, resident, tmp_path, fraction):
    """Prefetch on (the test above) and off give the same ids and logprobs as fully resident; off
    predicts nothing; on, at 25%, some prefetched rows were used by the step (misses saved)."""
    slots = int(ROWS * fraction)
    stats = {}
    for on in (False, True):
        with LLM(path, pack_dir=str(tmp_path / str(on)), expert_cache_slots=slots, expert_prefetch=on, **KW) as llm:
            assert (llm.engine.model.model.layers[0].expert_prefetch is not None) == on
            assert_identical(llm.generate(prompts, SP, use_tqdm=False), resident)
            stats[on] = llm.engine.stats().extra
    off = stats[False]
    assert off["expert_prefetch_predicted_total"] == off["expert_prefetch_rows_total"] == 0
    assert stats[True]["expert_prefetch_predicted_total"] > 0
    # rows a prefetch brought in and the step then used were misses the first pass did not have
    saved = stats[True]["expert_prefetch_misses_saved_total"]
    if fraction == 0.25:
        assert saved > 0


@pytest.mark.parametrize("demand", [False, True])
def test_step_budget_lowered_to_fit_the_cache(path, prompts, resident, tmp_path, demand):
    """8 slots, 2 MoE layers, top-2: with replay alone a step's every layer must fit (8 / (2 x 2) =
    2 tokens); with demand fetch one layer's (8 / 2 = 4 tokens, the cache holding fewer experts
    than a layer has), decode steps still 2 sequences."""
    kw = dict(KW, max_num_batched_tokens=64, max_num_seqs=2)
    with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=8, expert_demand_fetch=demand, **kw) as llm:
        want = (4, 2) if demand else (2, 2)
        assert (llm.engine.scheduler.max_num_batched_tokens, llm.engine.scheduler.max_num_seqs) == want
        got = llm.generate(prompts, SP, use_tqdm=False)
    if demand:          # the resident engine at the same schedule (4-token prefill chunks)
        with LLM(path, **dict(KW, max_num_batched_tokens=4, max_num_seqs=2)) as llm:
            resident = llm.generate(prompts, SP, use_tqdm=False)
    assert_identical(got, resident)


def test_demand_fetch_lifts_the_prefill_cap(path, prompts, tmp_path):
    """A cache that holds every expert of one layer but not of both: with demand fetch a step is not
    capped in tokens (prefill takes max_num_batched_tokens), each pass runs once, the outputs are the
    resident ones at the same schedule; without it the step budget is slots / (layers x top_k)."""
    e = ROWS // 2
    kw = dict(KW, max_num_batched_tokens=64, max_num_seqs=4)
    with LLM(path, **kw) as llm:                                         # resident, whole-prompt prefill
        want = llm.generate(prompts, SP, use_tqdm=False)
    with LLM(path, pack_dir=str(tmp_path / "on"), expert_cache_slots=e + 4, **kw) as llm:
        assert llm.engine.scheduler.max_num_batched_tokens == 64
        assert llm.engine.scheduler.max_num_seqs == 4                  # 44 // (2 x 2) = 11 >= 4
        assert_identical(llm.generate(prompts, SP, use_tqdm=False), want)
        st = llm.engine.stats().extra
        assert st["expert_replays_total"] == 0 and st["expert_demand_rows_total"] > 0
    with LLM(path, pack_dir=str(tmp_path / "off"), expert_cache_slots=e + 4, expert_demand_fetch=False, **kw) as llm:
        assert llm.engine.scheduler.max_num_batched_tokens == (e + 4) // 4


def test_miss_tolerance_finishes_and_reports_misses(path, prompts, resident, tmp_path):
    # tolerance applies where a pass can miss: replayed steps (demand fetch off; on the GPU, the
    # captured decode steps)
    with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=8, miss_tolerance=1000, expert_demand_fetch=False,
             **KW) as llm:
        got = llm.generate(prompts, SP, use_tqdm=False)
        st = llm.engine.stats().extra
    assert [len(o.outputs[0].token_ids) for o in got] == [6, 6, 6]
    assert st["expert_tolerated_misses_total"] > 0 and st["expert_replays_total"] == 0
    # the kept steps lacked experts: not the resident outputs
    assert [_logprob_lists(o) for o in got] != [_logprob_lists(o) for o in resident]


def test_pack_built_once_then_reused(path, prompts, resident, tmp_path):
    with LLM(path, pack_dir=str(tmp_path), **KW) as first:      # pack_dir alone: store on, every row cached
        a = first.engine.stats().extra
        assert a["expert_cache_slots"] == ROWS and a["pack_built_layers"] == 2
        assert_identical(first.generate(prompts, SP, use_tqdm=False), resident)
        assert first.engine.stats().extra["expert_first_pass_misses_total"] == 0     # warmed: never misses
    with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=20, **KW) as second:
        b = second.engine.stats().extra
        assert b["pack_built_layers"] == 0 and b["pack_open_seconds"] < a["pack_open_seconds"]
        assert second.engine.residency.preloaded > 0                  # the first one's hot set
        assert_identical(second.generate(prompts, SP, use_tqdm=False), resident)


def test_corrupt_pack_repaired_on_read_or_at_boot(path, prompts, resident, tmp_path):
    with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=8, **KW) as llm:
        paths, stride = llm.engine.residency.pack.paths, llm.engine.residency.pack.stride
    with open(paths.data, "r+b") as f:           # one byte of layer 1, expert 3
        off = (40 + 3) * stride + 100
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x04]))
    with LLM(path, pack_dir=str(tmp_path), **KW) as llm:   # lazy: the warm-up reads the bad row, repairs it
        st = llm.engine.stats().extra
        assert st["pack_corrupt_rows"] == 1 and st["pack_repaired_rows"] == 1 and llm.engine.health()[0] == "ok"
        assert_identical(llm.generate(prompts, SP, use_tqdm=False), resident)
    with open(paths.data, "r+b") as f:           # damaged again
        f.seek(off)
        f.write(bytes([b[0] ^ 0x04]))
    with LLM(path, pack_dir=str(tmp_path), pack_verify="full", expert_cache_slots=8, **KW) as llm:
        assert llm.engine.stats().extra["pack_built_layers"] == 1
        assert_identical(llm.generate(prompts, SP, use_tqdm=False), resident)


def test_config_errors_name_the_flag(path, tmp_path):
    with pytest.raises(ConfigError, match="--expert-cache-slots"):
        LLM(path, pack_dir=str(tmp_path), expert_cache_slots=7, **KW)     # < 2 layers x 2 x min(2, 4)
    with pytest.raises(ConfigError, match="expert_format=bf16 has no pack"):
        LLM(path, **dict(KW, expert_format="bf16"), expert_cache_slots=40)


def test_async_engine_shutdown_closes_the_store(path, tmp_path):
    from moet.config import EngineConfig

    engine = LLMEngine.from_config(EngineConfig(model=path, pack_dir=str(tmp_path), expert_cache_slots=8, **KW))
    pack = engine.residency.pack

    async def main():
        eng = AsyncEngine(engine)
        last = None
        async for out in eng.generate("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3)):
            last = out
        assert len(last.outputs[0].token_ids) == 3 and eng.stats().extra["expert_cache_slots"] == 8
        await eng.shutdown()

    asyncio.run(main())
    assert pack.fd == -1 and os.path.exists(pack.paths.hot_set)


def test_store_rule_and_weight_estimate(path, monkeypatch):
    """The one rule: explicit flags -> store; CUDA without flags -> store only when the estimated
    weights exceed 80% of the budget; CPU -> resident. The estimate equals what the loader holds."""
    from moet.checkpoint import open_checkpoint
    from moet.config import EngineConfig
    from moet.engine.expert_residency import estimated_weight_bytes, store_reason
    from moet.model import load_model

    ckpt = open_checkpoint(path)
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32)
    dense, expert = estimated_weight_bytes(ckpt, "w2", torch.float32)
    assert dense == sum(p.numel() * p.element_size() for p in model.parameters())
    pools = [b.experts.pool for b in model.moe_blocks().values()]
    assert expert == sum(t.numel() * t.element_size() for p in pools
                         for t in (getattr(p, f) for f in p.__slots__) if isinstance(t, torch.Tensor))
    cfg = EngineConfig(model=path)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert store_reason(cfg, ckpt, cpu, torch.float32) is None
    assert "expert_cache_slots" in store_reason(EngineConfig(model=path, expert_cache_slots=8), ckpt, cpu, torch.float32)
    need = (dense + expert) / 0.8 / 0.9                    # total at which the weights just fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (int(need * 1.01), int(need * 1.01)))
    assert store_reason(cfg, ckpt, cuda, torch.float32) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (int(need * 0.99), int(need * 0.99)))
    assert "exceed 80%" in store_reason(cfg, ckpt, cuda, torch.float32)
    # most of the card already taken (another process): a clear error naming it, not a store of 0 slots
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (int(dense * 0.5), int(need * 4)))
    with pytest.raises(ConfigError, match=r"already in use there.*raise --gpu-memory-utilization"):
        store_reason(cfg, ckpt, cuda, torch.float32)

