"""The Triton paged decode against the torch reference (float32), under TRITON_INTERPRET=1 when
there is no GPU: ragged lengths across page and split boundaries, random block tables, GQA
groups, fp8 caches, sliding window, bit-identical reruns."""
from __future__ import annotations

import math


import pytest
import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton


from moet.errors import ConfigError  # noqa: E402
from moet.kernels import attention_reference as ref  # noqa: E402
from moet.kernels.kv_cache import KVFormat, new_gqa_layer, new_mla_layer, write_gqa_kv, write_mla_kv  # noqa: E402
from tests.kernels.paged import random_block_tables, slots_for  # noqa: E402

BS = 16
NUM_BLOCKS = 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tri():
    from moet.kernels import attention_triton
    return attention_triton


def _mla():
    from moet.kernels import mla_decode_triton
    return mla_decode_triton


def _setup(fmt: KVFormat, lens: list[int], hq: int, hkv: int, d: int, g: torch.Generator):
    cache = new_gqa_layer(NUM_BLOCKS, BS, hkv, d, d, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.k_scale.fill_(0.02)               # a calibrated-looking scale, so a dropped one fails
        cache.v_scale.fill_(0.03)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_gqa_kv(cache, torch.randn(n, hkv, d, generator=g).to(DEVICE),
                     torch.randn(n, hkv, d, generator=g).to(DEVICE), slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE)
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE), q


CASES = [
    # fmt, lens, hq, hkv, d, window, split_tokens
    (KVFormat("auto", dtype=torch.float32), [1, BS - 1, BS, BS + 1, 3 * BS + 5], 4, 2, 16, None, 32),
    (KVFormat("auto", dtype=torch.float32), [2 * BS + 3, 5 * BS], 8, 1, 32, None, 16),    # MQA-like group 8
    (KVFormat("auto", dtype=torch.float32), [5 * BS + 7, 9], 4, 4, 16, 20, 32),          # window crosses splits
    (KVFormat("fp8_e4m3", "tensor"), [BS + 1, 4 * BS + 2], 4, 2, 16, None, 32),
    (KVFormat("fp8_e4m3", "block", group=8), [3, 3 * BS - 1], 6, 2, 24, None, 16),       # d not a power of 2
    (KVFormat("fp8_e4m3", "block", group=128), [BS + 3, 4 * BS], 8, 2, 16, None, 32),    # one scale per token-head
    # splits of 5 pages read as a 4-page step plus a 1-page step (GQA_TILE_TOKENS 64, BS 16)
    (KVFormat("auto", dtype=torch.float32), [11 * BS + 3, 2 * BS], 4, 2, 16, None, 5 * BS),
]


@pytest.mark.parametrize("fmt,lens,hq,hkv,d,window,split", CASES)
def test_triton_paged_decode_matches_reference(fmt, lens, hq, hkv, d, window, split):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(fmt, lens, hq, hkv, d, g)
    want = ref.paged_decode_gqa(q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, window)
    got = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    again = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split)
    assert torch.equal(got, again)              # bit-identical run to run


STEP_CASES = [
    # fmt, lens, hq, hkv, d, window, split_tokens, tile_tokens: bf16 / fp32 / fp8 caches (tensor, per
    # token-head, per group), ragged lengths, windows, splits that end mid-step, one-step splits,
    # 16 / 32 / 64-token loop steps
    (KVFormat("auto", dtype=torch.bfloat16), [1, BS - 1, 4 * BS, 9 * BS + 5], 8, 2, 32, None, 5 * BS, 64),
    (KVFormat("auto", dtype=torch.float32), [11 * BS + 3, 2 * BS, 7], 4, 2, 16, None, 5 * BS, 64),
    (KVFormat("auto", dtype=torch.float32), [13 * BS + 7, 9, 3 * BS], 4, 4, 16, 2 * BS + 5, 3 * BS, 32),
    (KVFormat("fp8_e4m3", "tensor"), [BS + 1, 6 * BS + 2], 4, 2, 16, None, 4 * BS, 32),
    (KVFormat("fp8_e4m3", "block", group=8), [3, 5 * BS - 1], 6, 2, 24, 3 * BS, 2 * BS, 16),
    (KVFormat("fp8_e4m3", "block", group=128), [BS + 3, 7 * BS], 8, 2, 16, None, 3 * BS, 64),
]


