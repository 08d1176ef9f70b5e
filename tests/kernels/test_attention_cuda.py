"""On a GPU only: the Triton attention kernels at real model shapes against the torch references
(run on the same GPU, float32 math): GQA as Qwen3-30B-A3B (32 q / 4 kv heads, d 128), MLA as
DeepSeek-V3 (128 heads, R 512, P 64); bf16 queries and caches, fp8 caches; plus the model's
forward_paged through the CUDA dispatch. The interpreter tests cover the same code at toy shapes
on CPU; these catch what only the compiled kernels can get wrong (register-heavy shapes, fp8
conversions, int32 overflow in offsets). Cheap: a few seconds after compilation."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from moet.kernels.kv_cache import KVFormat, new_gqa_layer, new_mla_layer  # noqa: E402
from tests.kernels.paged import random_block_tables, slots_for  # noqa: E402

BS = 16
DEV = "cuda"
FORMATS = [KVFormat("auto", dtype=torch.bfloat16), KVFormat("fp8_e4m3", "tensor"),
           KVFormat("fp8_e4m3", "block", group=128, dtype=torch.bfloat16)]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _gqa(fmt, lens, g):
    from moet.kernels.kv_cache import write_gqa_kv
    nb = sum(-(-n // BS) for n in lens) + 2
    cache = new_gqa_layer(nb, BS, 4, 128, 128, fmt, device=DEV)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.k_scale.fill_(0.02)
        cache.v_scale.fill_(0.03)
    table = random_block_tables(lens, BS, nb, g)
    for b, n in enumerate(lens):
        write_gqa_kv(cache, torch.randn(n, 4, 128, generator=g).to(DEV), torch.randn(n, 4, 128, generator=g).to(DEV),
                     slots_for(table, b, range(n), BS).to(DEV))
    return cache, table.to(DEV)


def _mla(fmt, lens, g):
    from moet.kernels.kv_cache import write_mla_kv
    nb = sum(-(-n // BS) for n in lens) + 2
    cache = new_mla_layer(nb, BS, 512, 64, fmt, device=DEV)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.latent_scale.fill_(0.02)
    table = random_block_tables(lens, BS, nb, g)
    for b, n in enumerate(lens):
        write_mla_kv(cache, torch.randn(n, 512, generator=g).to(DEV), torch.randn(n, 64, generator=g).to(DEV),
                     slots_for(table, b, range(n), BS).to(DEV))
    return cache, table.to(DEV)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.scale}")
def test_gqa_decode_and_prefill_at_qwen3_shape(fmt):
    from moet.kernels import attention_reference as ref
    from moet.kernels import attention_triton, prefill_triton
    g = _gen()
    lens = [1, 17, 1000, 2049]
    cache, table = _gqa(fmt, lens, g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), 32, 128, generator=g).to(DEV, torch.bfloat16)
    want = ref.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5)
    got = attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, split_tokens=256)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    assert torch.equal(got, attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, split_tokens=256))
    qlens = [1, 17, 300, 2049]                   # extend 1 / whole prompt / chunk after context / whole
    cu = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)
    q = torch.randn(sum(qlens), 32, 128, generator=g).to(DEV, torch.bfloat16)
    want = ref.paged_prefill_gqa(q, cache, table, cu, seq_lens, 128 ** -0.5)
    got = prefill_triton.paged_prefill_gqa(q, cache, table, cu, seq_lens, 128 ** -0.5, max_seqlen_q=max(qlens))
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f"{f.name}-{f.scale}")
def test_gqa_decode_pipeline_depth_changes_no_bits(fmt):
    """num_stages is only the cp.async pipeline depth of the page loop, so the launch table may pick
    it per batch size (attention_configs): 3 / 5 / 7 stages and the table's default give the same
    bits, at batch 1 and at a ragged batch of 32."""
    from moet.kernels import attention_triton
    g = _gen()
    for lens in ([4099], [int(n) for n in torch.randint(1, 3000, (32,), generator=g)]):
        cache, table = _gqa(fmt, lens, g)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(len(lens), 32, 128, generator=g).to(DEV, torch.bfloat16)
        run = lambda **kw: attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5,  # noqa: E731
                                                             split_tokens=256, **kw)
        base = run(num_warps=4, num_stages=3)
        for stages in (5, 7):
            assert torch.equal(run(num_warps=4, num_stages=stages), base), (len(lens), stages)
        assert torch.equal(run(), base)          # the table's launch (4 warps: its H200 entries, the fallback)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.scale}")
def test_gqa_decode_prefetch_under_pdl_changes_no_bits(fmt):
    """Under PDL the split programs prefetch their first steps' K / V into L2 before the PDL wait
    (prefetch_steps): a hint, so 0 / 1 / 2 / 4 steps and PDL off give the same bits, eager and in a
    CUDA graph, at batch 1 (32K: 32 splits) and at a ragged batch whose last pages are partly
    filled; the newest token's row is rewritten between calls, so a prefetch that kept a stale
    line would show."""
    from moet.kernels import attention_reference as ref
    from moet.kernels import attention_triton, pdl
    from moet.kernels.kv_write_triton import write_gqa_kv     # the engine's write: a PDL kernel, capturable
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90")
    g = _gen()
    for lens in ([32768], [int(n) for n in torch.randint(1, 3000, (8,), generator=g)]):
        cache, table = _gqa(fmt, lens, g)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(len(lens), 32, 128, generator=g).to(DEV, torch.bfloat16)
        last = torch.cat([slots_for(table.cpu(), b, [n - 1], BS) for b, n in enumerate(lens)]).to(DEV)
        new_k = torch.randn(len(lens), 4, 128, generator=g).to(DEV, torch.bfloat16)
        new_v = torch.randn(len(lens), 4, 128, generator=g).to(DEV, torch.bfloat16)

        def step(pf):                     # the KV write of the newest token, then the decode
            write_gqa_kv(cache, new_k, new_v, last)
            return attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, prefetch_steps=pf)

        base = step(0)
        want = ref.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5)
        assert _rel(base, want) < 1e-2
        pdl.set_small_kernel_pdl(True)
        try:
            for pf in (0, 1, 2, 4, None):
                assert torch.equal(step(pf), base), (len(lens), pf)
            out = torch.empty_like(base)
            graph = torch.cuda.CUDAGraph()
            step(2)
            with torch.cuda.graph(graph):
                write_gqa_kv(cache, new_k, new_v, last)
                attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, out=out, prefetch_steps=2)
            new_k.copy_(torch.randn(len(lens), 4, 128, generator=g).to(DEV))   # a new newest row, written in the replay
            new_v.copy_(torch.randn(len(lens), 4, 128, generator=g).to(DEV))
            graph.replay()
            torch.cuda.synchronize()
        finally:
            pdl.set_small_kernel_pdl(False)
        assert torch.equal(out, step(0)), len(lens)
        assert not torch.equal(out, base)        # the replay did read the new newest row
    with pytest.raises(Exception, match="power of two"):
        attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, prefetch_steps=3)


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f"{f.name}-{f.scale}")
def test_gqa_decode_long_partition_at_128k(fmt):
    """The long partition at 64 (long_splits): a 131,149-token sequence (8,197 pages) gets 64 splits of
    129 pages, merged as two chunks of 32, and matches the reference; a 20,000-token one in the same
    batch keeps the bits it has without the long partition (its splits are the same); under PDL,
    where the programs past a sequence's splits skip the PDL wait, the same bits."""
    from moet.kernels import attention_reference as ref
    from moet.kernels import attention_triton
    g = _gen()
    lens = [131149, 20000]
    cache, table = _gqa(fmt, lens, g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), 32, 128, generator=g).to(DEV, torch.bfloat16)
    got = attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5, long_splits=64)
    want = ref.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    plain = attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5)        # the default: off
    assert torch.equal(got[1], plain[1]) and not torch.equal(got[0], plain[0])
    assert _rel(plain, want) < 1e-2
    if torch.cuda.get_device_capability() >= (9, 0):    # under PDL: empty programs skip the wait; same bits
        from moet.kernels import pdl
        pdl.set_small_kernel_pdl(True)
        try:
            assert torch.equal(attention_triton.paged_decode_gqa(q, cache, table, seq_lens, 128 ** -0.5,
                                                                 long_splits=64), got)
            assert torch.equal(attention_triton.paged_decode_gqa(q[1:], cache, table[1:], seq_lens[1:],
                                                                 128 ** -0.5, long_splits=64), got[1:])
        finally:
            pdl.set_small_kernel_pdl(False)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.scale}")
