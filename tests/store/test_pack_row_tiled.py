"""Packs of row-tiled pools (nb8t / nvfp4t: H and I multiples of 256, as DeepSeek-V3 / Qwen3-MoE):
the rows hold the tiled bytes the model's pools hold, the layout is part of the row layout (a pack
written for the row-major layout is rebuilt, never read), and a device cache filled from the pack
gives the fully resident model's logits bit for bit."""
import json

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.model import load_model
from moet.store import ExpertCache, HostArena, open_pack, run_with_replay
from moet.testing.tiny_checkpoint import cached_checkpoint

from .conftest import assert_pack_equals_pools, resident_rows

TILED = {"w2": "nb8t", "fp4": "nvfp4t"}


@pytest.fixture(scope="module")
def wide_ckpt():
    """Qwen3-MoE with hidden 256 and expert width 256: the smallest shapes the tiled layouts take."""
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, hidden_size=256, moe_intermediate_size=256,
                             num_experts=6, num_hidden_layers=2, mlp_only_layers=[])


@pytest.mark.parametrize("tag", ["w2", "fp4"])
def test_row_tiled_pack_rows_layout_and_stale_layout_rebuild(tmp_path, wide_ckpt, tag):
    ckpt = open_checkpoint(wide_ckpt)
    with open_pack(ckpt, str(tmp_path), tag=tag) as pack:
        assert pack.layout.attrs["layout"] == TILED[tag]
        assert_pack_equals_pools(pack, resident_rows(wide_ckpt, tag))
        n, sidecar = len(pack.meta.layers), pack.paths.sidecar
    side = json.load(open(sidecar))                      # as written before the pools were tiled
    side["row"]["attrs"]["layout"] = {"w2": "nb8", "fp4": "nvfp4"}[tag]
    json.dump(side, open(sidecar, "w"))
    with open_pack(ckpt, str(tmp_path), tag=tag) as pack:
        assert pack.built_layers == n and pack.layout.attrs["layout"] == TILED[tag]
        assert_pack_equals_pools(pack, resident_rows(wide_ckpt, tag))


@pytest.mark.parametrize("tag", ["w2", "fp4"])
def test_row_tiled_cache_equals_resident_bit_for_bit(tmp_path, wide_ckpt, tag):
    ckpt = open_checkpoint(wide_ckpt)
    ref = load_model(ckpt, expert_format=tag, dtype=torch.float32)
    assert all(m.experts.pool.layout == TILED[tag] for m in ref.moe_blocks().values())
    model = load_model(ckpt, expert_format=tag, dtype=torch.float32, routed_experts=False)
    with open_pack(ckpt, str(tmp_path), tag=tag) as pack:
        rows = pack.num_layers * pack.num_experts
        cache = ExpertCache(pack, rows // 2, "cpu", arena=HostArena(pack, 2, pin=False))
        cache.attach(model.moe_blocks())
        tokens = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(7))
        kv_ref, kv = ref.new_cache(64, "cpu"), model.new_cache(64, "cpu")
        for pos in range(len(tokens)):          # one token a step: 4 experts a step, 6 slots, 12 rows
            ids = tokens[pos:pos + 1]
            want = ref.forward(ids, pos, kv_ref)
            got, res = run_with_replay(lambda: model.forward(ids, pos, kv), cache, scan=False)  # noqa: B023
            assert torch.equal(got, want) and res.tolerated_misses == 0, pos
        assert cache.rows_fetched > cache.num_slots      # rows were evicted and fetched again
