"""The Triton paged MLA prefill/extend (weight-absorbed) against the torch reference (float32),
under TRITON_INTERPRET=1 without a GPU: ragged query lengths with prior cached context, chunks
starting and ending inside pages, random block tables, heads not a multiple of the head block,
several query tokens per program, all three MLA cache formats, bit-identical reruns; chunked
equals one-shot and the last row equals the Triton decode."""
from __future__ import annotations

import pytest
import torch

from moet.errors import ConfigError

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

from moet.kernels import attention_reference as ref  # noqa: E402
from moet.kernels.kv_cache import KVFormat, new_mla_layer, write_mla_kv  # noqa: E402
from tests.kernels.paged import random_block_tables, slots_for  # noqa: E402

BS = 16
NUM_BLOCKS = 16
R, P = 32, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32 = KVFormat("auto", dtype=torch.float32)


def _tri():
    from moet.kernels import mla_prefill_triton
    return mla_prefill_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _setup(fmt: KVFormat, seqs: list[tuple[int, int]], h: int, g: torch.Generator):
    """seqs: (tokens cached including this step's, this step's queries). All rows written first."""
    lens = [n for n, _ in seqs]
    cache = new_mla_layer(NUM_BLOCKS, BS, R, P, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        cache.latent_scale.fill_(0.02)
    table = random_block_tables(lens, BS, NUM_BLOCKS, g).to(DEVICE)
    for b, n in enumerate(lens):
        write_mla_kv(cache, torch.randn(n, R, generator=g).to(DEVICE), torch.randn(n, P, generator=g).to(DEVICE),
                     slots_for(table.cpu(), b, range(n), BS).to(DEVICE))
    cu = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    tq = int(cu[-1])
    ql, qr = torch.randn(tq, h, R, generator=g).to(DEVICE), torch.randn(tq, h, P, generator=g).to(DEVICE)
    return cache, table, cu.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), ql, qr


def _cpu(cache):
    c = new_mla_layer(cache.num_blocks, cache.block_size, R, P, cache.fmt)
    c.buffer.copy_(cache.buffer.cpu())
    if cache.fmt.is_fp8 and not cache.fmt.block_scaled:
        c.latent_scale.copy_(cache.latent_scale.cpu())
    return c


CASES = [
    # fmt, seqs (cached incl. new, new), heads, block_h, block_m
    (F32, [(5, 5), (BS + 3, BS + 3), (2 * BS + 5, BS + 7), (BS, 1), (BS + 2, 0)], 4, 4, 4),
    (F32, [(3 * BS + 1, 2 * BS + 9), (7, 7)], 20, 16, 1),             # two head blocks, the 2nd partial
    (KVFormat("fp8_e4m3", "tensor"), [(2 * BS + 2, BS + 5), (9, 9)], 4, 4, 4),
    (KVFormat("fp8_e4m3", "block", group=16), [(3, 3), (3 * BS - 1, 2 * BS)], 8, 8, 2),   # fp8_ds_mla row
]


# rescale_slack (attention_triton), and the rows-as-M tile (heads_m)
# (16 keys a step, so the short test sequences cross steps; and the default 64)
FORMS = [dict(rescale_slack=None), dict(rescale_slack=0.25), dict(heads_m=True, block_n=16),
         dict(heads_m=True, block_n=16, rescale_slack=0.25), dict(heads_m=True)]
FORM_IDS = ["eager", "lazy", "heads-M", "heads-M-lazy", "heads-M-64"]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("fmt,seqs,h,block_h,block_m", CASES)
def test_triton_paged_mla_prefill_matches_reference(fmt, seqs, h, block_h, block_m, form):
    g = _gen()
    cache, table, cu, lens, ql, qr = _setup(fmt, seqs, h, g)
    want = ref.paged_prefill_mla(ql.cpu(), qr.cpu(), _cpu(cache), table.cpu(), cu.cpu(), lens.cpu(), 0.2)
    kw = dict(block_h=block_h, block_m=block_m, **form)
    got = _tri().paged_prefill_mla(ql, qr, cache, table, cu, lens, 0.2, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    again = _tri().paged_prefill_mla(ql, qr, cache, table, cu, lens, 0.2, **kw)
    assert torch.equal(got, again)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_chunked_equals_one_shot_and_last_row_equals_decode(form):
    g = _gen()
    n, split = 2 * BS + 4, BS + 5
    cache, table, _, _, _, _ = _setup(F32, [(n, n)], 4, g)
    ql, qr = torch.randn(n, 4, R, generator=g).to(DEVICE), torch.randn(n, 4, P, generator=g).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([n], **i32)
    tri = _tri()
    kw = dict(block_h=4, block_m=4, **form)
    whole = tri.paged_prefill_mla(ql, qr, cache, table, torch.tensor([0, n], **i32), lens, 0.2, **kw)
    first = tri.paged_prefill_mla(ql[:split], qr[:split], cache, table, torch.tensor([0, split], **i32),
                                  torch.tensor([split], **i32), 0.2, **kw)
    second = tri.paged_prefill_mla(ql[split:], qr[split:], cache, table, torch.tensor([0, n - split], **i32),
                                   lens, 0.2, **kw)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=2e-5, atol=2e-5)
    from moet.kernels import mla_decode_triton
    dec = mla_decode_triton.paged_decode_mla(ql[-1:], qr[-1:], cache, table, lens, 0.2, split_tokens=BS,
                                            **{k: v for k, v in form.items() if k != "block_n"})
    torch.testing.assert_close(whole[-1:], dec, rtol=2e-5, atol=2e-5)
    with pytest.raises(ConfigError, match="block_h"):
        tri.paged_prefill_mla(ql, qr, cache, table, torch.tensor([0, n], **i32), lens, 0.2, block_h=3)



@pytest.mark.parametrize("qdtype,heads_m", [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16-q", "fp32-q"])
def test_default_prefill_form_is_the_decodes(qdtype, heads_m):
    """The prefill's default tile form is the decode's (mla_decode_triton.mla_decode_form): rows as
    M over 64 keys for bf16 queries over a bf16 cache (H200 run 25d: +34% at 8K), transposed for
    fp32 queries; bit-identical to that form given explicitly, and to the reference."""
    from moet.kernels import mla_decode_triton
    g = _gen()
    cache, table, cu, lens, ql, qr = _setup(KVFormat("auto", dtype=torch.bfloat16), [(3 * BS + 5, 2 * BS + 1)], 4, g)
    ql, qr = ql.to(qdtype), qr.to(qdtype)
    assert mla_decode_triton.mla_decode_form(ql, cache).heads_m == heads_m
    got = _tri().paged_prefill_mla(ql, qr, cache, table, cu, lens, 0.2)
    assert torch.equal(got, _tri().paged_prefill_mla(ql, qr, cache, table, cu, lens, 0.2, heads_m=heads_m,
                                                     block_n=64 if heads_m else 32))
    want = ref.paged_prefill_mla(ql.cpu().float(), qr.cpu().float(), _cpu(cache), table.cpu(), cu.cpu(), lens.cpu(),
                                 0.2).float()
    assert float((got.float().cpu() - want).norm() / want.norm()) < (1e-2 if qdtype == torch.bfloat16 else 1e-5)