def test_mla_decode_and_prefill_at_deepseek_shape(fmt):
    from moet.kernels import attention_reference as ref
    from moet.kernels import mla_decode_triton, mla_prefill_triton
    g = _gen()
    lens = [1, 17, 700]
    cache, table = _mla(fmt, lens, g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = 0.1352337788608801                   # DeepSeek-V3's spec: 192 ** -0.5 * yarn mscale ** 2
    ql = torch.randn(len(lens), 128, 512, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(len(lens), 128, 64, generator=g).to(DEV, torch.bfloat16)
    want = ref.paged_decode_mla(ql, qr, cache, table, seq_lens, scale)
    got = mla_decode_triton.paged_decode_mla(ql, qr, cache, table, seq_lens, scale, split_tokens=256)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    qlens = [1, 17, 200]
    cu = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)
    ql = torch.randn(sum(qlens), 128, 512, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(sum(qlens), 128, 64, generator=g).to(DEV, torch.bfloat16)
    want = ref.paged_prefill_mla(ql, qr, cache, table, cu, seq_lens, scale)
    got = mla_prefill_triton.paged_prefill_mla(ql, qr, cache, table, cu, seq_lens, scale, max_seqlen_q=max(qlens))
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    again = mla_prefill_triton.paged_prefill_mla(ql, qr, cache, table, cu, seq_lens, scale, max_seqlen_q=max(qlens))
    assert torch.equal(got, again)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.scale}")
def test_kv_writes_at_real_shapes_equal_torch_bytes(fmt):
    from moet.kernels import kv_cache, kv_write_triton
    g = _gen()
    t = 3000
    slots = torch.randperm(4096, generator=g)[:t].to(DEV)
    slots[:3] = -1
    k = torch.randn(t, 4, 128, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(t, 4, 128, generator=g).to(DEV, torch.bfloat16)
    a, b = (new_gqa_layer(4096 // BS, BS, 4, 128, 128, fmt, device=DEV) for _ in range(2))
    kv_cache.write_gqa_kv(a, k, v, slots)
    kv_write_triton.write_gqa_kv(b, k, v, slots)
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
    assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
    if fmt.block_scaled:
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)
        # the reference's scale is the correctly rounded amax / 448 (fp32 / fp32 through float64
        # is exact before the one rounding), not torch's CUDA x * fl(1/448) for a scalar divisor
        keep = slots >= 0
        amax = k[keep].float().abs().amax(-1)
        want = (amax.double() / 448.0).float()
        got = a.k_scale.flatten(0, 1)[slots[keep]][..., 0]
        assert torch.equal(got, want)
    lat, rope = torch.randn(t, 512, generator=g).to(DEV), torch.randn(t, 64, generator=g).to(DEV)
    a, b = (new_mla_layer(4096 // BS, BS, 512, 64, fmt, device=DEV) for _ in range(2))
    kv_cache.write_mla_kv(a, lat, rope, slots)
    kv_write_triton.write_mla_kv(b, lat, rope, slots)
    assert torch.equal(a.buffer.view(torch.uint8), b.buffer.view(torch.uint8))


@pytest.mark.parametrize("family,dtype,tol", [
    ("qwen3_moe", torch.float32, 1e-4), ("deepseek_v3", torch.float32, 1e-4),
    ("qwen3_moe", torch.bfloat16, 5e-2), ("deepseek_v3", torch.bfloat16, 5e-2)])
def test_forward_paged_on_cuda_equals_contiguous(family, dtype, tol):
    """The model on the GPU (Triton path): a mixed step then decodes. float32: exact fp32 dots;
    bf16: the tensor-core dots against the contiguous bf16 path (bf16 rounding differs, hence
    the loose bound). In bf16 every token routes to all 8 experts: with top-2 that rounding
    flipped a tiny random model's expert choice on 1-2 steps of 4 (H200: 0.17 and 0.09 against
    0.013-0.016), which says nothing about the attention this test is for."""
    from moet.checkpoint import open_checkpoint
    from moet.model import load_model
    from moet.model.attention_batch import AttentionBatch
    from moet.testing.tiny_checkpoint import VOCAB, cached_checkpoint
    g = _gen()
    every_expert = {} if dtype == torch.float32 else \
        dict(num_experts_per_tok=8, **(dict(n_group=1, topk_group=1) if family == "deepseek_v3" else {}))
    model = load_model(open_checkpoint(cached_checkpoint(family, **every_expert)), expert_format="bf16", dtype=dtype,
                       device=DEV)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).to(DEV) for n in (40, 9)]
    want = []
    with torch.no_grad():
        for s in seqs:
            want.append(model.forward(s, 0, model.new_cache(s.shape[0], DEV)))
        kv = model.new_kv_cache(16, BS, KVFormat("auto", dtype=dtype), DEV)
        tables = [[5, 2, 9], [11]]
        done = [0, 0]
        errs = []
        for step in ([(0, 20), (1, 8)], [(1, 1), (0, 18)], [(0, 1), (1, 0)], [(0, 1)]):
            step = [(b, n) for b, n in step if n]
            batch = AttentionBatch.build(block_tables=[tables[b] for b, _ in step],
                                         context_lens=[done[b] for b, _ in step],
                                         query_lens=[n for _, n in step], block_size=BS, device=DEV)
            ids = torch.cat([seqs[b][done[b]:done[b] + n] for b, n in step])
            logits = model.logits(model.forward_paged(ids, batch, kv))
            ref = torch.cat([want[b][done[b]:done[b] + n] for b, n in step])
            errs.append(_rel(logits, ref))
            for b, n in step:
                done[b] += n
    assert max(errs) < tol, errs
