"""The causal LM for every supported family, built from a ModelSpec alone.

All four families share one skeleton (pre-norm decoder, residual adds, final norm, LM head);
they differ in attention (GQA or MLA), rope, which layers are MoE, the routing rule and shared
experts, all of which the spec carries. Module names follow the canonical tensor names
(ModelSpec.canonical_name), so loading is a name lookup.

MTP layers (DeepSeek-V3 layout, also GLM-4.5): mtp.{j} = enorm(embed(token_{t+1})) and
hnorm(hidden_t) -> eh_proj(concat) -> one decoder layer -> shared_head.norm -> shared_head.head.
They are loaded and kept for speculative decoding; `mtp_forward` runs one.
"""
from __future__ import annotations

import torch
from torch import nn

from moet.checkpoint.spec import ModelSpec
from moet.kernels.attention_ops import DEFAULT_SPLIT_TOKENS
from moet.kernels.kv_cache import KVFormat, check_kv_format, kv_layer_bytes_per_token, new_gqa_layer, new_mla_layer
from moet.model.attention_batch import AttentionBatch
from moet.kernels.sparse_attention import index_key_bytes_per_token, new_index_keys
from moet.model.layers.attention import GQAttention
from moet.model.layers.dsa import TopKSelection
from moet.model.layers.gated_deltanet import GatedDeltaNet, RecurrentState
from moet.model.layers.linear import MLP, Linear
from moet.model.layers.mla import MLAttention
from moet.model.layers.moe import MoE
from moet.model.moe_model import MoEModel
from moet.model.layers.norm import RMSNorm
from moet.model.layers.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str, rotary: Rotary, dtype: torch.dtype,
                 sparse: tuple[bool, TopKSelection] | None = None, index: int | None = None):
        """sparse (DSA models): whether this layer runs its own indexer, and the selection it
        writes or, for a shared layer, reads. index: the decoder layer's number (its attention
        may differ from the model's, ModelSpec.layer_attention); None = an MTP block's layer."""
        super().__init__()
        linear = spec.linear_attention
        if linear is not None and linear.layer_types[index if index is not None else spec.num_layers - 1] == "linear":
            # Qwen3.5: a gated DeltaNet where the others attend (checkpoint: linear_attn, renamed)
            self.self_attn = GatedDeltaNet(linear, spec.hidden_size, spec.rms_norm_eps, dtype)
        elif spec.attention.kind == "mla":
            dsa = None if sparse is None else (spec.sparse_attention, *sparse)
            self.self_attn = MLAttention(spec.attention, spec.hidden_size, rotary, spec.rms_norm_eps, dtype, dsa)
        else:
            attention = spec.layer_attention(index if index is not None else spec.num_layers - 1)
            self.self_attn = GQAttention(attention, spec.hidden_size, rotary, spec.rms_norm_eps, dtype)
        self.mlp = MoE(spec, dtype) if kind == "moe" else MLP(spec.hidden_size, spec.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        # the expert store's prefetch hook (moet/store/prefetch.py): sees the residual after this
        # layer's attention to guess the next layer's experts; None = no store / prefetch off
        self.expert_prefetch = None

    # Residual stream as vLLM carries it: a layer takes (delta, x) -- the previous layer's MLP
    # output and the residual before it -- and returns its own (delta, x). The add in front of
    # each norm is then fused into the norm (RMSNorm.add: one kernel on CUDA). delta None: x is
    # the embedding. delta is a pair (mlp out, second part or None): an MoE block with shared
    # experts leaves routed and shared unsummed (MoE.forward_parts) and the next norm adds both.
    # The sums are the same bf16 adds as x + attn(...), x + (routed + shared).

    def _mlp_parts(self, h):
        if isinstance(self.mlp, MoE):
            return self.mlp.forward_parts(h)
        return self.mlp(h), None

    def _norm_in(self, delta, x):
        return self.input_layernorm.add(delta[0], x, delta[1]) if delta is not None else (self.input_layernorm(x), x)

    @staticmethod
    def finish(delta, x):
        """The residual stream after the last layer: x + delta, as the layer's own adds."""
        d, d2 = delta
        return x + (d if d2 is None else d + d2)

    def step(self, delta, x, cos, sin, cache, start):
        h, x = self._norm_in(delta, x)
        h, x = self.post_attention_layernorm.add(self.self_attn(h, cos, sin, cache, start), x)
        if self.expert_prefetch is not None:
            self.expert_prefetch(x)
        return self._mlp_parts(h), x

    def step_paged(self, delta, x, cos, sin, batch: AttentionBatch, kv, split_tokens: int):
        h, x = self._norm_in(delta, x)
        h, x = self.post_attention_layernorm.add(
            self.self_attn.forward_paged(h, cos, sin, batch, kv, split_tokens), x)
        if self.expert_prefetch is not None:
            self.expert_prefetch(x)
        return self._mlp_parts(h), x

    def forward(self, x, cos, sin, cache, start):
        delta, x = self.step(None, x, cos, sin, cache, start)
        return self.finish(delta, x)

    def forward_paged(self, x, cos, sin, batch: AttentionBatch, kv, split_tokens: int):
        delta, x = self.step_paged(None, x, cos, sin, batch, kv, split_tokens)
        return self.finish(delta, x)


class SharedHead(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.head = Linear(spec.hidden_size, spec.vocab_size, False, dtype)


class MTPLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: Rotary, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * spec.hidden_size, spec.hidden_size, False, dtype)
        # an MTP layer of a DSA model runs an indexer of its own
        sparse = (True, TopKSelection()) if spec.sparse_attention is not None else None
        self.layer = DecoderLayer(spec, spec.layer_kinds[-1], rotary, dtype, sparse)
        self.shared_head = SharedHead(spec, dtype)
        # which of embed_tokens / shared_head.head the checkpoint provided (else the main model's)
        self.has_own_embed = False
        self.has_own_head = False


def _sparse_layers(spec: ModelSpec) -> list[tuple[bool, TopKSelection] | None]:
    """Per decoder layer of a DSA model: (runs its own indexer, the selection it writes or reads):
    a shared layer reads the selection of the last full layer before it."""
    if spec.sparse_attention is None:
        return [None] * spec.num_layers
    out, sel = [], None
    for t in spec.sparse_attention.layer_types:
        if t == "full":
            sel = TopKSelection()
        out.append((t == "full", sel))
    return out


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, spec: ModelSpec, rotary: Rotary, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, k, rotary, dtype, sparse, i)
                                    for i, (k, sparse) in enumerate(zip(spec.layer_kinds, _sparse_layers(spec))))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


