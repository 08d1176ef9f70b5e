"""Load a DeepSeek-V3-layout checkpoint (moet-tiny) into transformers' DeepseekV3ForCausalLM
with the routed experts in a chosen number format, plus its MTP layer: the independent reference
that tests hold moet's engine-backed probes (moet.probe.engine) to, and the path of
`moet probe --expert-activations e4m3` (moet.probe.activations emulates a kernel the engine does
not have). Only the routed-expert weights change between formats:
  bf16   the checkpoint's experts as stored (BF16 checkpoints), or NVFP4 decoded exactly
  nvfp4  NVFP4 decoded (BF16 experts are first quantized with moet.formats.nvfp4.quantize)
  w2     NVFP4 -> moet.formats.w2.from_nvfp4 -> decoded (BF16 experts: w2.quantize)
For the shipped NVFP4 checkpoint bf16 and nvfp4 are therefore the same weights; the card's
BF16 row was measured on the trained weights before quantization.

`activations` (moet.probe.activations) picks what the routed experts' matmuls read: bf16 =
the model's dtype, unquantized (default); e4m3 = the PTX W2 kernel's float8 activations.

`Loaded` offers the probes the same two calls as moet.probe.engine.EngineModel: `generate`
(batched greedy completions through transformers' generate()) and `score` (teacher-forced
next-token logprobs and the MTP head's next-next top-1).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from moet.errors import CheckpointError
from moet.formats import nvfp4, w2
from moet.probe.activations import EXPERT_ACTIVATIONS, ExpertActivations, apply_expert_activations

EXPERT_FORMATS = ("bf16", "nvfp4", "w2")


def default_checkpoint() -> Path:
    from moet.assets import MOET_TINY
    return MOET_TINY


def read_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(ckpt.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{ckpt}: no safetensors files; pass a checkpoint directory (moet probe CKPT)")
    out = {}
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def expert_weight(t: dict[str, torch.Tensor], prefix: str, fmt: str) -> torch.Tensor:
    """One routed-expert linear (prefix ends in .gate_proj etc.) -> float32 [N, K] in `fmt`."""
    w = t[f"{prefix}.weight"]
    if w.dtype == torch.uint8:  # NVFP4
        ws, ws2 = t[f"{prefix}.weight_scale"], t[f"{prefix}.weight_scale_2"]
        if fmt == "w2":
            return w2.dequantize(w2.from_nvfp4(w, ws, ws2, name=prefix))
        return nvfp4.dequantize(w, ws, ws2, name=prefix)
    w = w.float()
    if fmt == "nvfp4":
        q = nvfp4.quantize(w, name=prefix)
        return nvfp4.dequantize(q.weight, q.weight_scale, q.weight_scale_2)
    if fmt == "w2":
        return w2.dequantize(w2.quantize(w, name=prefix))
    return w


def hf_config(ckpt: Path, attn_implementation: str = "sdpa"):
    from transformers import DeepseekV3Config
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config", None)  # experts arrive already decoded
    config = DeepseekV3Config.from_dict(cfg)
    config._attn_implementation = attn_implementation
    return config


class MTPHead(nn.Module):
    """DeepSeek-V3 MTP layer built from transformers' own modules (layer index = L)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
        self.norm = DeepseekV3RMSNorm(h, eps)
        self.head = nn.Linear(h, config.vocab_size, bias=False)

    def forward(self, model, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced drafts: hidden [B, T, H] = the main model's final (post-norm) states
        for input_ids [B, T]; returns logits [B, T-1, V] for tokens 2..T (position t predicts
        t+2 from h_t and token t+1, placed at position t+1)."""
        emb = model.model.embed_tokens(input_ids[:, 1:])
        pos = torch.arange(1, input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        pe = model.model.rotary_emb(emb, pos)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden[:, :-1])], dim=-1))
        out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        x = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(x))


@dataclass
class Loaded:
    model: nn.Module        # DeepseekV3ForCausalLM
    mtp: MTPHead
    tokenizer: object
    experts: str
    device: torch.device
    dtype: torch.dtype
    activations: str = "bf16"   # routed experts' activations: bf16 (unquantized) | e4m3
    backend: str = field(default="transformers", init=False)

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, batch: int, tick=lambda n: None) -> list[str]:
        """Greedy completions of token-id prompts (decoded, special tokens kept so the parser
        sees <|end|>), `batch` prompts per generate() call, left-padded; tick(k) after each."""
        tok, dev = self.tokenizer, self.device
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # little padding per batch
        out: list[str] = [""] * len(prompts)
        for b in range(0, len(order), batch):
            idx = order[b:b + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[j, width - len(prompts[i]):] = 1
            gen = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for j, i in enumerate(idx):
                out[i] = tok.decode(gen[j, width:].tolist(), skip_special_tokens=False).replace(tok.pad_token, "")
            tick(len(idx))
        return out

    @torch.no_grad()
    def score(self, seqs: list[list[int]], k: int, batch: int, tick=lambda n: None):
        """Teacher-forced scores of equal-length sequences, `batch` per forward: next-token
        logprobs and top-k (moet.probe.distributions.CodeScores) and the MTP head's next-next
        top-1."""
        import numpy as np

        from moet.probe.distributions import CodeScores, concat
        parts = []
        for b in range(0, len(seqs), batch):
            xb = torch.tensor(seqs[b:b + batch], device=self.device)
            h = self.model.model(xb).last_hidden_state
            lp = self.model.lm_head(h)[:, :-1].float().log_softmax(-1).flatten(0, 1)
            tgt = xb[:, 1:].flatten()
            top_lp, top_ids = lp.topk(k, dim=-1)
            mtp_logits = self.mtp(self.model, xb, h)[:, :-1]  # position t predicts t+2
            parts.append(CodeScores(lp.gather(1, tgt[:, None])[:, 0].double().cpu().numpy(),
                                    (lp.argmax(-1) == tgt).cpu().numpy(), top_ids.cpu().numpy().astype(np.int64),
                                    top_lp.double().cpu().numpy(),
                                    int((mtp_logits.argmax(-1) == xb[:, 2:]).sum()), xb[:, 2:].numel()))
            tick(xb.shape[0])
        return concat(parts)


def load(ckpt: Path | str | None = None, experts: str = "nvfp4", device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None, tensors: dict[str, torch.Tensor] | None = None,
         activations: ExpertActivations = "bf16") -> Loaded:
    """`tensors` lets a caller reuse one read of the files across formats; `activations` sets the
    routed experts' activation format (moet.probe.activations)."""
    from transformers import AutoTokenizer
    ckpt = Path(ckpt) if ckpt is not None else default_checkpoint()
    if not (ckpt / "config.json").exists():
        raise CheckpointError(f"{ckpt}: no config.json; pass a Hugging Face checkpoint directory")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    t = tensors if tensors is not None else read_tensors(ckpt)
    if activations not in EXPERT_ACTIVATIONS:
        raise CheckpointError(f"unknown expert activations {activations!r}; use one of {', '.join(EXPERT_ACTIVATIONS)}")
    model, mtp = build(hf_config(ckpt), t, experts, device, dtype)
    apply_expert_activations([model, mtp], activations)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    return Loaded(model, mtp, tok, experts, device, dtype, activations)


def build(config, t: dict[str, torch.Tensor], experts: str, device: torch.device, dtype: torch.dtype
          ) -> tuple[nn.Module, MTPHead]:
    """transformers' DeepseekV3ForCausalLM + MTPHead from checkpoint tensors (names as on disk)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    if experts not in EXPERT_FORMATS:
        raise CheckpointError(f"unknown expert format {experts!r}; use one of {', '.join(EXPERT_FORMATS)}")
    n_layers, n_exp = config.num_hidden_layers, config.n_routed_experts

    def fused(layer: int) -> dict[str, torch.Tensor]:
        gu, dn = [], []
        for e in range(n_exp):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            gu.append(torch.cat([expert_weight(t, f"{p}.gate_proj", experts), expert_weight(t, f"{p}.up_proj", experts)]))
            dn.append(expert_weight(t, f"{p}.down_proj", experts))
        return {"mlp.experts.gate_up_proj": torch.stack(gu), "mlp.experts.down_proj": torch.stack(dn)}

    main, mtp_sd = {}, {}
    mtp_prefix = f"model.layers.{n_layers}."
    for k, v in t.items():
        if ".mlp.experts." in k:
            continue
        if k.startswith(mtp_prefix):
            mtp_sd[k[len(mtp_prefix):]] = v
        else:
            main[k] = v
    for layer in range(config.first_k_dense_replace, n_layers + 1):
        for k, v in fused(layer).items():
            if layer == n_layers:
                mtp_sd[k] = v
            else:
                main[f"model.layers.{layer}.{k}"] = v

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
        mtp = MTPHead(config)
    model.load_state_dict(main, strict=True, assign=True)
    remap = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "head.weight"}
    mtp.load_state_dict({remap.get(k, f"layer.{k}"): v for k, v in mtp_sd.items()}, strict=True, assign=True)
    for m in (model, mtp):
        # Router weights and the correction bias stay fp32 (transformers keeps them so).
        for name, p in list(m.named_parameters()) + list(m.named_buffers()):
            if p.is_meta:
                continue  # non-persistent rotary buffers, rebuilt below
            keep32 = name.endswith(("e_score_correction_bias", "mlp.gate.weight"))
            p.data = p.data.to(device=device, dtype=torch.float32 if keep32 else dtype)
        m.eval()
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them.
    model.model.rotary_emb = DeepseekV3RotaryEmbedding(config=config).to(device)
    return model, mtp
