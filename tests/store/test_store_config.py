"""The store's EngineConfig fields: CLI flags with types, validation with messages that name them."""
import argparse

import pytest

from moet.config import EngineConfig, add_cli_arguments, from_cli_args
from moet.errors import ConfigError


def test_flags_parse_to_typed_fields():
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    cfg = from_cli_args(p.parse_args(["m", "--pack-dir", "/x", "--expert-cache-slots", "96", "--host-arena-gb",
                                      "1.5", "--miss-tolerance", "8", "--pack-verify", "full", "--rebuild-pack",
                                      "--o-direct", "--expert-cache-policy", "lru"]))
    assert (cfg.pack_dir, cfg.expert_cache_slots, cfg.host_arena_gb, cfg.miss_tolerance, cfg.pack_verify,
            cfg.rebuild_pack, cfg.o_direct, cfg.expert_cache_policy) == ("/x", 96, 1.5, 8, "full", True, True, "lru")
    d = EngineConfig(model="m")
    assert (d.expert_cache_slots, d.expert_cache_gb, d.miss_tolerance, d.pack_verify, d.rebuild_pack) == (
        None, None, 0, "lazy", False)


@pytest.mark.parametrize("kw,match", [
    (dict(expert_cache_slots=8, expert_cache_gb=1.0), "not both"),
    (dict(expert_cache_slots=0), "expert_cache_slots"),
    (dict(host_arena_gb=-1.0), "host_arena_gb"),
    (dict(miss_tolerance=-1), "miss_tolerance"),
    (dict(pack_verify="sometimes"), "pack_verify"),
])
def test_bad_values_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **kw)
