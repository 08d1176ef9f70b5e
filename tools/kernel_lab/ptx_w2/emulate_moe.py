"""numpy emulation of the grouped (MoE) wgmma decode layer (gen_moe_wgmma.py), over the exact byte
layouts the kernels read, reusing emulate_next's per-warpgroup emulation of w2_gemv_wgmma.

The layer at decode (k experts per token, P = T k <= 64 pairs, pair q = t k + j):
  Q(x)  moe_quant      hidden fp32 [T, H]  -> xq e4m3 [T, H] (row-permuted "xq" layout) + xs fp32 [T]
  A     moe_gemv_wgmma (gate/up) grid (2I / 64, P): program (r, p) serves the group of pairs of
        expert ids[p] that p leads -> gu fp32 [P, 2I]; misses counted (the only atomic)
  Q(act) moe_quant with SwiGLU: act = silu(gate) * up (optional clamp) -> aq e4m3 [P, Ip] + as [P]
  B     moe_gemv_wgmma (down) grid (H / 64, P) -> y fp32 [P, H]
  C     moe_combine    out[t] = sum_j w[t, j] * y[t k + j] (j = 0..k-1, fp32 mul then add, no FMA),
        a missing pair adds +0 (its y is never read) -> bf16 [T, H]

Groups (kernels A and B, no host sync, no atomics): the pairs of one expert e in pair order
q_0 < q_1 < ... are cut into runs of 8; the program of pair p works iff p starts a run (the count of
earlier pairs of e is a multiple of 8), and then serves that run: B column n = the x row of member n
(token q // k in A, pair q in B), tokens beyond the run are zero. Every other program exits at
once. So every pair is computed exactly once, whichever slot holds its expert, and the column an
output lands in does not change its bits (a wgmma column depends only on its own B column).

Byte layouts (per slot s of the pool; gate/up N = 2I, K = H; down N = H, K = Ip = I rounded up to 256):
  codes fa8i [S, N/16, K/256, 2, 32, 16], scales sw8 [S, N/16, K/256, 32, 4], aux [S, N/64, K/256, 64]
  (emulate_next: the single-GEMV layouts, stacked per slot; a slot's fallback flags are its own).
  Down's padded K (Ip > I, e.g. GLM-4.5-Air I 1408 -> 1536): codes 0, every padded group's scale byte
  = the row's last real group's (so no chunk's scale span changes), and act columns >= I are 0.
  xq [R, K/32, 2, 16]: row r's piece (j, h) is the 16 bytes wgmma j reads as core matrix h for one
  token (the xw8 tile column): byte i = x[r, 32 (4 B + i // 4) + 8 m + 4 h + i % 4], j = 4 B + m.
"""
from __future__ import annotations

import numpy as np

import emulate_next as NX
from emulate import E4M3

GROUP_MAX = 8