def _offset_loader(offset: float):
    """A norm weight stored as its offset from `offset` (Qwen3.5: scale = 1 + w): loaded as the
    scale itself, added in float32."""
    def load(param: nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
        from moet.errors import CheckpointError
        w = parts.get("weight")
        if fmt != "float" or w is None or tuple(w.shape) != tuple(param.shape):
            raise CheckpointError(f"{where}: norm weight stored as {fmt} {list(w.shape) if w is not None else ''}; "
                                  f"config.json implies float {list(param.shape)}")
        param.data.copy_(w.float() + offset)
    return load


class CausalLM(MoEModel):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, *, load_mtp: bool = True):
        super().__init__()
        self.spec, self.dtype = spec, dtype
        self.rotary = Rotary(spec.rope, spec.max_position_embeddings)
        self.model = Backbone(spec, self.rotary, dtype)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype)
        n_mtp = spec.num_mtp_layers if load_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(spec, self.rotary, dtype) for _ in range(n_mtp))
        if spec.norm_offset:
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.weight_loader = _offset_loader(spec.norm_offset)
        # decode split-K partition of the Triton kernels: fixed per model, never per batch
        # (kernels/attention_ops.py says why)
        self.split_tokens = DEFAULT_SPLIT_TOKENS

    def fuse_projections(self) -> int:
        """Stacked weights where several GEMVs read one input: q/k/v of every GQA layer
        (GQAttention.fuse_qkv), gate/up of every dense MLP and shared expert (MLP.fuse_gate_up).
        Call once the weights are loaded and on their device. -> number of modules fused."""
        n = sum(a.fuse_qkv() for a in self._attention_layers() if isinstance(a, GQAttention))
        return n + sum(m.fuse_gate_up() for m in self.modules() if isinstance(m, MLP))

    def prepare_cpu(self, expert_bytes: int) -> int:
        """Once, before a CPU run's first step, for weights that never change after (every expert
        resident, no expert store): bf16 Linears keep a oneDNN-packed copy of their weight (the
        same results, Linear.pack_for_cpu), MLA layers keep kv_b_proj in float32 (what their
        absorbed-form references compute with), and MoE layers get a `cpu_pool` (ExpertSlots.cpu_pool)
        (kernels/moe_cpu.py): W2 / FP4 experts an exact float32 decode (4 bytes per weight), bf16
        experts their weights oneDNN-packed; the reference's bits either way. All of those only
        while the bytes they add fit `expert_bytes`; else the layers keep the reference.
        -> bytes added for the routed experts (0: none)."""
        from moet.kernels.moe_cpu import cpu_pool, cpu_pool_bytes
        from moet.kernels.pools import DensePool
        from moet.kernels.reference import decoded_pool

        for a in self._attention_layers():
            if isinstance(a, MLAttention):
                a.keep_float32_kv_b()
        for m in self.modules():
            if type(m) is Linear:
                m.pack_for_cpu()
        slots = [m.experts for m in self.modules() if isinstance(m, MoE) and m.experts.pool is not None]
        exact_bytes = 4 * 3 * self.spec.hidden_size * self.spec.moe_intermediate_size      # per slot
        plan = []       # (ExpertSlots, its attribute to set, the pool, bytes of the CPU layout)
        for e in slots:
            # (a partial repair pool's slots change as experts are promoted: no fixed CPU copy)
            repair = e.repair_pool if e.repair_complete else None
            for attr, pool in (("cpu_pool", e.pool), ("repair_cpu_pool", repair)):
                if pool is None:
                    continue
                n = cpu_pool_bytes(pool, self.dtype)
                if n == 0 and not isinstance(pool, DensePool):
                    n = exact_bytes * pool.num_slots
                plan.append((e, attr, pool, n))
        need = sum(n for *_, n in plan)
        if need == 0 or need > expert_bytes:
            return 0
        for e, attr, pool, n in plan:
            layout = cpu_pool(pool, self.dtype) if n else None
            if layout is None and not isinstance(pool, DensePool):
                layout = decoded_pool(pool)
            setattr(e, attr, layout)
        return need

    # ------------------------------------------------------------------ caches

    def moe_blocks(self) -> dict[str, MoE]:
        """{decoder layer's module name: its MoE block}, MTP layers' blocks too (if loaded): the
        names are the canonical ones, which the expert store's pack layers also use."""
        out = {f"model.layers.{i}": layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, MoE)}
        out.update({f"mtp.{j}.layer": m.layer.mlp for j, m in enumerate(self.mtp) if isinstance(m.layer.mlp, MoE)})
        return out

    def new_cache(self, max_len: int, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Contiguous per-layer caches for one sequence (main layers, then MTP layers); a gated
        DeltaNet layer's is its recurrent state."""
        layers = [layer for layer in self.model.layers] + [m.layer for m in self.mtp]
        out = []
        for layer in layers:
            if isinstance(layer.self_attn, GatedDeltaNet):
                out.append(layer.self_attn.new_state(device))
                continue
            out.append(tuple(torch.zeros(shape, dtype=self.dtype, device=device)
                             for shape in layer.self_attn.cache_shapes(max_len)))
        return out

    @property
    def has_recurrent_state(self) -> bool:
        """Layers whose state is per sequence, not per token (Qwen3.5's gated DeltaNet)."""
        return self.spec.linear_attention is not None

    @property
    def graph_safe(self) -> bool:
        # the gated DeltaNet's paged forward walks the step's sequences on the host
        return not self.has_recurrent_state

    def save_states(self, kv: list, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the recurrent states of `slots` in every gated DeltaNet layer's pool."""
        idx = torch.tensor(slots, dtype=torch.long)
        return [(st.conv[idx.to(st.conv.device)].clone(), st.recurrent[idx.to(st.conv.device)].clone())
                for st in kv if isinstance(st, RecurrentState)]

    def restore_states(self, kv: list, slots: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        idx = torch.tensor(slots, dtype=torch.long)
        for st, (conv, rec) in zip((st for st in kv if isinstance(st, RecurrentState)), saved):
            st.conv[idx.to(st.conv.device)] = conv
            st.recurrent[idx.to(st.conv.device)] = rec

    def state_bytes_per_sequence(self) -> int:
        """Recurrent state bytes one running sequence holds (0 without gated DeltaNet layers)."""
        la = self.spec.linear_attention
        if la is None:
            return 0
        return RecurrentState.bytes_per_slot(la) * sum(t == "linear" for t in la.layer_types)

    # ------------------------------------------------------------------ paged KV cache

    def _mixers(self) -> list[nn.Module]:
        """Every layer's token mixer, main layers then MTP layers: what the paged caches align with."""
        return [layer.self_attn for layer in self.model.layers] + [m.layer.self_attn for m in self.mtp]

    def _attention_layers(self) -> list[nn.Module]:
        return [a for a in self._mixers() if not isinstance(a, GatedDeltaNet)]

    def kv_bytes_per_token(self, kv_format: KVFormat) -> int:
        """KV cache bytes one token occupies across every attention layer (MTP layers included),
        DSA index keys included."""
        layers = self._attention_layers()
        index = sum(index_key_bytes_per_token(a.indexer.spec.head_dim, kv_format)
                    for a in layers if getattr(a, "indexer", None) is not None)
        return kv_layer_bytes_per_token(self.spec.attention, kv_format) * len(layers) + index

    def new_kv_cache(self, num_blocks: int, block_size: int, kv_format: KVFormat,
                     device: torch.device | str, state_slots: int = 1) -> list:
        """One paged cache layer object (kernels/kv_cache) per attention layer: main layers, then
        MTP layers; a gated DeltaNet layer gets its RecurrentState of `state_slots` sequences.
        `kv_format.dtype` is the "auto" data dtype (pass the model dtype). A format this attention
        cannot hold is a ConfigError naming the ones it can (check_kv_format)."""
        a = self.spec.attention
        check_kv_format(a, kv_format)
        if a.kind == "mla":
            make = lambda: new_mla_layer(num_blocks, block_size, a.kv_lora_rank, a.qk_rope_head_dim, kv_format, device)
        else:
            make = lambda: new_gqa_layer(num_blocks, block_size, a.num_kv_heads, a.head_dim, a.v_head_dim,
                                         kv_format, device)
        out = []
        for attn in self._mixers():
            if isinstance(attn, GatedDeltaNet):
                out.append(RecurrentState.zeros(attn.spec, state_slots, device))
                continue
            layer = make()
            if getattr(attn, "indexer", None) is not None:
                layer.index_keys = new_index_keys(num_blocks, block_size, attn.indexer.spec.head_dim, kv_format,
                                                   device)
            out.append(layer)
        return out

    def forward_paged(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: list) -> torch.Tensor:
        """input_ids [N]: a flat varlen batch of several sequences' new tokens (AttentionBatch)
        -> final hidden states [N, H] before the final norm (as hidden_states). Every layer writes
        the new tokens' K/V into `kv` (from new_kv_cache) first, then attends over the paged cache.
        Logits: self.logits(hidden[batch.logits_indices])."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        delta = None
        for i, layer in enumerate(self.model.layers):
            delta, x = layer.step_paged(delta, x, cos, sin, batch, kv[i], self.split_tokens)
        return DecoderLayer.finish(delta, x)

    def mtp_forward_paged(self, j: int, next_ids: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch,
                          kv: list) -> tuple[torch.Tensor, torch.Tensor]:
        """mtp_forward over the paged cache: MTP layer j's own cache is kv[num_layers + j]; hidden
        [N, H] is final-normed, next_ids [N] the token after each row -> (output hidden [N, H],
        draft logits [N, V]), for every row (select logits_indices as needed)."""
        m = self.mtp[j]
        embed = m.embed_tokens if m.has_own_embed else self.model.embed_tokens
        head = m.shared_head.head if m.has_own_head else self.lm_head
        x = m.eh_proj(torch.cat([m.enorm(embed(next_ids)), m.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        x = m.layer.forward_paged(x, cos, sin, batch, kv[len(self.model.layers) + j], self.split_tokens)
        return x, head(m.shared_head.norm(x))

    # ------------------------------------------------------------------ forward (contiguous, one sequence)

    def hidden_states(self, input_ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        """input_ids [T] at positions start..start+T-1 -> final hidden states [T, H] (pre-norm)."""
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        delta = None
        for i, layer in enumerate(self.model.layers):
            delta, x = layer.step(delta, x, cos, sin, cache[i], start)
        return DecoderLayer.finish(delta, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def forward(self, input_ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, start, cache))

    def mtp_forward(self, j: int, next_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer j. hidden [T, H]: the main model's final-normed hidden states (what the LM
        head sees; vLLM and SGLang feed the same) of the tokens at start..; next_ids [T]: the
        token following each -> (this block's output hidden [T, H], draft logits [T, V] for the
        token after next). Chained blocks take the previous block's output hidden."""
        m = self.mtp[j]
        embed = m.embed_tokens if m.has_own_embed else self.model.embed_tokens
        head = m.shared_head.head if m.has_own_head else self.lm_head
        positions = torch.arange(start, start + next_ids.shape[0], device=next_ids.device)
        x = m.eh_proj(torch.cat([m.enorm(embed(next_ids)), m.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        x = m.layer(x, cos, sin, cache[len(self.model.layers) + j], start)
        return x, head(m.shared_head.norm(x))
