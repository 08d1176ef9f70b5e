"""The paged references reproduce the model's contiguous attention (model/layers/attention.py,
mla.py) on random weights: several ragged sequences in one batch, random block tables, chunked
prefill with empty chunks, then decode steps; plus properties the kernels rely on."""
from __future__ import annotations

import pytest
import torch

from moet.checkpoint.spec import spec_from_config
from moet.kernels.attention_reference import (mla_absorb_q, mla_output, paged_decode_gqa, paged_decode_mla,
                                              paged_prefill_gqa, paged_prefill_mla)
from moet.kernels.kv_cache import KVFormat, new_gqa_layer, new_mla_layer, write_gqa_kv, write_mla_kv
from moet.model.layers.attention import GQAttention
from moet.model.layers.mla import MLAttention
from moet.model.layers.rope import Rotary
from moet.testing.tiny_checkpoint import tiny_config
from tests.kernels.paged import random_block_tables, slots_for

BS = 4
NUM_BLOCKS = 40


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _layer(family: str, g: torch.Generator):
    spec = spec_from_config(tiny_config(family).to_dict())
    rotary = Rotary(spec.rope, spec.max_position_embeddings)
    cls = MLAttention if spec.attention.kind == "mla" else GQAttention
    layer = cls(spec.attention, spec.hidden_size, rotary, spec.rms_norm_eps, torch.float32)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return spec, rotary, layer


def _schedule(g: torch.Generator) -> tuple[list[list[int]], int]:
    """Per step, new tokens per sequence: 3 chunked-prefill steps (0 = idle this step), then 3
    decode steps. Prompt lengths land on and across page boundaries."""
    steps = [[int(torch.randint(0, 3 * BS + 2, (1,), generator=g)) for _ in range(3)] for _ in range(3)]
    steps[0] = [max(1, n) for n in steps[0]]
    steps[0][1] = BS                    # exactly one page, then more
    for step in steps[1:]:              # a step schedules some token (all idle is no step: the
        if not any(step):               # contiguous side would have nothing to concatenate)
            step[0] = 1
    return steps, 3


def _project_gqa(layer: GQAttention, x, cos, sin):
    """The q/k/v that GQAttention.forward computes before touching its cache (mirrors it)."""
    s, t = layer.spec, x.shape[0]
    q = layer.q_proj(x).view(t, s.num_heads, s.head_dim)
    k = layer.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
    v = layer.v_proj(x).view(t, s.num_kv_heads, s.head_dim)
    if s.qk_norm:
        q, k = layer.q_norm(q), layer.k_norm(k)
    return layer.rotary.apply(q, cos, sin), layer.rotary.apply(k, cos, sin), v


def _project_mla(layer: MLAttention, x, cos, sin):
    s, t = layer.spec, x.shape[0]
    nope, rope_d = s.qk_nope_head_dim, s.qk_rope_head_dim
    q = layer.q_proj(x) if s.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(t, s.num_heads, nope + rope_d)
    latent, k_rot = layer.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, rope_d], dim=-1)
    q_rot = layer.rotary.apply(q[..., nope:], cos, sin)
    k_rot = layer.rotary.apply(k_rot.view(t, 1, rope_d), cos, sin).view(t, rope_d)
    return q[..., :nope], q_rot, layer.kv_a_layernorm(latent), k_rot


def _run(family: str, fmt: KVFormat):
    """-> (contiguous outputs, paged outputs), one tensor per step, rows in batch order."""
    g = _gen()
    spec, rotary, layer = _layer(family, g)
    a = spec.attention
    prefill, n_decode = _schedule(g)
    steps = prefill + [[1, 1, 1]] * n_decode
    totals = [sum(col) for col in zip(*steps)]
    table = random_block_tables(totals, BS, NUM_BLOCKS, g)
    if a.kind == "mla":
        paged = new_mla_layer(NUM_BLOCKS, BS, a.kv_lora_rank, a.qk_rope_head_dim, fmt)
    else:
        paged = new_gqa_layer(NUM_BLOCKS, BS, a.num_kv_heads, a.head_dim, a.v_head_dim, fmt)
    contig = [tuple(torch.zeros(sh) for sh in layer.cache_shapes(max(totals))) for _ in totals]
    lens = [0, 0, 0]
    want, got = [], []
    for step_i, step in enumerate(steps):
        xs = [torch.randn(t, spec.hidden_size, generator=g) for t in step]
        # contiguous: the model's layer, one sequence at a time
        outs = []
        for b, x in enumerate(xs):
            if x.shape[0]:
                cos, sin = rotary.cos_sin(torch.arange(lens[b], lens[b] + x.shape[0]), x.dtype)
                outs.append(layer(x, cos, sin, contig[b], lens[b]))
        want.append(torch.cat(outs))
        # paged: write every sequence's new tokens through the slot mapping, then one batched call
        parts, slots = [], []
        for b, x in enumerate(xs):
            cos, sin = rotary.cos_sin(torch.arange(lens[b], lens[b] + x.shape[0]), x.dtype)
            proj = _project_mla(layer, x, cos, sin) if a.kind == "mla" else _project_gqa(layer, x, cos, sin)
            parts.append(proj)
            slots.append(slots_for(table, b, range(lens[b], lens[b] + x.shape[0]), BS))
            lens[b] += x.shape[0]
        cat = [torch.cat(p) for p in zip(*parts)]
        slot_mapping = torch.cat(slots)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        cu = torch.tensor([0] + list(torch.tensor(step).cumsum(0)), dtype=torch.int32)
        decode = step_i >= len(prefill)
        if a.kind == "mla":
            q_pass, q_rot, latent, k_rot = cat
            write_mla_kv(paged, latent, k_rot, slot_mapping)
            w = layer.kv_b_proj.weight
            q_lat = mla_absorb_q(q_pass, w, a.qk_nope_head_dim)
            if decode:
                o = paged_decode_mla(q_lat, q_rot, paged, table, seq_lens, a.scale)
            else:
                o = paged_prefill_mla(q_lat, q_rot, paged, table, cu, seq_lens, a.scale)
            o = mla_output(o, w, a.qk_nope_head_dim)
        else:
            q, k, v = cat
            write_gqa_kv(paged, k, v, slot_mapping)
            if decode:
                o = paged_decode_gqa(q, paged, table, seq_lens, a.scale, a.sliding_window)
            else:
                o = paged_prefill_gqa(q, paged, table, cu, seq_lens, a.scale, a.sliding_window)
        got.append(layer.o_proj(o.reshape(o.shape[0], -1)))
    return want, got


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_paged_reference_reproduces_the_models_contiguous_attention(family):
    want, got = _run(family, KVFormat("auto", dtype=torch.float32))
    for w, o in zip(want, got):
        assert w.shape == o.shape
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_fp8_block_cache_stays_close_to_the_model(family):
    want, got = _run(family, KVFormat("fp8_e4m3", "block", group=16, dtype=torch.float32))
    for w, o in zip(want, got):
        err = (o - w).norm() / w.norm()
        # e4m3 keeps ~2**-4 relative per element; random weights make sharp softmaxes that amplify
        # it (observed up to 0.078 over 30 steps); a wrong scale or group gives O(1)
        assert err < 0.25, err
        assert err > 0                  # and it really went through fp8


