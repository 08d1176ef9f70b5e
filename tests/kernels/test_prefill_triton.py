"""The Triton paged prefill/extend (GQA) against the torch reference (float32), under
TRITON_INTERPRET=1 when there is no GPU: fresh random inputs every run, ragged query lengths,
random block tables, query chunks starting and ending inside pages and crossing page boundaries,
sequences with prior cached context plus new tokens, several query tiles per sequence, GQA
groups, fp8 caches, sliding window, bit-identical reruns."""
from __future__ import annotations

import math


import pytest
import torch

from moet.errors import ConfigError

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton


from moet.kernels import attention_reference as ref  # noqa: E402
from moet.kernels.kv_cache import KVFormat, new_gqa_layer, write_gqa_kv  # noqa: E402
from tests.kernels.paged import random_block_tables, slots_for  # noqa: E402

BS = 16
NUM_BLOCKS = 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32 = KVFormat("auto", dtype=torch.float32)


def _tri():
    from moet.kernels import prefill_triton
    return prefill_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)   # fresh inputs every run


def _setup(fmt: KVFormat, seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, g: torch.Generator):
    """seqs: (tokens in the cache including this step's, this step's query count) per sequence.
    All tokens' K/V are written first (the step's own too), as the engine does."""
    lens = [n for n, _ in seqs]
    cache = new_gqa_layer(NUM_BLOCKS, BS, hkv, d, d, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.k_scale.fill_(0.02)               # a calibrated-looking scale, so a dropped one fails
        cache.v_scale.fill_(0.03)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_gqa_kv(cache, torch.randn(n, hkv, d, generator=g).to(DEVICE),
                     torch.randn(n, hkv, d, generator=g).to(DEVICE), slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    cu = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(DEVICE)
    return cache, table, cu.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), q


def _to_cpu(cache):
    from dataclasses import replace
    return replace(cache, k=cache.k.cpu(), v=cache.v.cpu(),
                   k_scale=None if cache.k_scale is None else cache.k_scale.cpu(),
                   v_scale=None if cache.v_scale is None else cache.v_scale.cpu())


CASES = [
    # fmt, seqs (cached incl. new, new), hq, hkv, d, window, block_m
    # plain prefills inside one page / across a page; context + new chunk starting and ending
    # mid-page across two page boundaries; extend by one token; a sequence with no queries
    (F32, [(5, 5), (BS + 3, BS + 3), (2 * BS + 5, BS + 7), (BS, 1), (BS + 2, 0)], 4, 2, 16, None, 8),
    (F32, [(3 * BS + 1, 2 * BS + 9), (7, 7)], 8, 1, 32, None, None),                 # MQA-like group 8
    (F32, [(4 * BS + 6, 2 * BS + 1), (BS - 1, BS - 1)], 4, 4, 16, 20, 16),           # window over pages
    (KVFormat("fp8_e4m3", "tensor"), [(2 * BS + 2, BS + 5), (9, 9)], 4, 2, 16, None, 8),
    (KVFormat("fp8_e4m3", "block", group=8), [(3, 3), (3 * BS - 1, 2 * BS)], 6, 2, 24, None, 8),  # d not pow2
]


@pytest.mark.parametrize("slack", [None, 0.25], ids=["eager", "lazy"])     # rescale_slack (attention_triton)
@pytest.mark.parametrize("fmt,seqs,hq,hkv,d,window,block_m", CASES)
def test_triton_paged_prefill_matches_reference(fmt, seqs, hq, hkv, d, window, block_m, slack):
    g = _gen()
    cache, table, cu, seq_lens, q = _setup(fmt, seqs, hq, hkv, d, g)
    want = ref.paged_prefill_gqa(q.cpu(), _to_cpu(cache), table.cpu(), cu.cpu(), seq_lens.cpu(), 0.3, window)
    got = _tri().paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3, window, block_m=block_m, rescale_slack=slack)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    again = _tri().paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3, window, block_m=block_m, rescale_slack=slack)
    assert torch.equal(got, again)              # bit-identical run to run