@pytest.mark.parametrize("swap_ab", [False, True], ids=["heads-M", "tokens-M"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
@pytest.mark.parametrize("fmt,lens,hq,hkv,d,window,split,tile", STEP_CASES)
def test_loop_steps_and_query_dtypes_match_reference(fmt, lens, hq, hkv, d, window, split, tile, qdtype, swap_ab):
    """Loop steps of several pages (tile_tokens) with splits that end mid-step, fp32 queries
    (exact dots) and bf16 queries (the served tensor-core path, emulated under the interpreter);
    swap_ab: the transposed update (tokens as the MMAs' M)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(fmt, lens, hq, hkv, d, g)
    q = q.to(qdtype)
    got = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split, tile_tokens=tile,
                                  swap_ab=swap_ab)
    want = ref.paged_decode_gqa(q.float().cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, window)
    if qdtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    else:                                       # bf16 operands and output: bf16 accuracy
        assert float((got.float().cpu() - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("fmt,lens,window,split,tile", [
    (KVFormat("fp8_e4m3", "tensor"), [1, BS + 1, 6 * BS + 2], None, 4 * BS, 64),
    (KVFormat("fp8_e4m3", "tensor"), [13 * BS + 7, 9], 2 * BS + 5, 3 * BS, 32),        # window, 32-token steps
    (KVFormat("fp8_e4m3", "block", group=64), [BS + 3, 7 * BS], None, 3 * BS, 64),      # one scale per token-head
], ids=["tensor", "tensor-window", "token-head"])
def test_fp8_words_decode_matches_reference(fmt, lens, window, split, tile):
    """fp8_words: the fp8 cache read as int32 words, the dots split by byte slot (q_p . k_p summed,
    P v_p per slot): the reference to the f16 operands' accuracy, and equal to the byte-tile path's
    result to that accuracy; the default wherever it applies (the same bits as fp8_words=True);
    refused where it does not apply (fp32 queries)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    hq, hkv, d = 8, 2, 64
    cache, table, seq_lens, q = _setup(fmt, lens, hq, hkv, d, g)
    q = q.to(torch.bfloat16)
    kw = dict(split_tokens=split, tile_tokens=tile)
    got = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, fp8_words=True, **kw)
    want = ref.paged_decode_gqa(q.float().cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, window)
    assert float((got.float().cpu() - want).norm() / want.norm()) < 2e-2
    base = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, fp8_words=False, **kw)
    assert float((got.float() - base.float()).norm() / base.float().norm()) < 2e-2
    assert _tri().gqa_fp8_words_applies(q, cache)
    assert torch.equal(got, _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, **kw))   # the default
    with pytest.raises(ConfigError, match="fp8_words"):
        _tri().paged_decode_gqa(q.float(), cache, table, seq_lens, 0.3, window, fp8_words=True, **kw)


@pytest.mark.parametrize("fmt,d", [(KVFormat("fp8_e4m3", "block", group=8), 64),     # a scale per 8 elements
                                   (KVFormat("fp8_e4m3", "tensor"), 32),            # byte-slot dots of K = 8 < 16
                                   (KVFormat("fp8_e4m3", "tensor"), 96)],           # not a power of two
                         ids=["per-group", "d32", "d96"])
