import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.model import load_model
from moet.store.pack_file import field_bytes
from moet.testing.tiny_checkpoint import cached_checkpoint


@pytest.fixture(scope="module")
def qwen40_pack(tmp_path_factory):
    """(checkpoint, fully resident float32 W2 reference model, its pack) of a tiny Qwen3-MoE with
    2 MoE layers x 40 experts: enough rows for caches of 10-50%."""
    from moet.store import open_pack
    ckpt = open_checkpoint(cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=40))
    ref = load_model(ckpt, expert_format="w2", dtype=torch.float32)
    pack = open_pack(ckpt, str(tmp_path_factory.mktemp("packs")))
    yield ckpt, ref, pack
    pack.close()


@pytest.fixture(scope="session")
def ds_ckpt():
    """DeepSeek-V3 tiny: 2 MoE layers + 1 MoE MTP layer, 8 experts, float32 on disk."""
    return cached_checkpoint("deepseek_v3", "bf16", tokenizer=False)


def resident_rows(path: str, tag: str, **load_kw) -> dict[str, object]:
    """{pack layer name: pool} the loader builds with every expert resident (the reference)."""
    model = load_model(open_checkpoint(path), expert_format=tag, dtype=torch.float32, **load_kw)
    return {name: moe.experts.pool for name, moe in model.moe_blocks().items()}


def assert_pack_equals_pools(pack, pools: dict) -> None:
    """Every pack row read back from disk (checksum checked) equals the loader's pool slot, byte for byte."""
    buf = bytearray(pack.stride)
    for l, name in enumerate(pack.meta.layers):
        pool = pools[name]
        for e in range(pack.num_experts):
            pack.read_row_into(l, e, memoryview(buf))
            row = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
            for f in pack.layout.fields:
                assert torch.equal(row[f.offset:f.offset + f.nbytes], field_bytes(pool, f)[e]), (name, e, f.name)
            assert not row[pack.layout.row_bytes:].any()   # padding is zero