def pad_k(k: int) -> int:
    return -(-k // 256) * 256


# ----------------------------------------------------------------------------- activation layout

def to_xq(x_bytes):
    """e4m3 bytes uint8 [R, K] (K % 128 == 0) -> xq uint8 [R, K/32, 2, 16]."""
    r, k = x_bytes.shape
    x = np.asarray(x_bytes, np.uint8).reshape(r, k // 128, 4, 4, 2, 4)          # r B t m h ii
    return np.ascontiguousarray(x.transpose(0, 1, 3, 4, 2, 5).reshape(r, k // 32, 2, 16))


def from_xq(xq):
    r, j = xq.shape[:2]
    x = np.asarray(xq, np.uint8).reshape(r, j // 4, 4, 2, 4, 4)                  # r B m h t ii
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3, 5).reshape(r, 32 * j))


def tile_from_rows(xq, rows):
    """The shared-memory B tile (xw8 [K/32, 2, 8, 16]) a program stages: column n = xq[rows[n]],
    columns >= len(rows) zero (cp.async with src-size 0)."""
    kj = xq.shape[1]
    t = np.zeros((kj, 2, 8, 16), np.uint8)
    for n, r in enumerate(rows):
        t[:, :, n, :] = xq[r]
    return t


# ----------------------------------------------------------------------------- quantize (kernel Q)

def quantize_rows(v):
    """float32 [R, K] -> (e4m3 bytes uint8 [R, K], scale float32 [R]): per-row amax / 448 (1 for an
    all-zero row), e4m3_rne(v / scale) saturated to +-448 -- emulate.quantize_x's semantics, which
    the kernel reproduces with div.rn.f32 and cvt.rn.satfinite.e4m3x2.f32."""
    import torch
    v = torch.from_numpy(np.ascontiguousarray(v, np.float32))
    amax = v.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (v / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy().copy(), sc.numpy().astype(np.float32)


def silu_f32(g):
    """The kernel's fp32 SiLU: g / (1 + 2^(-g log2 e)) (ex2.approx on the GPU: ~2 ulp; emulated in
    float64 and rounded, so GPU and emulator may differ in the last bits of act)."""
    g = np.asarray(g, np.float32)
    e = np.exp(-g.astype(np.float64)).astype(np.float32)
    return (g / (np.float32(1) + e)).astype(np.float32)


def swiglu_f32(gu, i, limit=None):
    """gu fp32 [P, 2I] (gate rows first) -> act fp32 [P, I]."""
    g, u = gu[:, :i].astype(np.float32), gu[:, i:2 * i].astype(np.float32)
    if limit is not None:
        lim = np.float32(limit)
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
    return (silu_f32(g) * u).astype(np.float32)


def quant_kernel(v, kp):
    """Kernel Q: rows fp32 [R, K] -> (xq uint8 [R, Kp/32, 2, 16], scale fp32 [R]); columns K..Kp-1 = 0."""
    r, k = v.shape
    b, s = quantize_rows(v)
    pad = np.zeros((r, kp), np.uint8)
    pad[:, :k] = b
    return to_xq(pad), s


# ----------------------------------------------------------------------------- grouping

def groups(ids_flat):
    """[(leader p, [member pairs])] in leader order: runs of <= 8 pairs of one expert."""
    out = []
    ids = np.asarray(ids_flat).tolist()
    for p, e in enumerate(ids):
        before = sum(1 for q in range(p) if ids[q] == e)
        if before % GROUP_MAX:
            continue
        mem = [q for q in range(p, len(ids)) if ids[q] == e][:GROUP_MAX]
        out.append((p, mem))
    return out


def groups_ballot(ids_flat):
    """The PTX's own grouping arithmetic (gen_wgmma.moe_prologue) on 64-bit masks: two warp ballots
    (lanes q and q + 32: ids[q] == ids[p]), popc of the bits below p mod 8 (exit if not 0), gs =
    min(popc(mask >> p), 8), member i = p + ctz of the i-th lowest set bit (brev + clz, clearing the
    lowest bit each step). Must equal groups() (tests)."""
    ids = [int(v) for v in ids_flat]
    n = len(ids)
    assert n <= 64
    out = []
    for p in range(n):
        msk = 0
        for q in range(n):                     # lane q (ballot 0), lane q - 32 (ballot 1)
            if ids[q] == ids[p]:
                msk |= 1 << q
        bef = msk & ((1 << p) - 1)
        if bin(bef).count("1") & 7:
            continue
        aft = msk >> p
        gs = min(bin(aft).count("1"), 8)
        mem = []
        for _ in range(8):
            ctz = 64 if aft == 0 else (aft & -aft).bit_length() - 1
            mem.append(p + ctz)
            aft &= aft - 1
        out.append((p, mem[:gs]))
    return out


def grouped_gemv(codes, sw, aux, xq, xs, ids_flat, slot_table, n, k, xdiv, kg=1, miss=None):
    """Kernels A / B: y fp32 [P, N] (rows of pairs whose expert is not resident stay NaN: never
    written, never read); miss: int [1] incremented by the missed pairs (kernel A only)."""
    p_all = len(ids_flat)
    y = np.full((p_all, n), np.nan, np.float32)
    for p, mem in groups(ids_flat):
        slot = int(slot_table[int(ids_flat[p])])
        if slot < 0:
            if miss is not None:
                miss[0] += len(mem)
            continue
        rows = [q // xdiv for q in mem]
        tile = tile_from_rows(xq, rows)
        ycol = NX.gemv_wgmma(codes[slot], sw[slot], aux[slot], tile, np.asarray(xs, np.float32)[rows],
                             n, k, len(mem), kg)
        y[mem] = ycol
    return y


def combine(y, ids, tw, slot_table):
    """Kernel C: out fp32 [T, H] before the bf16 cast (fixed j order, mul then add, no FMA;
    the first term initialises; a missing pair's term is +0)."""
    import torch
    t, kk = ids.shape
    out = None
    for j in range(kk):
        ok = np.asarray(slot_table)[ids[:, j]] >= 0
        term = np.where(ok[:, None], (np.asarray(tw, np.float32)[:, j:j + 1] * np.where(ok[:, None], y[np.arange(t) * kk + j], 0))
                        .astype(np.float32), np.float32(0)).astype(np.float32)
        out = term if out is None else (out + term).astype(np.float32)
    return torch.from_numpy(out).to(torch.bfloat16), out


def layer(hidden, ids, tw, slot_table, kpool, swiglu_limit=None, kg_a=1, kg_b=1):
    """The whole layer as the four kernels compute it. kpool: dict of numpy arrays (moe_wgmma.KPool
    fields): gu_codes, gu_sw, gu_aux, dn_codes, dn_sw, dn_aux, and H, I, Ip. Returns a dict with every
    intermediate (xq, xs, gu, aq, as, y, out_f32, out bf16 torch, miss)."""
    h, i, ip = kpool["H"], kpool["I"], kpool["Ip"]
    t, kk = ids.shape
    ids_flat = np.asarray(ids, np.int64).reshape(-1)
    xq, xs = quant_kernel(np.asarray(hidden, np.float32), h)
    miss = np.zeros(1, np.int64)
    gu = grouped_gemv(kpool["gu_codes"], kpool["gu_sw"], kpool["gu_aux"], xq, xs, ids_flat, slot_table,
                      2 * i, h, kk, kg_a, miss)
    act = swiglu_f32(gu, i, swiglu_limit)
    aq, asc = quant_kernel(act, ip)
    y = grouped_gemv(kpool["dn_codes"], kpool["dn_sw"], kpool["dn_aux"], aq, asc, ids_flat, slot_table,
                     h, ip, 1, kg_b)
    out, out32 = combine(y, np.asarray(ids), tw, slot_table)
    return {"xq": xq, "xs": xs, "gu": gu, "act": act, "aq": aq, "as": asc, "y": y, "out_f32": out32,
            "out": out, "miss": int(miss[0])}


# ----------------------------------------------------------------------------- float64 reference

def reference_e4m3(hidden, ids, tw, slot_table, pool, swiglu_limit=None, act_bytes=None, act_scale=None):
    """moet.kernels.reference.moe_experts_reference semantics in float64 with e4m3 activations at the
    same two points as the kernels: x -> quantize_rows (per token), act -> e4m3 per pair. With
    act_bytes / act_scale ([P, I] uint8, [P]) the down projection uses exactly those (the kernels'
    own act quantization: the check then tests the kernel logic only); without, the reference
    quantizes its own float64 act. pool: a moet W2Pool (v1 or nb8). Returns dict: act [P, I] float64,
    y [P, H] (router weight not applied), out [T, H] float64 (missing pairs 0), miss."""
    import torch
    from moet.kernels.reference import decode_w2
    t, kk = ids.shape
    xb, xs = quantize_rows(np.asarray(hidden, np.float32))
    xv = E4M3[xb] * xs.astype(np.float64)[:, None]
    ids_flat = np.asarray(ids).reshape(-1)
    slots = np.asarray(slot_table)[ids_flat]
    h = hidden.shape[1]
    i = pool.gate_up_codes.shape[1] // 2
    act = np.zeros((t * kk, i))
    y = np.zeros((t * kk, h))
    for q in range(t * kk):
        s = int(slots[q])
        if s < 0:
            continue
        wgu = decode_w2(pool.gate_up_codes[s], pool.gate_up_scales[s], pool.layout).double().numpy()
        gu = wgu @ xv[q // kk]
        g, u = gu[:i], gu[i:]
        if swiglu_limit is not None:
            g = np.minimum(g, swiglu_limit)
            u = np.clip(u, -swiglu_limit, swiglu_limit)
        act[q] = g / (1 + np.exp(-g)) * u
    if act_bytes is None:
        sc = np.abs(act).max(1) / 448.0
        sc = np.where(sc > 0, sc, 1.0)
        ab = torch.from_numpy(np.clip(act / sc[:, None], -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        av = E4M3[ab] * sc[:, None]
    else:
        av = E4M3[np.asarray(act_bytes)[:, :i]] * np.asarray(act_scale, np.float64)[:, None]
    for q in range(t * kk):
        s = int(slots[q])
        if s < 0:
            continue
        wdn = decode_w2(pool.down_codes[s], pool.down_scales[s], pool.layout).double().numpy()
        y[q] = wdn @ av[q]
    w = np.where(slots >= 0, np.asarray(tw, np.float64).reshape(-1), 0.0)
    out = (y * w[:, None]).reshape(t, kk, h).sum(1)
    return {"act": act, "y": y, "out": out, "miss": int((slots < 0).sum())}


# ----------------------------------------------------------------------------- host-launcher emulation

def ptx_params(ptx: str) -> list[tuple[str, str]]:
    """[(type, name)] of the .entry's parameters, in order."""
    import re
    head = ptx[ptx.index(".entry"):ptx.index(")")]
    return re.findall(r"\.param\s+\.(\w+)\s+(\w+)", head)


class FakeCu:
    """Stands in for moe_wgmma.Cu on the CPU: every cuLaunchKernel of MoeWgmma is bound by name to
    the parameter list parsed from the kernel's own PTX (types checked against the ctypes
    arguments), pointers resolved to the tensors the launcher passed (moe_wgmma._TRACE), and the
    launch run by this module's emulation with the launch's grid / block. So the launcher's argument
    order, grids, flags and strides are tested against the PTX signatures without a GPU."""

    def __init__(self):
        import gen_moe_wgmma as GM
        import moe_wgmma as MW
        self.MW = MW
        MW._TRACE = {}
        self.sig = {GM.QUANT: ptx_params(GM.gen_quant()), GM.COMBINE: ptx_params(GM.gen_combine()),
                    GM.GEMV: ptx_params(GM.gen_gemv(1, 1, 4))}
        self.launches = []

        class _Lib:
            @staticmethod
            def cuFuncSetAttribute(*a):
                return 0
        self.lib = _Lib()

    def chk(self, r, what):
        assert r == 0, what

    def load(self, cubin, name):
        return name

    def _bind(self, name, args):
        import ctypes
        sig = self.sig[name]
        assert len(sig) == len(args), (name, len(sig), len(args))
        want = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "f32": ctypes.c_float}
        out = {}
        for (ty, pn), a in zip(sig, args):
            assert isinstance(a, want[ty]), (name, pn, ty, type(a))
            out[pn] = a.value
        return out

    def _t(self, ptr):
        return self.MW._TRACE[ptr]

    def launch(self, fn, grid, block, smem, args, pdl=False):
        import torch
        p = self._bind(fn, args)
        self.launches.append((fn, tuple(grid), tuple(block), smem, pdl))
        if fn == "moe_quant":
            rows, k, kp, stride, ioff, flags = grid[0], p["p_k"], p["p_kp"], p["p_stride"], p["p_ioff"], p["p_flags"]
            assert block == (256, 1)
            src = self._t(p["p_src"])
            assert src.dtype == (torch.bfloat16 if flags & 1 else torch.float32)
            v = src.float().reshape(-1)[:rows * stride].reshape(rows, stride).numpy()
            if flags & 2:
                val = swiglu_f32(np.concatenate([v[:, :k], v[:, ioff:ioff + k]], 1), k,
                                 p["p_limit"] if flags & 4 else None)
            else:
                val = v[:, :k]
            xq, sc = quant_kernel(val, kp)
            self._t(p["p_dst"]).view(-1)[:rows * kp].copy_(torch.from_numpy(xq.reshape(-1)))
            self._t(p["p_scale"])[:rows].copy_(torch.from_numpy(sc))
        elif fn == "moe_gemv_wgmma":
            n, k, npairs, xdiv = p["p_n"], p["p_k"], p["p_np"], p["p_xdiv"]
            mg, kg = block[0] // 128, block[1]
            assert grid == (n // (64 * mg), npairs) and block[0] % 128 == 0
            codes = self._t(p["p_codes"]).numpy()
            s = codes.shape[0]
            cf = codes.reshape(s, n // 16, k // 256, 2, 32, 16)
            sw = self._t(p["p_scales"]).numpy().reshape(s, n // 16, k // 256, 32, 4)
            aux = self._t(p["p_aux"]).numpy().reshape(s, n // 64, k // 256, 64)
            xq_t = self._t(p["p_x"])
            xq = xq_t.numpy().reshape(-1, k // 32, 2, 16)
            xs = self._t(p["p_xs"]).numpy()
            ids = self._t(p["p_ids"]).numpy().reshape(-1)[:npairs]
            table = self._t(p["p_table"]).numpy()
            miss = np.zeros(1, np.int64) if p["p_miss"] else None
            y = grouped_gemv(cf, sw, aux, xq, xs, ids, table, n, k, xdiv, kg, miss)
            yt = self._t(p["p_y"]).view(-1, n)
            for q in range(npairs):
                if table[ids[q]] >= 0:
                    yt[q] = torch.from_numpy(y[q])
            if miss is not None:
                self._t(p["p_miss"]).add_(int(miss[0]))
        elif fn == "moe_combine":
            h, kk = p["p_h"], p["p_k"]
            t = grid[1]
            assert grid[0] * 4 * block[0] >= h
            ids = self._t(p["p_ids"]).numpy().reshape(t, kk)
            y = self._t(p["p_y"]).numpy().reshape(-1, h)
            out, _ = combine(y, ids, self._t(p["p_tw"]).numpy().reshape(t, kk), self._t(p["p_table"]).numpy())
            self._t(p["p_out"]).view(t, h).copy_(out)
        else:
            raise KeyError(fn)