def test_fp8_words_refused_where_it_does_not_apply(fmt, d):
    """Refused when asked for, and not the default (the byte tile's bits) where it does not apply."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(fmt, [BS + 3], 4, 2, d, g)
    q = q.to(torch.bfloat16)
    assert not _tri().gqa_fp8_words_applies(q, cache)
    with pytest.raises(ConfigError, match="fp8_words"):
        _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, fp8_words=True)
    assert torch.equal(_tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3),
                       _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, fp8_words=False))


def test_launch_table_picks_per_device_format_and_batch(monkeypatch):
    """paged_decode_gqa's default launch comes from attention_configs.json: on an H200 (the
    device name faked here) bf16 queries over a bf16 d-128 cache with 64-token steps take 7
    stages at batch 1, 5 from batch 8 and 3 from batch 32, fp8 per-tensor caches 5; other shapes, fp32 queries and
    other devices the fallback. The launch changes no bits (the interpreter ignores it; on the
    GPU test_attention_cuda and attention_bench check the stages bit for bit)."""
    at = _tri()
    from moet.kernels.attention_configs import DEFAULT_GQA_DECODE, GQALaunch
    g = torch.Generator().manual_seed(3)

    def launch(fmt, d, batch, qdtype=torch.bfloat16, tile=None):
        cache = new_gqa_layer(4, BS, 1, d, d, fmt, device=DEVICE)
        return at.gqa_decode_launch(torch.randn(batch, 2, d, generator=g).to(DEVICE, qdtype), cache, tile)

    bf16, fp8 = KVFormat("auto", dtype=torch.bfloat16), KVFormat("fp8_e4m3", "tensor")
    monkeypatch.setattr(at, "_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert launch(bf16, 128, 1) == DEFAULT_GQA_DECODE          # a device the table lacks
    monkeypatch.setattr(at, "_device_name", lambda device: "NVIDIA H200")
    assert [launch(bf16, 128, b) for b in (1, 7, 8, 31, 32, 64)] == \
        [GQALaunch(4, 7)] * 2 + [GQALaunch(4, 5)] * 2 + [GQALaunch(4, 3)] * 2
    assert [launch(fp8, 128, b) for b in (1, 8, 32, 256)] == [GQALaunch(4, 5)] * 4
    assert launch(bf16, 128, 1, torch.float32) == DEFAULT_GQA_DECODE                      # exact dots
    assert launch(bf16, 256, 1) == DEFAULT_GQA_DECODE                                     # unmeasured shape
    assert launch(bf16, 128, 1, tile=128) == DEFAULT_GQA_DECODE                           # 128-token steps
    assert launch(KVFormat("fp8_e4m3", "block", group=128), 128, 1) == DEFAULT_GQA_DECODE
    # the table's launch runs (interpreter: the same bits as an explicit default launch)
    cache, table, seq_lens, q = _setup(bf16, [3 * BS + 2, 5], 8, 2, 128, g)
    q = q.to(torch.bfloat16)
    picked = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=2 * BS)
    assert torch.equal(picked, at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=2 * BS,
                                                   num_warps=4, num_stages=3))


def test_split_size_changes_rounding_only_and_empty_sequences_give_zero():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    fmt = KVFormat("auto", dtype=torch.float32)
    cache, table, seq_lens, q = _setup(fmt, [6 * BS + 1, 0, 2], 4, 2, 16, g)
    one = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=8 * BS)   # one split
    many = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=BS)      # seven splits
    torch.testing.assert_close(many, one, rtol=2e-5, atol=2e-5)
    assert (one[1] == 0).all()                  # padding row of a graph batch: no NaN
    assert torch.isfinite(many).all()


@pytest.mark.parametrize("max_splits", [None, 6], ids=["splits-32", "splits-6"])
def test_merge_of_ragged_split_counts_matches_reference(max_splits):
    """The split merge (all of a sequence's splits loaded at once, masked past its used ones) over
    a batch whose sequences use 10, 0, 3, 1 and 6 splits of one page (5, 0, 3, 1, 6 when max_splits
    is 6: the longest gets 2-page splits; BLOCK_S 32 / 8): each non-empty sequence matches the reference, the empty one is 0, reruns
    give the same bits, the fused merge too under the interpreter (within 1e-6 compiled), and a
    sequence run alone gives its batch row's bits."""
    at = _tri()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    fmt = KVFormat("auto", dtype=torch.float32)
    lens = [9 * BS + 5, 0, 3 * BS, BS - 3, 5 * BS + 1]
    cache, table, seq_lens, q = _setup(fmt, lens, 4, 2, 16, g)
    kw = dict(split_tokens=BS, max_splits=max_splits)
    got = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, **kw)
    want = ref.paged_decode_gqa(q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3)
    live = [b for b, n in enumerate(lens) if n]
    err = (got.cpu()[live] - want[live]).norm() / want[live].norm()
    assert float(err) < 2e-5, float(err)
    assert (got[1] == 0).all()                  # no keys: 0, not NaN
    assert torch.equal(got, at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, **kw))
    fused = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, fused_merge=True, **kw)
    if DEVICE == "cpu":
        assert torch.equal(got, fused)
    else:   # compiled, the fused merge is another kernel's arithmetic (H200, run 21: BLOCK_S 8 differed in the last bit)
        assert float((fused - got).norm() / got.norm()) <= 1e-6
    for b in (0, 3):
        alone = at.paged_decode_gqa(q[b:b + 1], cache, table[b:b + 1], seq_lens[b:b + 1], 0.3, **kw)
        assert torch.equal(alone[0], got[b]), b


