"""Loading never holds more than about one shard's worth of tensors in host memory beyond the
model itself. Measured in a fresh subprocess: peak RSS during the load minus RSS after it
(the model) must stay under one shard plus a small allowance, on a checkpoint whose total
size is many times that bound (so a load that reads everything first would fail)."""
import json
import os
import subprocess
import sys

from moet.testing.tiny_checkpoint import make_checkpoint

SHARD = 12 * 2**20

PROBE = r"""
import json, sys, gc
import torch
from moet.checkpoint import open_checkpoint
from moet.model import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():  # ru_maxrss would include the parent's peak at fork; VmHWM can be reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

ckpt = open_checkpoint(sys.argv[1])
torch.zeros(1) + 1  # warm up torch's allocator / lazy imports before the baseline
gc.collect()
reset_peak()
base, peak0 = status("VmRSS"), status("VmHWM")
model = load_model(ckpt, expert_format=sys.argv[2], dtype=torch.float32)
gc.collect()
after, peak = status("VmRSS"), status("VmHWM")
from moet.kernels.pools import pool_nbytes
from moet.model.layers.moe import MoE
model_bytes = sum(p.nbytes for p in model.parameters()) + sum(
    pool_nbytes(m.experts.pool) for m in model.modules() if isinstance(m, MoE))
print(json.dumps({"base": base, "peak0": peak0, "after": after, "peak": peak, "model": model_bytes}))
"""


def test_load_peak_rss_is_bounded_by_one_shard(tmp_path):
    # ~100 MB of float32 experts in 12 MiB shards; the W2 model is ~14x smaller than that
    path = make_checkpoint(str(tmp_path / "big"), "mixtral", tokenizer=False, max_shard_bytes=SHARD,
                           hidden_size=256, intermediate_size=512, num_local_experts=16, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert total > 6 * SHARD
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", PROBE, path, "w2"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["peak0"] < m["base"] + 16 * 2**20  # the peak was reset: it measures the load only
    held = m["peak"] - m["base"] - m["model"]
    assert held < SHARD + 32 * 2**20, f"load held {held / 2**20:.0f} MiB beyond the model"
    assert m["model"] < total / 8  # so reading the whole checkpoint would break the bound
