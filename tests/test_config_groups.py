"""EngineConfig grouped into sub-configs (load, cache, scheduler, store, gate, kernels) with the flat
keywords, reads and CLI flags kept: both ways of building a config give the same value, a flat read
is the grouped one, an unknown keyword is one ConfigError naming the closest knob, and the config
survives dataclasses.replace, asdict and pickling (EngineProcess hands it to a spawned child)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import pickle

import pytest

from moet.config import (
    SECTIONS,
    CacheConfig,
    EngineConfig,
    GateConfig,
    KernelConfig,
    LoadConfig,
    SchedulerConfig,
    StoreConfig,
    add_cli_arguments,
    from_cli_args,
)
from moet.errors import ConfigError
from moet.serve.serve_config import add_serve_arguments

# One valid value other than the default for every knob (checked against the knobs below, so a new
# knob must be added here), each with its sub-config.
OTHER = {
    "load": dict(tokenizer="/tok", expert_format="fp4", dtype="float32", device="cuda:1", trust_remote_code=True,
                 load_mtp=False, w2_zero_mode="alt", w2_scale_rule="mse"),
    "cache": dict(block_size=32, kv_cache_dtype="fp8", gpu_memory_utilization=0.5, kv_cache_memory_gb=2.0,
                  num_kv_blocks=100, enable_prefix_caching=False),
    "scheduler": dict(max_model_len=1024, allow_long_max_model_len=True, max_num_seqs=8, max_num_batched_tokens=2048,
                      enable_chunked_prefill=False, async_scheduling=False,
                      speculative_config='{"method": "mtp", "num_speculative_tokens": 2}', seed=7),
    "store": dict(pack_dir="/packs", expert_cache_slots=96, expert_cache_gb=1.5, expert_cache_policy="lru",
                  host_arena_gb=0.0, miss_tolerance=3, expert_demand_fetch=False, expert_decode_mode="auto",
                  expert_prefetch=False, pack_verify="full", rebuild_pack=True, o_direct=True,
                  expert_stats_interval_s=0.0),
    "gate": dict(fp4_gate=False, gate_tau=0.9, gate_reach=8, gate_refresh=0, fp4_prefill=False, fp4_pool_gb="12.5"),
    "kernels": dict(enforce_eager=True, overlap_shared_experts=False, compile_warmup=False,
                    attention_fused_merge=True, small_kernel_pdl=False),
}
KNOBS = [(section, name, value) for section, kv in OTHER.items() for name, value in kv.items()]
# Every other value at once, less the two that conflict with others in the table (expert_cache_gb
# with expert_cache_slots, expert_decode_mode=auto with expert_demand_fetch off).
TOGETHER = {s: {n: v for n, v in kv.items() if n not in ("expert_cache_gb", "expert_decode_mode")}
            for s, kv in OTHER.items()}
ALL_FLAT = {n: v for kv in TOGETHER.values() for n, v in kv.items()}


def test_the_table_covers_every_knob_and_each_sub_config_holds_its_own():
    assert {s: {f.name for f in dataclasses.fields(cls)} for s, cls in SECTIONS.items()} == \
        {s: set(kv) for s, kv in OTHER.items()}
    assert EngineConfig.field_names() == ("model",) + tuple(n for _, n, _ in KNOBS)
    for section, name, value in KNOBS:
        default = SECTIONS[section].__dataclass_fields__[name].default
        assert value != default, name                       # the test below sees a change


@pytest.mark.parametrize("section,name,value", KNOBS, ids=[n for _, n, _ in KNOBS])
def test_a_flat_keyword_sets_its_sub_configs_knob_and_the_flat_read_is_the_grouped_read(section, name, value):
    flat = EngineConfig(model="m", **{name: value})
    grouped = EngineConfig(model="m", **{section: SECTIONS[section](**{name: value})})
    assert flat == grouped
    assert getattr(getattr(flat, section), name) == value and getattr(flat, name) == value
    default = EngineConfig(model="m")
    for other in SECTIONS:                                   # nothing else moved
        if other != section:
            assert getattr(flat, other) == getattr(default, other)


def test_flat_keywords_and_sub_configs_build_the_same_config():
    flat = EngineConfig(model="m", **ALL_FLAT)
    by_section = TOGETHER
    grouped = EngineConfig(model="m", load=LoadConfig(**by_section["load"]), cache=CacheConfig(**by_section["cache"]),
                           scheduler=SchedulerConfig(**by_section["scheduler"]),
                           store=StoreConfig(**by_section["store"]), gate=GateConfig(**by_section["gate"]),
                           kernels=KernelConfig(**by_section["kernels"]))
    assert flat == grouped
    assert EngineConfig(model="m", **by_section) == flat                       # dicts for the sub-configs
    for section, kv in TOGETHER.items():
        for name, value in kv.items():
            assert getattr(getattr(grouped, section), name) == getattr(grouped, name) == value, name
    # mixed: a flat keyword applies on top of the sub-config given with it
    mixed = EngineConfig(model="m", cache=CacheConfig(block_size=32, kv_cache_dtype="fp8"), block_size=64,
                         max_num_seqs=8)
    assert (mixed.cache.block_size, mixed.cache.kv_cache_dtype, mixed.scheduler.max_num_seqs) == (64, "fp8", 8)
    assert EngineConfig("m").model == "m" and EngineConfig("m") == EngineConfig(model="m")


def test_an_unknown_keyword_is_one_config_error_naming_the_closest_knob():
    with pytest.raises(ConfigError, match=r"^unknown engine option max_num_seq \(did you mean max_num_seqs\?\)"):
        EngineConfig(model="m", max_num_seq=8)
    with pytest.raises(ConfigError) as e:
        EngineConfig(model="m", block_sise=32, colour="blue")
    msg = str(e.value)
    assert "\n" not in msg and "block_sise (did you mean block_size?)" in msg and "colour" in msg
    assert "docs/config.md" in msg
    with pytest.raises(ConfigError, match=r"max_num_seqs \(a knob of EngineConfig.scheduler\)"):
        EngineConfig(model="m", cache={"max_num_seqs": 8})
    with pytest.raises(ConfigError, match="expected a CacheConfig"):
        EngineConfig(model="m", cache=SchedulerConfig())
    from moet.llm import LLM
    with pytest.raises(ConfigError, match=r"did you mean enforce_eager\?"):    # before anything is loaded
        LLM("/nonexistent", enforce_eagre=True)


@pytest.mark.parametrize("kw,message", [
    (dict(max_num_seqs=0), "max_num_seqs=0 must be a positive integer"),
    (dict(block_size=24), "block_size=24 must be a power of two (16 is usual)"),
    (dict(max_num_batched_tokens=8), "max_num_batched_tokens=8 must be >= max_num_seqs=64 (every running sequence "
                                     "decodes one token per step)"),
    (dict(enable_chunked_prefill=False, max_model_len=9000), "without chunked prefill max_num_batched_tokens=8192 "
     "must be >= max_model_len=9000; raise it or enable chunked prefill"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 must be in (0, 1]"),
    (dict(device="tpu"), "device='tpu' is not supported; use auto, cpu, cuda or cuda:N"),
    (dict(expert_format="int3"), "expert_format='int3' is not supported; choose one of w2, fp4, bf16"),
    (dict(expert_cache_slots=8, expert_cache_gb=1.0), "set expert_cache_slots or expert_cache_gb, not both"),
    (dict(expert_decode_mode="eager", expert_demand_fetch=False), "expert_decode_mode='eager' runs decode steps "
     "eagerly with demand fetch; it needs expert_demand_fetch on (or expert_decode_mode=graph)"),
    (dict(model=""), "model must be a checkpoint directory path"),
])
def test_validation_keeps_its_messages(kw, message):
    kw = {"model": "m", **kw}
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert str(e.value) == message


def test_cli_flags_stay_flat_and_build_the_grouped_config():
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    add_serve_arguments(p)
    cfg = from_cli_args(p.parse_args(["m", "--max-num-seqs", "8", "--block-size", "32", "--expert-format", "fp4",
                                      "--no-async-scheduling", "--enforce-eager", "--pack-dir", "/p",
                                      "--max-model-len", "512"]))
    assert (cfg.scheduler.max_num_seqs, cfg.cache.block_size, cfg.load.expert_format, cfg.scheduler.async_scheduling,
            cfg.kernels.enforce_eager, cfg.store.pack_dir, cfg.scheduler.max_model_len) == \
        (8, 32, "fp4", False, True, "/p", 512)
    assert cfg == EngineConfig(model="m", max_num_seqs=8, block_size=32, expert_format="fp4", async_scheduling=False,
                               enforce_eager=True, pack_dir="/p", max_model_len=512)
    assert from_cli_args(p.parse_args(["m"])) == EngineConfig(model="m")
    # every knob is one flag, shown in its sub-config's --help group
    group_of = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert group_of[f.name] == cls.title, f.name
    with pytest.raises(ConfigError, match=r"^--block-size=24 must be a power of two"):
        from_cli_args(p.parse_args(["m", "--block-size", "24"]))


def test_replace_changes_one_knob_and_checks_it():
    cfg = EngineConfig(model="m", max_num_seqs=8, block_size=32)
    moved = dataclasses.replace(cfg, block_size=64)
    assert moved.cache.block_size == 64 and moved.block_size == 64 and cfg.cache.block_size == 32
    assert moved.scheduler == cfg.scheduler and moved.cache.kv_cache_dtype == cfg.cache.kv_cache_dtype
    assert dataclasses.replace(cfg, cache=CacheConfig(block_size=128)).cache == CacheConfig(block_size=128)
    assert dataclasses.replace(cfg, model="other").model == "other"
    with pytest.raises(ConfigError, match="power of two"):
        dataclasses.replace(cfg, block_size=24)
    with pytest.raises(dataclasses.FrozenInstanceError):           # a sub-config is a value: replace it
        cfg.cache.block_size = 64
    with pytest.raises(AttributeError):                            # the flat names are reads only
        cfg.block_size = 64


def test_pickle_copy_and_asdict_round_trip():
    cfg = EngineConfig(model="m", **ALL_FLAT)
    for back in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert back == cfg and back is not cfg
        assert back.cache.block_size == back.block_size == 32 and back.store.pack_dir == "/packs"
    d = dataclasses.asdict(cfg)
    assert d["scheduler"]["max_num_seqs"] == 8 and d["model"] == "m"
    assert EngineConfig(**d) == cfg
    assert EngineConfig(**cfg.knob_values()) == cfg
    assert set(cfg.knob_values()) == set(EngineConfig.field_names())

