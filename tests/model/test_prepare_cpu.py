"""CausalLM.prepare_cpu (what a CPU model runner does once before its first step): the same
outputs as the unprepared model, bit for bit (packed bf16 Linears, float32 kv_b, exact float32
expert decodes, packed DensePool experts) over a paged prefill and decode steps; and the CPU
engine prepares its model."""
from __future__ import annotations

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.kernels.kv_cache import KVFormat
from moet.kernels.pools import DecodedPool
from moet.model import load_model
from moet.model.attention_batch import AttentionBatch
from moet.model.layers.linear import Linear
from moet.model.layers.mla import MLAttention
from moet.model.layers.moe import MoE
from moet.testing.tiny_checkpoint import VOCAB, cached_checkpoint

BS, BLOCKS = 4, 16


def _run(model, dtype) -> list[torch.Tensor]:
    """Logits of a 9-token prefill of two sequences, then three decode steps of both."""
    kv = model.new_kv_cache(BLOCKS, BS, KVFormat("auto", dtype=dtype), "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (9,), generator=g), torch.randint(0, VOCAB, (5,), generator=g)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    out, ctx, q = [], [0, 0], [9, 5]
    ids = torch.cat(prompts)
    with torch.inference_mode():
        for _ in range(4):
            batch = AttentionBatch.build(block_tables=tables, context_lens=ctx, query_lens=q, block_size=BS,
                                         device="cpu")
            logits = model.logits(model.forward_paged(ids, batch, kv)[batch.logits_indices]).float()
            out.append(logits)
            ctx, q = [c + n for c, n in zip(ctx, q)], [1, 1]
            ids = logits.argmax(-1)
    return out


def _pair(fmt, dtype):
    ckpt = cached_checkpoint("deepseek_v3")
    a = load_model(open_checkpoint(ckpt), expert_format=fmt, dtype=dtype)
    b = load_model(open_checkpoint(ckpt), expert_format=fmt, dtype=dtype)
    return a, b


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("w2", torch.float32), ("fp4", torch.float32),
                                       ("w2", torch.bfloat16), ("fp4", torch.bfloat16)])
def test_relayouts_give_the_same_bits(fmt, dtype):
    plain, prepared = _pair(fmt, dtype)
    decoded = prepared.prepare_cpu(1 << 30)
    moes = [m for m in prepared.modules() if isinstance(m, MoE)]
    if fmt == "bf16":                 # a packed DensePool where this torch packs, else the reference
        assert all(m.experts.cpu_pool is None or m.experts.cpu_pool.kind == "dense" for m in moes)
        assert (decoded > 0) == (moes[0].experts.cpu_pool is not None)
    else:
        assert moes and all(isinstance(m.experts.cpu_pool, DecodedPool) for m in moes) and decoded > 0
    assert all(m.kv_b_f32 is not None for m in prepared.modules() if isinstance(m, MLAttention))
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        assert any(m.cpu_packed is not None for m in prepared.modules() if type(m) is Linear)
    for a, b in zip(_run(plain, dtype), _run(prepared, dtype)):
        assert torch.equal(a, b)


def test_float32_decodes_respect_the_budget():
    _, model = _pair("w2", torch.float32)
    assert model.prepare_cpu(1000) == 0
    assert all(m.experts.cpu_pool is None for m in model.modules() if isinstance(m, MoE))


def test_cpu_engine_prepares_its_model():
    eng = LLMEngine.from_config(EngineConfig(model=cached_checkpoint("deepseek_v3"), expert_format="w2",
                                             dtype="bfloat16", device="cpu", max_model_len=64))
    moes = [m for m in eng.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.experts.cpu_pool is not None for m in moes)
    assert all(m.kv_b_f32 is not None for m in eng.model.modules() if isinstance(m, MLAttention))