def test_mixtral_sliding_window_changes_the_result_past_the_window():
    """The window hook is live: with a window of 3 the paged output differs from full attention
    once a sequence is longer than 3, and equals it for the first 3 positions."""
    g = _gen()
    cache = new_gqa_layer(8, BS, 2, 8, 8, KVFormat("auto", dtype=torch.float32))
    n = 2 * BS + 1
    table = random_block_tables([n], BS, 8, g)
    k, v = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    q = torch.randn(n, 4, 8, generator=g)
    write_gqa_kv(cache, k, v, slots_for(table, 0, range(n), BS))
    cu, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    full = paged_prefill_gqa(q, cache, table, cu, lens, 0.3)
    win = paged_prefill_gqa(q, cache, table, cu, lens, 0.3, sliding_window=3)
    assert torch.equal(full[:3], win[:3])
    assert not torch.allclose(full[3:], win[3:], atol=1e-3)


def test_decode_equals_the_last_prefill_row_and_is_bit_deterministic():
    g = _gen()
    lens = [1, BS - 1, BS + 1, 5 * BS + 2]
    cache = new_gqa_layer(NUM_BLOCKS, BS, 2, 16, 16, KVFormat("fp8_e4m3", "tensor"))
    table = random_block_tables(lens, BS, NUM_BLOCKS, g)
    for b, n in enumerate(lens):
        write_gqa_kv(cache, torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g),
                     slots_for(table, b, range(n), BS))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 8, 16, generator=g)
    d1 = paged_decode_gqa(q, cache, table, seq_lens, 0.25)
    d2 = paged_decode_gqa(q, cache, table, seq_lens, 0.25)
    assert torch.equal(d1, d2)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    torch.testing.assert_close(paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.25), d1, rtol=1e-6, atol=1e-6)
    # a one-token sequence attends to itself only: the output is its own value
    v0 = cache.v.flatten(0, 1)[table[0, 0].long() * BS].float() * cache.v_scale
    torch.testing.assert_close(d1[0].view(2, 4, 16), v0[:, None, :].expand(2, 4, 16))


def test_mla_absorbed_equals_expanded_attention():
    """mla_absorb_q / mla_output against the naive per-head keys and values."""
    g = _gen()
    h, nope, vd, r, p, n = 3, 8, 6, 16, 4, 2 * BS + 3
    w = torch.randn(h * (nope + vd), r, generator=g)
    cache = new_mla_layer(8, BS, r, p, KVFormat("auto", dtype=torch.float32))
    table = random_block_tables([n], BS, 8, g)
    lat, rope = torch.randn(n, r, generator=g), torch.randn(n, p, generator=g)
    write_mla_kv(cache, lat, rope, slots_for(table, 0, range(n), BS))
    q_nope, q_rope = torch.randn(1, h, nope, generator=g), torch.randn(1, h, p, generator=g)
    o = mla_output(paged_decode_mla(mla_absorb_q(q_nope, w, nope), q_rope, cache, table,
                                    torch.tensor([n], dtype=torch.int32), 0.2), w, nope)
    kv = (lat @ w.T).view(n, h, nope + vd)
    k = torch.cat([kv[..., :nope], rope[:, None, :].expand(n, h, p)], -1)
    qf = torch.cat([q_nope, q_rope], -1)[0]
    probs = torch.softmax(torch.einsum("hd,nhd->hn", qf, k) * 0.2, -1)
    ref = torch.einsum("hn,nhv->hv", probs, kv[..., nope:])
    torch.testing.assert_close(o[0], ref, rtol=1e-5, atol=1e-5)