@pytest.mark.parametrize("slack", [None, 0.25], ids=["eager", "lazy"])
def test_chunked_prefill_equals_one_shot_and_last_token_equals_decode(slack):
    """The same prompt attended in one step or in two chunks (prefix cached first) gives the same
    rows (keys come from the cache either way); a one-query extend equals the Triton decode; with
    the eager and the lazy online-softmax rescale."""
    g = _gen()
    n, split = 3 * BS + 4, BS + 5
    cache, table, _, _, _ = _setup(F32, [(n, n)], 4, 2, 16, g)
    q = torch.randn(n, 4, 16, generator=g).to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    tri = _tri()
    whole = tri.paged_prefill_gqa(q, cache, table, torch.tensor([0, n], dtype=torch.int32, device=DEVICE), lens, 0.3,
                                  rescale_slack=slack)
    first = tri.paged_prefill_gqa(q[:split], cache, table, torch.tensor([0, split], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([split], dtype=torch.int32, device=DEVICE), 0.3,
                                  rescale_slack=slack)
    second = tri.paged_prefill_gqa(q[split:], cache, table, torch.tensor([0, n - split], dtype=torch.int32,
                                                                          device=DEVICE), lens, 0.3, rescale_slack=slack)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=2e-5, atol=2e-5)
    from moet.kernels import attention_triton
    dec = attention_triton.paged_decode_gqa(q[-1:], cache, table, lens, 0.3, split_tokens=BS)
    torch.testing.assert_close(whole[-1:], dec, rtol=2e-5, atol=2e-5)
    assert torch.isfinite(whole).all()


def test_padding_queries_and_empty_batches():
    """A sequence with zero queries writes nothing into its neighbours' rows; a batch with no
    queries at all returns an empty tensor; bad shapes raise ConfigError."""
    g = _gen()
    cache, table, cu, seq_lens, q = _setup(F32, [(BS + 1, 0), (6, 6), (2, 0)], 4, 2, 16, g)
    got = _tri().paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3, max_seqlen_q=6)
    want = ref.paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    empty = _tri().paged_prefill_gqa(q[:0], cache, table, torch.zeros(4, dtype=torch.int32, device=DEVICE),
                                     seq_lens, 0.3)
    assert empty.shape == (0, 4, 16)
    with pytest.raises(ConfigError, match="multiple"):
        _tri().paged_prefill_gqa(torch.zeros(6, 3, 16, device=DEVICE), cache, table, cu, seq_lens, 0.3)
    with pytest.raises(ConfigError, match="block_m"):
        _tri().paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3, block_m=3)


def test_fp32_queries_take_their_own_launch(monkeypatch):
    """fp32 queries (fp32 dots: a float32 model) launch with prefill_launch's fp32 form, 128 rows: at
    the bf16 form's 256 rows their tiles need 263 KB of shared memory on the H200 (run 34), so the
    dtype must reach the launch choice; bf16 queries take the 256-row form."""
    pt = _tri()
    seen = []
    real = pt.prefill_launch
    monkeypatch.setattr(pt, "prefill_launch", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    g = _gen()
    cache, table, cu, lens, q = _setup(F32, [(BS + 3, 5)], 4, 2, 16, g)
    got = pt.paged_prefill_gqa(q, cache, table, cu, lens, 0.3)
    want = ref.paged_prefill_gqa(q.cpu(), _to_cpu(cache), table.cpu(), cu.cpu(), lens.cpu(), 0.3)
    assert float((got.cpu() - want).norm() / want.norm()) < 2e-5
    pt.paged_prefill_gqa(q.to(torch.bfloat16), cache, table, cu, lens, 0.3)
    flags = [bool(a[2] if len(a) > 2 else k.get("fp32_queries", False)) for a, k in seen]
    assert flags == [True, False], seen
    assert real(False, 128, True)[0] == pt.PREFILL_FP32_ROWS < pt.PREFILL_ROWS == real(False, 128, False)[0]


@pytest.mark.parametrize("slack", [None, 0.25], ids=["eager", "lazy"])
@pytest.mark.parametrize("fmt,seqs,hq,hkv,d,window,block_m", [CASES[0], CASES[2], CASES[3]])
def test_sinks_match_reference(fmt, seqs, hq, hkv, d, window, block_m, slack):
    """gpt-oss's attention sinks (one logit per query head in every softmax's denominator), large
    enough to take most of the mass from some heads and little from others: the reference's
    softmax over [scores, sink] with the sink's column dropped; far from the sinkless result."""
    g = _gen()
    cache, table, cu, seq_lens, q = _setup(fmt, seqs, hq, hkv, d, g)
    # about as heavy as the keys' own mass (log of the context), some heads more, some less
    sinks = (math.log(max(n for n, _ in seqs)) + 1.5 * torch.randn(hq, generator=g)).to(DEVICE)
    args = (q.cpu(), _to_cpu(cache), table.cpu(), cu.cpu(), seq_lens.cpu(), 0.3, window)
    want = ref.paged_prefill_gqa(*args, sinks=sinks.cpu())
    got = _tri().paged_prefill_gqa(q, cache, table, cu, seq_lens, 0.3, window, block_m=block_m, rescale_slack=slack,
                                   sinks=sinks)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    assert (want - ref.paged_prefill_gqa(*args)).abs().max() > 0.05