def test_prefetch_steps_off_the_gpu_and_refused_when_not_a_power_of_two():
    """prefetch_steps is an L2 hint issued under PDL only (a GPU; the interpreter has no PDL): here
    any power of two gives the same bits as none, and another count is refused before launch."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(KVFormat("auto", dtype=torch.float32), [5 * BS + 3, 2], 4, 2, 16, g)
    base = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=2 * BS, prefetch_steps=0)
    assert torch.equal(base, _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=2 * BS))
    assert torch.equal(base, _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=2 * BS,
                                                     prefetch_steps=4))
    for bad in (3, -1):
        with pytest.raises(ConfigError, match="prefetch_steps"):
            _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, prefetch_steps=bad)


@pytest.mark.parametrize("max_splits", [8, 6], ids=["rows-8", "rows-6-of-block-8"])
def test_merge_kernel_ignores_unwritten_split_rows(max_splits):
    """_merge_splits_kernel loads all of the workspace's splits at once (masked by the row count,
    not by the splits a sequence used, so the loads need not wait for its length) and drops the
    unused ones after: rows past `used` hold NaN / inf here, as a never-written workspace may, and
    the output is still the log-sum-exp merge of the used rows alone; with 6 rows and BLOCK_S 8
    the last program's tile reaches past the workspace, masked."""
    at = _tri()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    hq, dv = 2, 16
    lens = [max_splits * BS, 3 * BS - 2, 0]                   # one page a split: used = max_splits, 3, 0
    used = [max_splits, 3, 0]
    b = len(lens)
    m = torch.randn(b, hq, max_splits, generator=g) * 3
    l_ = torch.rand(b, hq, max_splits, generator=g) + 0.5
    acc = torch.randn(b, hq, max_splits, dv, generator=g)
    for i, u in enumerate(used):                              # what no split program wrote
        m[i, :, u:] = float("nan")
        l_[i, :, u:] = float("inf")
        acc[i, :, u:] = float("nan")
    want = torch.zeros(b, hq, dv)
    for i, u in enumerate(used):
        if u:
            w = torch.exp(m[i, :, :u] - m[i, :, :u].max(-1, keepdim=True).values)
            want[i] = (w[..., None] * acc[i, :, :u]).sum(1) / (w * l_[i, :, :u]).sum(-1, keepdim=True)
    dev = lambda t: t.to(DEVICE).contiguous()                 # noqa: E731
    out = torch.full((b, hq, dv), float("nan"), device=DEVICE)
    at._merge_splits_kernel[(b, hq)](dev(acc), dev(m), dev(l_), dev(torch.tensor(lens, dtype=torch.int32)), out,
                                     out.stride(0), out.stride(1), max_splits, 1, HQ=hq, DV=dv, BLOCK_DV=dv,
                                     MAX_SPLITS=max_splits, BLOCK_SIZE=BS, PDL=False,
                                     **at._merge_blocks(max_splits, dv))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all()


def _to_cpu(cache):
    from dataclasses import replace
    return replace(cache, k=cache.k.cpu(), v=cache.v.cpu(),
                   k_scale=None if cache.k_scale is None else cache.k_scale.cpu(),
                   v_scale=None if cache.v_scale is None else cache.v_scale.cpu())


MLA_CASES = [
    # fmt, lens, heads, split_tokens, block_h (None: the default, clipped to the heads)
    (KVFormat("auto", dtype=torch.float32), [1, BS - 1, BS + 1, 4 * BS + 3], 4, 32, None),
    (KVFormat("fp8_e4m3", "tensor"), [2 * BS + 5, 3], 20, 32, 16),                   # two head blocks of 16
    (KVFormat("fp8_e4m3", "block", group=16), [BS, 3 * BS + 1], 4, 48, None),        # fp8_ds_mla row, bf16 rope
    (KVFormat("fp8_e4m3", "block", group=8), [5 * BS + 9, 2], 36, 80, 32),           # token tiles across pages
]


