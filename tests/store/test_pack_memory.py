"""First boot quantizes in a stream: building a pack holds about one shard's mapped pages plus
one layer's rows in host memory, not the checkpoint (measured in a fresh subprocess)."""
import json
import os
import subprocess
import sys

from moet.testing.tiny_checkpoint import make_checkpoint

SHARD = 12 * 2**20

PROBE = r"""
import gc, json, sys
import torch
from moet.checkpoint import open_checkpoint
from moet.store import open_pack

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

ckpt = open_checkpoint(sys.argv[1])
torch.zeros(1) + 1
import xxhash, tqdm  # noqa: F401  (imports are not the build's memory)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                   # reset VmHWM: the peak of the build only
base = status("VmRSS")
with open_pack(ckpt, sys.argv[2]) as pack:
    layer_rows = pack.num_experts * pack.stride
    print(json.dumps({"base": base, "peak": status("VmHWM"), "layer_rows": layer_rows,
                      "pack": pack.meta.file_bytes, "built": pack.built_layers}))
"""


def test_pack_build_peak_rss_is_bounded(tmp_path):
    # ~100 MB of float32 experts in 12 MiB shards, 4 MoE layers of ~25 MB each
    path = make_checkpoint(str(tmp_path / "big"), "mixtral", tokenizer=False, max_shard_bytes=SHARD,
                           hidden_size=256, intermediate_size=512, num_local_experts=16, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert total > 6 * SHARD
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", PROBE, path, str(tmp_path / "packs")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["built"] == 4
    held = m["peak"] - m["base"]
    print(f"build held {held / 2**20:.1f} MiB (shard {SHARD / 2**20:.0f} MiB, layer rows "
          f"{m['layer_rows'] / 2**20:.1f} MiB, checkpoint {total / 2**20:.0f} MiB)")
    assert held < SHARD + 2 * m["layer_rows"] + 32 * 2**20, f"{held / 2**20:.0f} MiB"
    assert SHARD + 2 * m["layer_rows"] + 32 * 2**20 < total / 2   # reading everything would break the bound
