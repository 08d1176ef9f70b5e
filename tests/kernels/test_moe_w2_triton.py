"""The Triton W2 grouped MoE (moet.kernels.moe_w2_triton) against moe_experts_reference, and its
slot alignment (moet.kernels.moe_align) against a brute-force loop; under TRITON_INTERPRET=1 when
there is no GPU. Fresh random codes (all 256 byte values) and scale bytes 115..125, slot tables
with non-resident experts, SwiGLU clamp on and off, workspaces poisoned with NaN before every run,
bit-identical reruns."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.kernels.triton_support import requires_ptxas, requires_triton

pytestmark = requires_triton


from moet.kernels.moe_align import max_padded_rows, moe_align_block_size  # noqa: E402
from moet.kernels.pools import DensePool, W2Pool  # noqa: E402
from moet.kernels.reference import moe_experts_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tri():
    from moet.kernels import moe_w2_triton
    return moe_w2_triton


def _pool(slots: int, h: int, i: int, g: torch.Generator) -> W2Pool:
    def codes(*s):
        return torch.randint(0, 256, s, generator=g, dtype=torch.uint8).to(DEVICE)

    def scales(*s):
        return torch.randint(115, 126, s, generator=g, dtype=torch.uint8).to(DEVICE)
    return W2Pool(codes(slots, 2 * i, h // 4), scales(slots, 2 * i, h // 32),
                  codes(slots, h, i // 4), scales(slots, h, i // 32))


def _inputs(t: int, k: int, h: int, num_experts: int, g: torch.Generator, dtype=torch.float32):
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    # k distinct experts per token, as a router's top-k gives
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=g)
    return x, ids.to(DEVICE), (w / w.sum(-1, keepdim=True).clamp(min=1e-6)).to(DEVICE)


def _table(entries: list[int]) -> torch.Tensor:
    return torch.tensor(entries, dtype=torch.int32, device=DEVICE)


def _close(a: torch.Tensor, r: torch.Tensor):
    assert not torch.isnan(a).any(), "unwritten (NaN-poisoned) elements reached the output"
    scale = r.abs().max().item() if r.numel() else 1.0
    torch.testing.assert_close(a, r, rtol=1e-5, atol=2e-6 * max(scale, 1e-30))


def _run(hidden, ids, w, table, pool, limit, poison=float("nan"), **blocks):
    """The two launches with act and y poisoned beforehand; returns (out, y, misses)."""
    tri = _tri()
    t, k = ids.shape
    h, i = hidden.shape[1], pool.down_codes.shape[2] * 4
    act = torch.full((t * k, i), poison, dtype=torch.float32, device=DEVICE)
    y = torch.full((t, k, h), poison, dtype=torch.float32, device=DEVICE)
    y_out, aligned = tri._moe_w2_grouped(hidden, ids, w, table, pool, swiglu_limit=limit, act=act, y=y, **blocks)
    assert y_out is y
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out.to(hidden.dtype), y, int(aligned.num_misses.item())


# ---------------------------------------------------------------------------------- alignment

def _align_brute(ids: torch.Tensor, table: torch.Tensor, num_slots: int, bm: int):
    """Independent loop: per slot ascending, its pairs in ascending pair id, padded to bm."""
    flat = ids.reshape(-1).tolist()
    p = len(flat)
    tab = table.tolist()
    rows, bslots, misses = [], [], 0
    per = {}
    for pid, e in enumerate(flat):
        s = tab[e]
        if s < 0:
            misses += 1
        else:
            per.setdefault(s, []).append(pid)
    for s in sorted(per):
        lst = per[s] + [p] * (-len(per[s]) % bm)
        rows += lst
        bslots += [s] * (len(lst) // bm)
    return rows, bslots, misses


@pytest.mark.parametrize("t,k,num_experts,slots,bm,seed", [
    (5, 2, 6, 8, 16, 0), (40, 3, 6, 8, 4, 1), (7, 4, 9, 4, 1, 2), (0, 2, 6, 8, 16, 3), (33, 1, 5, 5, 8, 4)])
def test_align_matches_brute_force(t, k, num_experts, slots, bm, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (t, k), generator=g).to(DEVICE)
    perm = torch.randperm(slots, generator=g)[:num_experts].tolist()
    entries = [perm[e] if e < len(perm) and e % 3 != 1 else -1 for e in range(num_experts)]
    table = _table(entries)
    a = moe_align_block_size(ids, table, slots, bm)
    rows, bslots, misses = _align_brute(ids.cpu(), table.cpu(), slots, bm)
    size = max_padded_rows(t * k, slots, bm)
    assert a.sorted_ids.dtype == torch.int32 and a.block_slot.dtype == torch.int32
    assert a.sorted_ids.shape == (size,) and a.block_slot.shape == (size // bm,)
    assert a.sorted_ids[:len(rows)].tolist() == rows
    assert (a.sorted_ids[len(rows):] == t * k).all()                   # the padding sentinel
    assert a.block_slot[:len(bslots)].tolist() == bslots
    assert (a.block_slot[len(bslots):] == -1).all()                    # unused tiles
    assert int(a.num_rows_post_padded.item()) == len(rows)
    assert int(a.num_misses.item()) == misses
    if t:
        assert misses > 0 or all(x >= 0 for x in entries)


def test_align_all_missed_and_bound_is_tight():
    ids = torch.tensor([[0, 1], [1, 0]], device=DEVICE)
    a = moe_align_block_size(ids, _table([-1, -1]), 4, 16)
    assert int(a.num_misses.item()) == 4 and (a.block_slot == -1).all() and (a.sorted_ids == 4).all()
    # worst case: every pair alone in its own slot needs the whole bound
    ids = torch.arange(4, device=DEVICE).reshape(4, 1)
    a = moe_align_block_size(ids, _table([0, 1, 2, 3]), 4, 8)
    assert a.sorted_ids.numel() == 32 and a.block_slot.tolist() == [0, 1, 2, 3]
    assert a.sorted_ids.tolist() == sum(([p] + [4] * 7 for p in range(4)), [])


# ------------------------------------------------------------------------ kernel vs reference

CASES = [
    # t, k, h, i, num_experts, slots, table, limit, blocks
    (5, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], None, {}),
    (5, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], 1.0, {}),
    # several tiles per slot, several N tiles, a K tail (H 96 with BLOCK_K 64)
    (24, 3, 96, 64, 6, 8, [6, 2, -1, 1, 4, 0], None, dict(block_m=16, block_n=32, block_k=64)),
    (24, 3, 96, 64, 6, 8, [6, 2, -1, 1, 4, 0], 0.5, dict(block_m=16, block_n=16, block_k=32)),
    (9, 2, 32, 32, 4, 4, [0, 1, 2, 3], 2.0, dict(block_m=16, block_n=64, block_k=128)),   # blocks > dims
]


@pytest.mark.parametrize("t,k,h,i,num_experts,slots,table,limit,blocks", CASES)
def test_matches_reference(t, k, h, i, num_experts, slots, table, limit, blocks):
    g = torch.Generator().manual_seed(1000 + t + h + (limit is not None))
    pool = _pool(slots, h, i, g)
    tab = _table(table)
    x, ids, w = _inputs(t, k, h, num_experts, g)
    m_ref = torch.full((1,), 3, dtype=torch.int32, device=DEVICE)
    ref = moe_experts_reference(x, ids, w, tab, pool, m_ref, swiglu_limit=limit)
    if limit is not None:    # the case must actually clamp something, or it tests nothing
        assert not torch.allclose(ref, moe_experts_reference(x, ids, w, tab, pool, torch.zeros_like(m_ref)))
    out, y, misses = _run(x, ids, w, tab, pool, limit, **blocks)
    _close(out, ref)
    assert 3 + misses == int(m_ref.item())
    # each pair's output on its own (k = 1 reference: its combine is the identity)
    for j in range(k):
        _close(y[:, j], moe_experts_reference(x, ids[:, j:j + 1], w[:, j:j + 1], tab, pool,
                                              torch.zeros_like(m_ref), swiglu_limit=limit))
    slots_of = tab.long()[ids.long()]
    assert (y[slots_of < 0] == 0).all()


@pytest.mark.parametrize("limit", [None, 1.0])
def test_public_entry_point_and_miss_counter(limit):
    tri = _tri()
    g = torch.Generator().manual_seed(7)
    pool = _pool(8, 64, 32, g)
    tab = _table([3, -1, 0, 7, -1, 5])
    x, ids, w = _inputs(5, 2, 64, 6, g)
    ids[0] = torch.tensor([1, 4])          # token 0: both experts missing -> exactly zero
    ids[1] = torch.tensor([0, 2])          # token 1: both resident
    for counter_dtype in (torch.int32, torch.int64):
        m_ref = torch.full((1,), 11, dtype=counter_dtype, device=DEVICE)
        m_tri = m_ref.clone()
        ref = moe_experts_reference(x, ids, w, tab, pool, m_ref, swiglu_limit=limit)
        out = tri.moe_experts_w2_triton(x, ids, w, tab, pool, m_tri, swiglu_limit=limit)
        assert m_tri.dtype == counter_dtype and torch.equal(m_tri, m_ref) and int(m_ref.item()) > 11 + 1
        assert out.shape == ref.shape and out.dtype == ref.dtype
        _close(out, ref)
        assert (out[0] == 0).all()


def test_bf16_hidden():
    tri = _tri()
    g = torch.Generator().manual_seed(8)
    pool = _pool(8, 64, 32, g)
    tab = _table([3, -1, 0, 7, -1, 5])
    x, ids, w = _inputs(6, 2, 64, 6, g, dtype=torch.bfloat16)
    m_ref, m_tri = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ref = moe_experts_reference(x, ids, w, tab, pool, m_ref)
    out = tri.moe_experts_w2_triton(x, ids, w, tab, pool, m_tri)
    assert out.dtype == torch.bfloat16 and torch.equal(m_tri, m_ref)
    # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7 * ref.float().abs().max().item())


def test_all_missed_and_empty():
    tri = _tri()
    g = torch.Generator().manual_seed(9)
    pool = _pool(4, 32, 32, g)
    x, ids, w = _inputs(3, 2, 32, 4, g)
    m = torch.zeros(1, dtype=torch.int64)
    out = tri.moe_experts_w2_triton(x, ids, w, _table([-1, -1, -1, -1]), pool, m)
    assert int(m.item()) == 6 and torch.equal(out, torch.zeros_like(x))
    x0, ids0, w0 = _inputs(0, 2, 32, 4, g)
    out0 = tri.moe_experts_w2_triton(x0, ids0, w0, _table([0, 1, 2, 3]), pool, m)
    assert out0.shape == (0, 32) and int(m.item()) == 6


def test_bit_identical_reruns():
    g = torch.Generator().manual_seed(10)
    pool = _pool(8, 96, 64, g)
    tab = _table([6, 2, -1, 1, 4, 0])
    x, ids, w = _inputs(20, 3, 96, 6, g)
    blocks = dict(block_m=16, block_n=32, block_k=32)
    out1, y1, _ = _run(x, ids, w, tab, pool, 0.75, poison=float("nan"), **blocks)
    out2, y2, _ = _run(x, ids, w, tab, pool, 0.75, poison=float("inf"), **blocks)
    assert torch.isfinite(y1).all() and torch.equal(y1, y2) and torch.equal(out1, out2)


def test_rejects_other_pools():
    tri = _tri()
    pool = DensePool(torch.zeros(2, 64, 32), torch.zeros(2, 32, 32))
    with pytest.raises(TypeError):
        tri.moe_experts_w2_triton(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                                  _table([0]), pool, torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------- compiles for sm_90 (no GPU needed)

_AOT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moet.kernels import moe_w2_triton as m

def compile_(fn, types, const):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32))
    return len(c.asm["cubin"])

# DeepSeek-V3 routed experts: H 7168, I 2048, top-8
blocks = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
ptrs = dict(codes_ptr="*u8", scales_ptr="*u8", sorted_ptr="*i32", bslot_ptr="*i32", s_cs="i64", s_ss="i64")
for lim in (False, True):
    n = compile_(m._w2_gate_up_kernel, dict(ptrs, x_ptr="*bf16", act_ptr="*fp32", limit="fp32"),
                 dict(blocks, TOPK=8, H=7168, I=2048, HAS_LIMIT=lim))
    print("gate_up", lim, n)
n = compile_(m._w2_down_kernel, dict(ptrs, act_ptr="*fp32", tw_ptr="*fp32", y_ptr="*fp32"),
             dict(blocks, H=7168, I=2048))
print("down", n)
'''


@requires_ptxas
def test_kernels_compile_for_sm90():
    """The interpreter accepts things the compiler rejects; compile both kernels for sm_90 in a
    subprocess without TRITON_INTERPRET (an interpreted kernel cannot be compiled)."""
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _AOT], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["gate_up", "gate_up", "down"], r.stdout
    assert all(int(line.split()[-1]) > 0 for line in lines)