@pytest.mark.parametrize("heads_m", [False, True], ids=["tokens-M", "heads-M"])
@pytest.mark.parametrize("fmt,lens,h,split,block_h", MLA_CASES)
def test_triton_paged_mla_decode_matches_reference(fmt, lens, h, split, block_h, heads_m):
    """Both tile forms (heads_m: the heads as the MMAs' M) against the reference."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    r, p = 32, 16
    cache = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.latent_scale.fill_(0.02)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_mla_kv(cache, torch.randn(n, r, generator=g).to(DEVICE), torch.randn(n, p, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    ql, qr = torch.randn(len(lens), h, r, generator=g).to(DEVICE), torch.randn(len(lens), h, p, generator=g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cpu = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt)
    cpu.buffer.copy_(cache.buffer.cpu())
    if fmt.is_fp8 and not fmt.block_scaled:
        cpu.latent_scale.copy_(cache.latent_scale.cpu())
    want = ref.paged_decode_mla(ql.cpu(), qr.cpu(), cpu, table.cpu(), seq_lens.cpu(), 0.2)
    kw = dict(split_tokens=split, block_h=block_h, heads_m=heads_m, block_n=16 if heads_m else None)
    got = _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2, **kw)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    assert torch.equal(got, _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2, **kw))



@pytest.mark.parametrize("heads_m", [False, True], ids=["tokens-M", "heads-M"])
def test_triton_paged_mla_decode_late_max_rescales_some_heads(heads_m):
    """Lazy rescaling in the MLA decode (rescale_slack > 0: the accumulator is rescaled only when a
    tile's max passes the running max by the slack): a key in the third 32-token tile that scores
    >12 nats above the rest for head 0 (and not for every head) makes that tile rescale some heads
    and not others, and one long split walks tiles before and after it; the reference to fp32
    rounding, as the eager form (the default, RESCALE_SLACK 0); a negative slack is refused."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    r, p, h, n = 32, 16, 4, 5 * BS + 9
    fmt = KVFormat("auto", dtype=torch.float32)
    cache = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    table = random_block_tables([n], BS, NUM_BLOCKS, g).to(DEVICE)
    ql, qr = torch.randn(1, h, r, generator=g), torch.randn(1, h, p, generator=g)
    ql[0, 0] *= r ** 0.5 / ql[0, 0].norm()                   # |q_0|^2 = r: token 70 scores r nats for head 0
    ql[0, 3] = -ql[0, 0]                                      # head 3 scores token 70 lowest: no rescale
    lat = torch.randn(n, r, generator=g)
    lat[70] = 5.0 * ql[0, 0]                                  # token 70: tile 3 of the split
    write_mla_kv(cache, lat.to(DEVICE), torch.randn(n, p, generator=g).to(DEVICE),
                 slots_for(table.cpu(), 0, range(n), BS).to(DEVICE))
    scores = 0.2 * (lat @ ql[0].T)                            # latent part of the scores [n, h]
    jump = scores[70] - scores[:64].max(0).values
    assert jump[0] > 12.0 and bool((jump < 4.0).any()), jump        # head 0 rescales, some head does not
    seq_lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    cpu = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt)
    cpu.buffer.copy_(cache.buffer.cpu())
    want = ref.paged_decode_mla(ql, qr, cpu, table.cpu(), seq_lens.cpu(), 0.2)
    for slack in (8.0, 1.0, None):
        got = _mla().paged_decode_mla(ql.to(DEVICE), qr.to(DEVICE), cache, table, seq_lens, 0.2, split_tokens=n + 7,
                                      rescale_slack=slack, heads_m=heads_m)
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ConfigError, match="rescale_slack"):
        _mla().paged_decode_mla(ql.to(DEVICE), qr.to(DEVICE), cache, table, seq_lens, 0.2, rescale_slack=-1.0)


@pytest.mark.parametrize("fmt", [KVFormat("auto", dtype=torch.bfloat16),
                                 KVFormat("fp8_e4m3", "block", group=16, dtype=torch.bfloat16)],
                         ids=["bf16", "fp8-block"])
