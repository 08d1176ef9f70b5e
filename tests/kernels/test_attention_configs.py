"""The GQA decode launch table (moet/kernels/attention_configs.json): lookups by device, shape and
batch size, the fallback, and the rule that keeps outputs batch-invariant (num_warps, which sets
the dots' layouts, is one number per entry; only num_stages may follow the batch size)."""
from __future__ import annotations

import torch

from moet.kernels import attention_configs as ac
from moet.kernels.kv_cache import KVFormat


def test_shipped_table_varies_only_the_stages_by_batch():
    devices = ac.load_table()["devices"]
    assert "NVIDIA H200" in devices
    for name, kernels in devices.items():
        for key, entry in kernels["gqa_decode"].items():
            assert isinstance(entry["num_warps"], int), (name, key)          # never per batch
            stages = entry["num_stages"]
            assert isinstance(stages, int) or all(int(b) >= 1 and isinstance(s, int) for b, s in stages.items())
            assert entry.get("source"), (name, key)                           # where it was measured


def test_lookup_takes_the_largest_measured_batch_not_above():
    table = {"devices": {"GPU X": {"gqa_decode": {"bf16 D128 T64": {"num_warps": 8,
                                                                    "num_stages": {"2": 7, "16": 4}}}}}}
    pick = [ac.lookup_gqa_decode("GPU X", "bf16 D128 T64", b, table) for b in (1, 2, 15, 16, 1000)]
    assert pick == [ac.GQALaunch(8, 7)] * 3 + [ac.GQALaunch(8, 4)] * 2
    assert ac.lookup_gqa_decode("GPU Y", "bf16 D128 T64", 1, table) == ac.DEFAULT_GQA_DECODE
    assert ac.lookup_gqa_decode("GPU X", "fp8 D128 T64", 1, table) == ac.DEFAULT_GQA_DECODE
    assert ac.load_table("/nonexistent/attention_configs.json") == {"version": 1, "devices": {}}


def test_shape_keys():
    assert ac.gqa_shape_key(KVFormat("auto", dtype=torch.bfloat16), torch.bfloat16, 128, 128, 64) == "bf16 D128 T64"
    assert ac.gqa_shape_key(KVFormat("fp8_e4m3", "tensor"), torch.float8_e4m3fn, 128, 128, 64) == "fp8 D128 T64"
    assert (ac.gqa_shape_key(KVFormat("fp8_e4m3", "block", group=64), torch.float8_e4m3fn, 192, 128, 32)
            == "fp8-block D192 DV128 T32")
    assert ac.gqa_shape_key(KVFormat("auto", dtype=torch.float32), torch.float32, 64, 64, 16) == "fp32 D64 T16"
