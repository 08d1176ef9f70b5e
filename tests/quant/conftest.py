import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moet.formats import fp8_block, mxfp4, nvfp4


def write_expert_checkpoint(path: Path, fmt: str, *, layers=2, experts=3, n=64, k=128, seed=0, shards=2,
                            weight_fn=None) -> dict[str, torch.Tensor]:
    """A checkpoint holding only routed experts (+ one shared expert and a dense tensor that must
    be ignored), in `fmt`: bf16 | fused | nvfp4 | fp8 | mxfp4. Returns the float weights written."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    mk = weight_fn or (lambda shape: torch.randn(*shape, generator=g) * 0.02)
    for L in range(layers):
        base = f"model.layers.{L}.mlp"
        tensors[f"{base}.shared_experts.up_proj.weight"] = mk((n, k)).bfloat16()
        tensors[f"model.layers.{L}.self_attn.o_proj.weight"] = mk((k, k)).bfloat16()
        if fmt in ("fused", "mxfp4"):
            gu, dn = mk((experts, 2 * n, k)), mk((experts, k, n))
            if fmt == "fused":
                tensors[f"{base}.experts.gate_up_proj"] = gu.bfloat16()
                tensors[f"{base}.experts.down_proj"] = dn.bfloat16()
            else:
                for nm, w in (("gate_up_proj", gu), ("down_proj", dn)):
                    b, s = mxfp4.quantize(w)
                    tensors[f"{base}.experts.{nm}_blocks"], tensors[f"{base}.experts.{nm}_scales"] = b, s
            for e in range(experts):
                truth[f"{base}.experts.gate_up_proj.{e}"] = gu[e]
                truth[f"{base}.experts.down_proj.{e}"] = dn[e]
            continue
        for e in range(experts):
            for proj, shape in (("gate_proj", (n, k)), ("up_proj", (n, k)), ("down_proj", (k, n))):
                name = f"{base}.experts.{e}.{proj}"
                w = mk(shape)
                truth[name] = w
                if fmt == "bf16":
                    tensors[name + ".weight"] = w.bfloat16()
                elif fmt == "nvfp4":
                    t = nvfp4.quantize(w)
                    tensors[name + ".weight"], tensors[name + ".weight_scale"] = t.weight, t.weight_scale
                    tensors[name + ".weight_scale_2"] = t.weight_scale_2
                elif fmt == "fp8":
                    q, s = fp8_block.quantize(w)
                    tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = q, s
                else:
                    raise AssertionError(fmt)
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {nm: tensors[nm].contiguous() for nm in names[i * per:(i + 1) * per]}
        if part:
            save_file(part, str(path / fname))
            weight_map.update({nm: fname for nm in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"architectures": ["TestMoe"], "model_type": "test"}))
    return truth