@pytest.mark.parametrize("heads_m", [False, True], ids=["tokens-M", "heads-M"])
def test_triton_paged_mla_decode_bf16_queries(fmt, heads_m):
    """Serving dtypes: bf16 queries take the bf16 tensor-core operand path (emulated under the
    interpreter), the tile cast to bf16 once and P cast to bf16; held to bf16 accuracy."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    r, p, h, lens = 32, 16, 4, [3 * BS + 7, 5]
    cache = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_mla_kv(cache, torch.randn(n, r, generator=g).to(DEVICE), torch.randn(n, p, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    ql = torch.randn(len(lens), h, r, generator=g).to(DEVICE, torch.bfloat16)
    qr = torch.randn(len(lens), h, p, generator=g).to(DEVICE, torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = ref.paged_decode_mla(ql.cpu(), qr.cpu(), _mla_cpu(cache), table.cpu(), seq_lens.cpu(), 0.2).float()
    got = _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2, split_tokens=32, heads_m=heads_m).float().cpu()
    # bf16 q and P put the relative error near 0.8% (its tail reaches 1% over random inputs, fp8 KV
    # included); a wrong tile, scale or row is O(1)
    err = float((got - want).norm() / want.norm())
    assert got.dtype == want.dtype and err < 2e-2, f"relative error {err} (seed {seed})"

@pytest.mark.parametrize("fmt,qdtype,form", [
    (KVFormat("auto", dtype=torch.bfloat16), torch.bfloat16, (True, 64, 0.0)),
    (KVFormat("fp8_e4m3", "block", group=16, dtype=torch.bfloat16), torch.bfloat16, (True, 64, 0.0)),
    (KVFormat("fp8_e4m3", dtype=torch.bfloat16), torch.bfloat16, (False, 32, 0.0)),
    (KVFormat("auto", dtype=torch.bfloat16), torch.float32, (False, 32, 8.0)),
    (KVFormat("auto", dtype=torch.float32), torch.float32, (False, 32, 0.0))],
    ids=["bf16", "fp8-block", "fp8-tensor", "bf16-cache-fp32-q", "fp32"])
def test_mla_decode_default_form_follows_queries_and_cache_format(fmt, qdtype, form):
    """The MLA decode's default form (mla_decode_form): the heads-as-M 64-token eager tile for bf16
    queries over bf16 and fp8-block caches (where it won on the H200, run 25), the transposed
    32-token tile otherwise (lazy over a bf16 cache, run 23); a function of the query dtype, cache
    format and device only (batch invariance); the default launch is bit-identical to that form
    given explicitly, and another form changes the bits no more than rounding."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    r, p, h, lens = 32, 16, 4, [5 * BS + 3]
    cache = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    write_mla_kv(cache, torch.randn(lens[0], r, generator=g).to(DEVICE),
                 torch.randn(lens[0], p, generator=g).to(DEVICE),
                 slots_for(table.cpu(), 0, range(lens[0]), BS).to(DEVICE))
    ql = torch.randn(1, h, r, generator=g).to(DEVICE, qdtype)
    qr = torch.randn(1, h, p, generator=g).to(DEVICE, qdtype)
    if DEVICE == "cpu" or torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 222 * 1024:
        assert tuple(_mla().mla_decode_form(ql, cache)) == form
    heads_m, block_n, slack = _mla().mla_decode_form(ql, cache)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2)
    assert torch.equal(got, _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2, heads_m=heads_m,
                                                    block_n=block_n, rescale_slack=slack))
    other = _mla().paged_decode_mla(ql, qr, cache, table, seq_lens, 0.2, heads_m=not heads_m, block_n=32,
                                    rescale_slack=0.0)
    tol = 1e-2 if qdtype == torch.bfloat16 else 1e-5
    assert float((other.float() - got.float()).norm() / got.float().norm()) < tol


