"""The engine reads its config in the grouped form (`config.cache.block_size`), never through
EngineConfig's flat read-only views (`config.block_size`), which stay for code outside moet: with
every flat view made to fail, an LLM builds, generates and closes, with every expert resident and
over the expert store (the model runner's KV sizing, store_reason, ExpertResidency.open / start,
the stats interval), and the KV size checks run for both explicit sizes. CPU only, so the CUDA-only
reads (graphs, PDL, the shared-expert stream, the GPU budgets) are not reached here."""
import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.config.engine import KNOB_SECTION
from moet.engine.model_runner import check_kv_request
from moet.errors import ConfigError
from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

# fp4_gate off: resident and stored runs compare bare W2 (the gate with the store: test_gate_through_store.py)
KW = dict(expert_format="w2", dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=2,
          num_kv_blocks=64, block_size=4, fp4_gate=False)
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=40)


@pytest.fixture
def flat_reads(monkeypatch):
    """Every flat view of EngineConfig replaced by one that records the read and fails, so a read
    swallowed by a broad `except` or a `getattr(config, knob, default)` is still seen."""
    reads: list[str] = []

    def view(name):
        def get(self):
            reads.append(name)
            raise AssertionError(f"flat read config.{name}; read config.{KNOB_SECTION[name]}.{name}")
        return property(get)

    for name in KNOB_SECTION:
        monkeypatch.setattr(EngineConfig, name, view(name))
    return reads


def _generate(path, **kw):
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 3)]
    with LLM(path, **KW, **kw) as llm:
        out = llm.generate(prompts, SP, use_tqdm=False)
        return llm.engine.residency is not None, [o.outputs[0].token_ids for o in out]


def test_views_fail_when_read(flat_reads):
    """The stand-in views do fail (else the tests below would prove nothing)."""
    config = EngineConfig(model="m", block_size=8)
    with pytest.raises(AssertionError, match="config.cache.block_size"):
        config.block_size
    assert flat_reads == ["block_size"] and config.cache.block_size == 8


def test_engine_reads_grouped(path, tmp_path, flat_reads):
    # every expert resident, then the store with a device cache of a quarter of the 80 rows, the
    # stats line on every step and tolerated misses: each knob the store reads is set
    resident = _generate(path)
    stored = _generate(path, pack_dir=str(tmp_path), expert_cache_slots=20, host_arena_gb=1.0,
                       expert_stats_interval_s=1e-9, expert_demand_fetch=False, miss_tolerance=0)
    assert flat_reads == []
    assert resident[0] is False and stored[0] is True
    assert stored[1] == resident[1] and all(len(ids) == SP.max_tokens for ids in resident[1])


@pytest.mark.parametrize("size", [dict(num_kv_blocks=1), dict(kv_cache_memory_gb=1e-6)])
def test_kv_request_reads_grouped(path, flat_reads, size):
    """check_kv_request (before the weights are read) over either explicit size: too small for one
    sequence of max_model_len, a ConfigError that names the flag, and no flat read."""
    spec = open_checkpoint(path).spec
    config = EngineConfig(model=path, block_size=4, device="cpu", **size)
    with pytest.raises(ConfigError, match="num-kv-blocks" if "num_kv_blocks" in size else "kv-cache-memory-gb"):
        check_kv_request(config, spec, 64, torch.float32, torch.device("cpu"))
    assert flat_reads == []
