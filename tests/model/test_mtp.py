"""MTP layers (DeepSeek-V3 layout, also GLM-4.5): moet's mtp_forward equals the same
computation built from transformers' own decoder-layer class with the MTP block's weights:
enorm(embed(next token)) | hnorm(main hidden) -> eh_proj -> decoder layer -> shared_head."""
import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.model import load_model
from moet.testing.tiny_checkpoint import cached_checkpoint, reference_model


def _transformers_mtp(ref, reader, ids, next_ids):
    cfg = ref.config
    n = cfg.num_hidden_layers
    pre = f"model.layers.{n}."
    get = lambda k: reader.get(pre + k).float()
    layer = type(ref.model.layers[-1])(cfg, layer_idx=n - 1)
    sd, experts = {}, {}
    for name in reader.tensors:
        if not name.startswith(pre):
            continue
        rest = name[len(pre):]
        if ".experts." in rest:
            e, proj = rest.split(".experts.")[1].split(".")[:2]
            experts.setdefault(proj, {})[int(e)] = get(rest)
        elif rest.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")):
            sd[rest] = get(rest)
    num = len(experts["gate_proj"])
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts["gate_proj"][e], experts["up_proj"][e]])
                                                  for e in range(num)])
    sd["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(num)])
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and all("e_score_correction_bias" not in m for m in missing), (missing, unexpected)
    layer.eval()

    norm_cls = type(ref.model.norm)

    def norm(key):
        m = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m.weight.data.copy_(get(key))
        return m

    with torch.no_grad():
        main = ref.model(ids[None]).last_hidden_state  # post final norm, what the LM head sees
        x = torch.cat([norm("enorm.weight")(ref.model.embed_tokens(next_ids[None])),
                       norm("hnorm.weight")(main)], dim=-1) @ get("eh_proj.weight").T
        pos = torch.arange(ids.shape[0])[None]
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=ref.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        logits = norm("shared_head.norm.weight")(out) @ get("shared_head.head.weight").T
    return logits[0]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_forward_matches_transformers_layer(family):
    path = cached_checkpoint(family)
    ckpt = open_checkpoint(path)
    ref = reference_model(path)
    model = load_model(ckpt, expert_format="bf16", dtype=torch.float32)
    ids = torch.arange(30, 50)
    next_ids = torch.cat([ids[1:], torch.tensor([7])])
    with torch.no_grad():
        cache = model.new_cache(32, "cpu")
        hidden = model.model.norm(model.hidden_states(ids, 0, cache))
        _, got = model.mtp_forward(0, next_ids, hidden, 0, cache)
    want = _transformers_mtp(ref, ckpt.reader, ids, next_ids)
    assert (got.log_softmax(-1) - want.log_softmax(-1)).abs().max() < 1e-4