def test_padded_table_width_changes_nothing():
    """The engine pads block tables to max_model_len for CUDA graphs: the extra columns add
    splits that hold no keys, which write nothing and are never merged, so the output is
    bit-identical to the narrow table's (GQA and MLA)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    fmt = KVFormat("auto", dtype=torch.float32)
    cache, table, seq_lens, q = _setup(fmt, [3 * BS + 2, 5], 4, 2, 16, g)
    wide = torch.cat([table, torch.randint(0, NUM_BLOCKS, (2, 9), generator=g, dtype=torch.int32).to(DEVICE)], 1)
    narrow_out = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=BS)
    assert torch.equal(_tri().paged_decode_gqa(q, cache, wide, seq_lens, 0.3, split_tokens=BS), narrow_out)
    r, p = 32, 16
    mla = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    for b, n in enumerate([3 * BS + 2, 5]):
        write_mla_kv(mla, torch.randn(n, r, generator=g).to(DEVICE), torch.randn(n, p, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    ql, qr = torch.randn(2, 4, r, generator=g).to(DEVICE), torch.randn(2, 4, p, generator=g).to(DEVICE)
    narrow_out = _mla().paged_decode_mla(ql, qr, mla, table, seq_lens, 0.2, split_tokens=BS)
    assert torch.equal(_mla().paged_decode_mla(ql, qr, mla, wide, seq_lens, 0.2, split_tokens=BS), narrow_out)
    want = ref.paged_decode_mla(ql.cpu(), qr.cpu(), _mla_cpu(mla), table.cpu(), seq_lens.cpu(), 0.2)
    torch.testing.assert_close(narrow_out.cpu(), want, rtol=2e-5, atol=2e-5)


def _mla_cpu(cache):
    cpu = new_mla_layer(cache.num_blocks, cache.block_size, cache.kv_lora_rank, cache.rope.shape[-1], cache.fmt)
    cpu.buffer.copy_(cache.buffer.cpu())
    return cpu


def test_max_splits_lengthens_splits_of_long_sequences():
    """A sequence needing more than max_splits splits of split_tokens gets max_splits longer ones:
    still equal to the reference (GQA with a window across splits, MLA)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    fmt = KVFormat("auto", dtype=torch.float32)
    lens = [7 * BS + 3, BS - 2]
    cache, table, seq_lens, q = _setup(fmt, lens, 4, 2, 16, g)
    want = ref.paged_decode_gqa(q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, 3 * BS)
    got = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, 3 * BS, split_tokens=BS, max_splits=3)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    r, p = 32, 16
    mla = new_mla_layer(NUM_BLOCKS, BS, r, p, fmt, device=DEVICE)
    for b, n in enumerate(lens):
        write_mla_kv(mla, torch.randn(n, r, generator=g).to(DEVICE), torch.randn(n, p, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    ql, qr = torch.randn(2, 4, r, generator=g).to(DEVICE), torch.randn(2, 4, p, generator=g).to(DEVICE)
    got = _mla().paged_decode_mla(ql, qr, mla, table, seq_lens, 0.2, split_tokens=BS, max_splits=2)
    want = ref.paged_decode_mla(ql.cpu(), qr.cpu(), _mla_cpu(mla), table.cpu(), seq_lens.cpu(), 0.2)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt,lens,hq,hkv,d,window,split", CASES)
def test_fused_merge_gives_the_merge_kernels_result(fmt, lens, hq, hkv, d, window, split):
    """fused_merge (no merge launch: the last program of each (sequence, kv head) merges) is the
    two-launch result: bit for bit under the interpreter, within fp32 rounding compiled; reruns
    bit-identical; the counters zero again after every launch."""
    at = _tri()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(fmt, lens, hq, hkv, d, g)
    two = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split)
    one = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split, fused_merge=True)
    if DEVICE == "cpu":
        assert torch.equal(one, two)
    else:
        torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)
    assert int(at._merge_counters(q.device, 1).abs().sum()) == 0
    assert torch.equal(one, at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split,
                                                fused_merge=True))


def test_device_gates_of_the_default_forms(monkeypatch):
    """The defaults that need a newer GPU fall back on older ones: fp8_words needs sm_89+ (the
    paired e4m3 conversion), the heads-as-M MLA tile ~217 KiB of shared memory per block (an A100
    has 163 KiB, an L40 99 KiB); the interpreter (non-CUDA devices) takes the H200's forms."""
    from moet.kernels import attention_triton, mla_decode_triton
    cuda = torch.device("cuda")
    for cap, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(attention_triton, "device_capability", lambda d, cap=cap: cap)
        assert attention_triton.fp8_words_device_ok(cuda) is ok
    for kib, ok in ((99, False), (163, False), (227, True), (228, True)):
        monkeypatch.setattr(mla_decode_triton, "device_shared_memory", lambda d, kib=kib: kib * 1024)
        assert mla_decode_triton.mla_heads_m_fits(cuda) is ok
    assert attention_triton.fp8_words_device_ok(torch.device("cpu"))
    assert mla_decode_triton.mla_heads_m_fits(torch.device("cpu"))


def test_explicit_heads_m_too_big_for_the_device_is_a_clear_error(monkeypatch):
    """heads_m=True at DeepSeek-V3's shape (64 heads, R 512 + P 64, 64-token steps: ~216 KiB) on a
    GPU with 163 KiB of shared memory per block is refused up front, naming the flag that fixes it;
    it passes on 227 KiB, and 32-token steps fit the smaller device."""
    from moet.kernels import mla_decode_triton as md
    cuda = torch.device("cuda")
    monkeypatch.setattr(md, "_INTERPRET", False)
    monkeypatch.setattr(md, "device_shared_memory", lambda d: 163 * 1024)
    with pytest.raises(ConfigError, match="heads_m=False"):
        md.check_heads_m_fits(cuda, 64, 512, 64, 64, "paged decode mla")
    md.check_heads_m_fits(cuda, 64, 512, 64, 32, "paged decode mla")
    monkeypatch.setattr(md, "device_shared_memory", lambda d: 227 * 1024)
    md.check_heads_m_fits(cuda, 64, 512, 64, 64, "paged decode mla")


def _long_setup(g: torch.Generator):
    """A 2,131-token and a 40-token sequence (fp32 cache, 2 kv heads of 16, 4 query heads) for the
    long partition's tests: (cache, block tables, lengths, queries)."""
    lens = [2131, 40]
    nb = sum(-(-n // BS) for n in lens) + 3
    cache = new_gqa_layer(nb, BS, 2, 16, 16, KVFormat("auto", dtype=torch.float32), device=DEVICE)
    table = random_block_tables(lens, BS, nb, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_gqa_kv(cache, torch.randn(n, 2, 16, generator=g).to(DEVICE), torch.randn(n, 2, 16, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE), torch.randn(2, 4, 16, generator=g).to(DEVICE)


def test_long_partition_matches_reference_and_keeps_short_sequences_bits():
    """The long partition (long_splits): past max_splits splits of 1,024 tokens a sequence gets more
    splits of 1,024 tokens, merged in chunks of BLOCK_S. Here max_splits 2 (BLOCK_S 2) and long_splits
    5 (3 merge chunks): a 2,131-token sequence (134 pages) gets 3 splits of 64 pages instead of 2 of
    67 -- its second merge chunk is used, its third is not -- and matches the reference; a 40-token
    sequence in the same batch keeps its bits (its partition is the same); reruns identical."""
    at = _tri()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _long_setup(g)
    kw = dict(split_tokens=BS, max_splits=2)
    got = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, long_splits=5, **kw)
    want = ref.paged_decode_gqa(q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3)
    assert float((got.cpu() - want).norm() / want.norm()) < 2e-5
    assert torch.equal(got, at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, long_splits=5, **kw))
    plain = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, **kw)          # explicit max_splits: no long
    assert torch.equal(plain, at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, long_splits=0, **kw))
    assert torch.equal(got[1], plain[1])
    assert float((plain.cpu() - want).norm() / want.norm()) < 2e-5
    with pytest.raises(ConfigError, match="long_splits"):
        at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, long_splits=-1, **kw)


@pytest.mark.parametrize("fused_merge", [False, True], ids=["merge-kernel", "fused-merge"])
@pytest.mark.parametrize("fmt,lens,hq,hkv,d,window,split", [CASES[0], CASES[2], CASES[3]])
def test_sinks_match_reference(fmt, lens, hq, hkv, d, window, split, fused_merge):
    """gpt-oss's attention sinks, added where the splits merge (merge kernel and fused merge):
    the reference's softmax over [scores, sink] without the sink's column; far from sinkless."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _setup(fmt, lens, hq, hkv, d, g)
    # about as heavy as the keys' own mass (log of the context), some heads more, some less
    sinks = (math.log(max(lens)) + 1.5 * torch.randn(hq, generator=g)).to(DEVICE)
    args = (q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, window)
    want = ref.paged_decode_gqa(*args, sinks=sinks.cpu())
    got = _tri().paged_decode_gqa(q, cache, table, seq_lens, 0.3, window, split_tokens=split, sinks=sinks,
                                  fused_merge=fused_merge)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    assert (want - ref.paged_decode_gqa(*args)).abs().max() > 0.05


def test_sinks_with_the_long_partition():
    """The long partition's chunked merge adds the sink once, after the last chunk."""
    at = _tri()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    cache, table, seq_lens, q = _long_setup(g)
    sinks = (math.log(int(seq_lens.max())) + 1.5 * torch.randn(4, generator=g)).to(DEVICE)
    got = at.paged_decode_gqa(q, cache, table, seq_lens, 0.3, split_tokens=BS, max_splits=2, long_splits=5, sinks=sinks)
    want = ref.paged_decode_gqa(q.cpu(), _to_cpu(cache), table.cpu(), seq_lens.cpu(), 0.3, sinks=sinks.cpu())
    assert float((got.cpu() - want).norm() / want.norm()) < 2e-5
