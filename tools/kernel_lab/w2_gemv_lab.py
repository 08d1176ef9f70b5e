"""W2 grouped MoE GEMV lab: decode designs for the 2-bit expert code on an H200.

One script: builds random W2 experts on the GPU (DeepSeek-V3 shapes, 8 active of 64 resident),
checks every variant against a float64 torch reference on fresh random inputs with the output
poisoned (NaN) before each run, times every variant inside CUDA graphs (16 launches per graph,
rotating through 8 disjoint active-expert sets so L2 never holds the weights; do_bench also
flushes L2 between replays), and compares with a bf16 GEMV measured in the same run.

W2 (docs/formats.md): value = LEVEL[code] * 2**(scale-127), LEVELS (-4,-1,+1,+4) for codes 0..3,
scale = one UE8M0 byte per 32 K-elements; reference layout codes uint8 [N, K/4], element
k = 4j+i in bits 2i..2i+1 of byte j.

Variants (all read the reference layout unless said otherwise):
  nodecode     same loads (codes as int32 words + scale bytes), one FMA per word: the access
               pattern's ceiling
  fma_simple   shift/mask + where-chain decode, fp32 FMA, per-32-group scale on partial sums
  dot_tl       tensor cores (tl.dot, tokens padded to 16, weights as the A operand), codes read
               as bytes, 4 "field" tensors (the j-th 2-bit code of every byte), decode in plain
               Triton integer ops, scale folded into the bf16 exponent
  dot_prmt     as dot_tl, decode by PTX prmt.b32 (inline asm, pack=4): per group a LUT word of
               the four bf16 high bytes of -4,-1,+1,+4 times 2^(s-127), built with one IMAD from
               the scale byte, so each prmt emits two scaled bf16
  dot16_*      codes read as 16-bit units (8 weights): the asm gets (unit u, unit u+1) of one
               row in one register, exactly the (k, k+1) pair of the wgmma A fragment that
               Triton hoists the decode into, so no byte shuffling; 8 "slot" tensors, 8 dots
  dot16_prmt   reference layout: one PRMT regroups bytes, then SHF + LOP3 + PRMT per bf16 pair
  dot16_nb8    proposed layout "nb8" (to_nb8/from_nb8, bit-exact): each weight stored as
               (neg, big) bits placed so that a bf16 pair is ((w & M_p) << p) + (s<<7 | s<<23):
               one LOP3 + one IMAD per two weights, scale included
  (dot16_tl, dot16_tl_nb8: plain-Triton decode of the same layouts, CPU interpreter checks)
  num_warps >= 4 gives wgmma (Triton waits for every wgmma whose A is in registers);
  num_warps 1-2 gives mma.sync (HMMA.16816, no warpgroup waits); "_ma" = two accumulators.
  Measurements and analysis: tools/kernel_lab/RESULTS.md.
  (nb16 / MODE 2 of _dot_kernel: a 32-bit-word version of the nb8 idea; it assumes the asm
   sees 4 consecutive bytes of a row, which Triton's hoisting into the kWidth=2 dot-operand
   layout breaks, so it is kept for reference only and not run)
The activations are loaded in the matching permuted order (x_perm / x_perm8, built once per
call by the caller: in the engine this fuses into the kernel producing x).

Run (GPU):  PYTHONUNBUFFERED=1 python3 tools/kernel_lab/w2_gemv_lab.py --out $OUT
CPU check:  TRITON_INTERPRET=1 python3 tools/kernel_lab/w2_gemv_lab.py --cpu-check
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if INTERPRET:  # numpy >= 2.4: the interpreter's int() of a 1-element array raises; patch it
    import triton.runtime.interpreter as _interp
    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    _interp._patch_lang_tensor = _patch_lang_tensor

LEVELS = (-4.0, -1.0, 1.0, 4.0)
TPAD = 16  # token rows padded to 16 for tl.dot
TP = tl.constexpr(TPAD)

# ============================================================================ torch reference


def unpack_ref(codes: torch.Tensor) -> torch.Tensor:
    """[..., N, K/4] uint8 -> [..., N, K] codes 0..3 (element k = 4j+i in bits 2i of byte j)."""
    sh = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-1) >> sh) & 3).flatten(-2)


def dequant_ref(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    lv = torch.tensor(LEVELS, dtype=dtype, device=codes.device)[unpack_ref(codes).long()]
    n, k = lv.shape[-2:]
    e = (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(lv, e.to(dtype)) if dtype == torch.float64 else lv * torch.exp2(e.to(dtype))


def ref_moe_gemv(codes, scales, ids, x):
    """codes [E, N, K/4], scales [E, N, K/32], ids [A] slots, x [A, T, K] -> [A, T, N] float64."""
    outs = []
    for a in range(ids.numel()):
        w = dequant_ref(codes[int(ids[a])], scales[int(ids[a])])
        outs.append(x[a].double() @ w.t())
    return torch.stack(outs)


# ---------------------------------------------------------------- layout nb16 (dot_imad)
# Per 32-bit little-endian word q of a row: weights k = 16q + p, p = 0..15. Bit 2 slots:
# the asm produces 8 bf16 pairs ("regs"); reg r = (out tensor j = r // 2, half-pair h = r % 2)
# holds the weights of (byte m = 2h, field j) and (byte m = 2h + 1, field j): i.e. the same
# 16 weights as the reference layout's word, p = 4m + j. Each weight contributes 2 bits:
# neg (1 = negative) and big (1 = |level| 4). For reg r with shift d_r the bits sit at
#   big(elem 0) -> 8 - d, neg(elem 0) -> 15 - d, big(elem 1) -> 24 - d, neg(elem 1) -> 31 - d
# d_r = 0..6 for regs 0..6 (one LOP3 + one IMAD each); reg 7 uses the left-over bits
#   big0 -> 0, neg0 -> 1, big1 -> 16, neg1 -> 17 (shifts 8 and 14: LOP3, IMAD, LOP3, IMAD).
NB16_SHIFT = (0, 1, 2, 3, 4, 5, 6)


def nb16_bitpos():
    """[16 weights p] -> (big_pos, neg_pos) in the 32-bit word. p = 4m + j."""
    big = [0] * 16
    neg = [0] * 16
    for r in range(8):
        j, h = r // 2, r % 2
        p0, p1 = 4 * (2 * h) + j, 4 * (2 * h + 1) + j
        if r < 7:
            d = NB16_SHIFT[r]
            big[p0], neg[p0], big[p1], neg[p1] = 8 - d, 15 - d, 24 - d, 31 - d
        else:
            big[p0], neg[p0], big[p1], neg[p1] = 0, 1, 16, 17
    assert sorted(big + neg) == list(range(32))
    return big, neg


def to_nb16(codes: torch.Tensor) -> torch.Tensor:
    """Reference codes uint8 [..., N, K/4] -> nb16 uint8 [..., N, K/4] (bit-exact, invertible)."""
    c = unpack_ref(codes).to(torch.int64)                 # [..., N, K]
    *lead, n, k = c.shape
    c = c.reshape(*lead, n, k // 16, 16)
    neg = (c < 2).to(torch.int64)
    big = ((c == 0) | (c == 3)).to(torch.int64)
    bp, np_ = nb16_bitpos()
    bp = torch.tensor(bp, device=codes.device)
    np_ = torch.tensor(np_, device=codes.device)
    word = ((big << bp) | (neg << np_)).sum(-1)            # [..., N, K/16] distinct bits
    by = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1)
    return by.reshape(*lead, n, k // 4).to(torch.uint8)


def from_nb16(nb: torch.Tensor) -> torch.Tensor:
    """Inverse of to_nb16."""
    *lead, n, kq = nb.shape
    b = nb.to(torch.int64).reshape(*lead, n, kq // 4, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    bp, np_ = nb16_bitpos()
    bp = torch.tensor(bp, device=nb.device)
    np_ = torch.tensor(np_, device=nb.device)
    big = (word.unsqueeze(-1) >> bp) & 1
    neg = (word.unsqueeze(-1) >> np_) & 1
    code = (1 - neg) * 2 + (big ^ neg)                    # 0:-4 1:-1 2:+1 3:+4
    c = code.reshape(*lead, n, kq * 4).to(torch.uint8).reshape(*lead, n, kq, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def make_x_perm(x: torch.Tensor) -> torch.Tensor:
    """x [A, T, K] -> x_perm [A, 4, K/4, TP] bf16, x_perm[a, j, b, t] = x[a, t, 4b + j],
    token rows padded with zeros to TP."""
    a, t, k = x.shape
    xp = torch.zeros(a, 4, k // 4, TPAD, dtype=torch.bfloat16, device=x.device)
    xp[:, :, :, :t] = x.to(torch.bfloat16).reshape(a, t, k // 4, 4).permute(0, 3, 2, 1)
    return xp


# ---------------------------------------------------------------- layout nb8 (dot16 MODE 2)
# Codes viewed as little-endian 16-bit units, unit u of a row = weights 8u .. 8u+7 (slot p =
# weight 8u + p, natural order). Each weight is stored as two bits, neg (1 = negative) and big
# (1 = |level| 4), at: slot p < 7: big at bit 8 - p, neg at bit 15 - p; slot 7: big at bit 0,
# neg at bit 1. A 32-bit pair of units (u even, u + 1) then yields the bf16 pair of slot p of
# both units with ONE mask (LOP3) and ONE IMAD: ((w & M_p) << p) + (s << 7 | s << 23)
# (slot 7: two of each). The two bf16 of a register are (unit u, unit u + 1): exactly the
# (k, k+1) pairs of the mma A fragment, so the decode can run in the dot-operand layout.


def nb8_bitpos():
    big = [8 - p for p in range(7)] + [0]
    neg = [15 - p for p in range(7)] + [1]
    assert sorted(big + neg) == list(range(16))
    return big, neg


def to_nb8(codes: torch.Tensor) -> torch.Tensor:
    """Reference codes uint8 [..., N, K/4] -> nb8 uint8 [..., N, K/4] (bit-exact, invertible)."""
    c = unpack_ref(codes).to(torch.int32)                  # [..., N, K]
    *lead, n, k = c.shape
    c = c.reshape(*lead, n, k // 8, 8)
    neg = (c < 2).to(torch.int32)
    big = ((c == 0) | (c == 3)).to(torch.int32)
    bp, np_ = (torch.tensor(v, device=codes.device, dtype=torch.int32) for v in nb8_bitpos())
    unit = ((big << bp) | (neg << np_)).sum(-1)            # [..., N, K/8], distinct bits
    by = torch.stack([unit & 0xFF, (unit >> 8) & 0xFF], -1)
    return by.reshape(*lead, n, k // 4).to(torch.uint8)


def from_nb8(nb: torch.Tensor) -> torch.Tensor:
    *lead, n, kq = nb.shape
    b = nb.to(torch.int32).reshape(*lead, n, kq // 2, 2)
    unit = b[..., 0] | (b[..., 1] << 8)
    bp, np_ = (torch.tensor(v, device=nb.device, dtype=torch.int32) for v in nb8_bitpos())
    big = (unit.unsqueeze(-1) >> bp) & 1
    neg = (unit.unsqueeze(-1) >> np_) & 1
    code = ((1 - neg) * 2 + (big ^ neg)).to(torch.uint8).reshape(*lead, n, kq, 4)
    return code[..., 0] | (code[..., 1] << 2) | (code[..., 2] << 4) | (code[..., 3] << 6)


def make_x_perm8(x: torch.Tensor) -> torch.Tensor:
    """x [A, T, K] -> [A, 8, K/8, TP] bf16, [a, p, u, t] = x[a, t, 8u + p], zero-padded tokens."""
    a, t, k = x.shape
    xp = torch.zeros(a, 8, k // 8, TPAD, dtype=torch.bfloat16, device=x.device)
    xp[:, :, :, :t] = x.to(torch.bfloat16).reshape(a, t, k // 8, 8).permute(0, 3, 2, 1)
    return xp


# ============================================================================ PTX (+ emulation)

PRMT_ASM = """
{
.reg .b32 h0, h2, lut0, lut2, lo, t, s;
bfe.u32 h0, $9, 1, 7;
bfe.u32 h2, $9, 17, 7;
mad.lo.u32 lut0, h0, 0x01010101, 0x01008081;
mad.lo.u32 lut2, h2, 0x01010101, 0x01008081;
shl.b32 t, $9, 7;
and.b32 lo, t, 0x00800080;
shl.b32 t, $8, 4;
lop3.b32 s, t, 0x3030, 0x4040, 0xEA;
prmt.b32 $0, lo, lut0, s;
shr.u32 t, $8, 12;
lop3.b32 s, t, 0x3030, 0x4242, 0xEA;
prmt.b32 $1, lo, lut2, s;
shl.b32 t, $8, 2;
lop3.b32 s, t, 0x3030, 0x4040, 0xEA;
prmt.b32 $2, lo, lut0, s;
shr.u32 t, $8, 14;
lop3.b32 s, t, 0x3030, 0x4242, 0xEA;
prmt.b32 $3, lo, lut2, s;
lop3.b32 s, $8, 0x3030, 0x4040, 0xEA;
prmt.b32 $4, lo, lut0, s;
shr.u32 t, $8, 16;
lop3.b32 s, t, 0x3030, 0x4242, 0xEA;
prmt.b32 $5, lo, lut2, s;
shr.u32 t, $8, 2;
lop3.b32 s, t, 0x3030, 0x4040, 0xEA;
prmt.b32 $6, lo, lut0, s;
shr.u32 t, $8, 18;
lop3.b32 s, t, 0x3030, 0x4242, 0xEA;
prmt.b32 $7, lo, lut2, s;
}
"""

# nb16: reg r of the 8 outputs = ((w & M_r) << d_r) + S, S = s << 7 | s << 23 (per pair:
# elements 0,1 of a reg share the scale of byte 0 (regs of h = 0) or byte 2 (h = 1)).
# $0..$7: out_j (j = 0..3) regs (h = 0, h = 1) -> reg index r = 2j + h.


def _nb16_asm() -> str:
    lines = ["{", ".reg .b32 s0, s2, t, u;",
             "and.b32 s0, $9, 0xFF;",
             "mul.lo.u32 s0, s0, 0x00800080;",
             "bfe.u32 s2, $9, 16, 8;",
             "mul.lo.u32 s2, s2, 0x00800080;"]
    for r in range(8):
        j, h = r // 2, r % 2
        S = "s0" if h == 0 else "s2"
        if r < 7:
            d = NB16_SHIFT[r]
            m = (1 << (8 - d)) | (1 << (15 - d)) | (1 << (24 - d)) | (1 << (31 - d))
            lines.append(f"and.b32 t, $8, {m:#010x};")
            lines.append(f"mad.lo.u32 ${2 * j + h}, t, {1 << d}, {S};")
        else:
            lines.append("and.b32 t, $8, 0x00010001;")           # big bits 0, 16 -> 8, 24
            lines.append(f"mad.lo.u32 u, t, 256, {S};")
            lines.append("and.b32 t, $8, 0x00020002;")           # neg bits 1, 17 -> 15, 31
            lines.append(f"mad.lo.u32 ${2 * j + h}, t, 16384, u;")
    lines.append("}")
    return "\n".join(lines)


NB16_ASM = _nb16_asm()


# dot16 asm: input $8 = 32-bit pair of 16-bit code units (element 0 = unit u in the low half,
# element 1 = unit u + 1 in the high half; u even, so both lie in one 32-group), $9/$10 = the
# group's scale byte as int32 (both elements; $9 used). Outputs $0..$7: slot p = 0..7, each one
# register holding (unit u, unit u + 1) bf16 values.
# MODE 1, reference layout: slot p = 4m + j = byte m of the unit, field j. One PRMT regroups the
# bytes (b0 b2 b1 b3) so that each slot's two codes are 8 bits apart, then per slot
# SHF + LOP3 (selector) + PRMT (LUT of the four scaled bf16 high bytes; low byte from `lo`).
PRMT16_ASM = """
{
.reg .b32 h, lut, lo, t, u, s;
shr.u32 h, $9, 1;
mad.lo.u32 lut, h, 0x01010101, 0x01008081;
shl.b32 lo, $9, 7;
and.b32 lo, lo, 0x80;
prmt.b32 t, $8, 0, 0x3120;
shl.b32 u, t, 4;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $0, lo, lut, s;
shl.b32 u, t, 2;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $1, lo, lut, s;
lop3.b32 s, t, 0x3030, 0x4040, 0xEA;
prmt.b32 $2, lo, lut, s;
shr.u32 u, t, 2;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $3, lo, lut, s;
shr.u32 u, t, 12;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $4, lo, lut, s;
shr.u32 u, t, 14;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $5, lo, lut, s;
shr.u32 u, t, 16;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $6, lo, lut, s;
shr.u32 u, t, 18;
lop3.b32 s, u, 0x3030, 0x4040, 0xEA;
prmt.b32 $7, lo, lut, s;
}
"""


def _nb8_asm() -> str:
    lines = ["{", ".reg .b32 S, t, u;", "mul.lo.u32 S, $9, 0x00800080;"]
    for p in range(7):
        m = (1 << (8 - p)) | (1 << (15 - p)) | (1 << (24 - p)) | (1 << (31 - p))
        lines.append(f"and.b32 t, $8, {m:#010x};")
        lines.append(f"mad.lo.u32 ${p}, t, {1 << p}, S;")
    lines += ["and.b32 t, $8, 0x00010001;", "mad.lo.u32 u, t, 256, S;",
              "and.b32 t, $8, 0x00020002;", "mad.lo.u32 $7, t, 16384, u;", "}"]
    return "\n".join(lines)


NB8_ASM = _nb8_asm()


def emulate_prmt16_asm(w, s):
    M = 0xFFFFFFFF
    lut = ((s >> 1) * 0x01010101 + 0x01008081) & M
    lo = ((s << 7) & M) & 0x80
    t = _prmt(w, torch.zeros_like(w), torch.full_like(w, 0x3120))
    shifts = [("l", 4), ("l", 2), ("l", 0), ("r", 2), ("r", 12), ("r", 14), ("r", 16), ("r", 18)]
    regs = []
    for d, n in shifts:
        u = ((t << n) & M) if d == "l" else (t >> n)
        regs.append(_prmt(lo, lut, (u & 0x3030) | 0x4040))
    return regs


def emulate_nb8_asm(w, s):
    M = 0xFFFFFFFF
    S = (s * 0x00800080) & M
    regs = []
    for p in range(7):
        m = (1 << (8 - p)) | (1 << (15 - p)) | (1 << (24 - p)) | (1 << (31 - p))
        regs.append((((w & m) << p) + S) & M)
    u = (((w & 0x00010001) << 8) + S) & M
    regs.append((((w & 0x00020002) << 14) + u) & M)
    return regs


def regs16_to_values(regs):
    """8 regs (slot p) -> float64 [..., 16]: index 8e + p, e = element (unit) 0/1."""
    vals = [None] * 16
    for p, reg in enumerate(regs):
        for e in range(2):
            bits = ((reg >> (16 * e)) & 0xFFFF).to(torch.int32)
            vals[8 * e + p] = (bits << 16).to(torch.int32).view(torch.float32).double()
    return torch.stack(vals, -1)


def check_asm16_emulation(n: int = 1 << 16, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    by = torch.randint(0, 256, (n, 4), generator=g, dtype=torch.int64)
    for i in range(4):
        by[256 * i:256 * (i + 1), i] = torch.arange(256)
    s = torch.randint(1, 253, (n,), generator=g, dtype=torch.int64)
    s[:252] = torch.arange(1, 253)
    code_bytes = by.to(torch.uint8).reshape(n, 1, 4)
    codes = unpack_ref(code_bytes).reshape(n, 16)            # weight order k = 0..15
    ref = torch.tensor(LEVELS, dtype=torch.float64)[codes.long()] * torch.exp2((s - 127).double()).unsqueeze(-1)
    w = by[:, 0] | (by[:, 1] << 8) | (by[:, 2] << 16) | (by[:, 3] << 24)
    got = regs16_to_values(emulate_prmt16_asm(w, s))
    nb = to_nb8(code_bytes).reshape(n, 4).to(torch.int64)
    rt = torch.equal(from_nb8(nb.to(torch.uint8).reshape(n, 1, 4)), code_bytes)
    wn = nb[:, 0] | (nb[:, 1] << 8) | (nb[:, 2] << 16) | (nb[:, 3] << 24)
    got8 = regs16_to_values(emulate_nb8_asm(wn, s))
    return {"prmt16_bit_exact": bool(torch.equal(got, ref)), "nb8_bit_exact": bool(torch.equal(got8, ref)),
            "nb8_roundtrip": rt, "cases": n}


def _prmt(a, b, c):
    """Emulate prmt.b32 (default mode) on int64 tensors holding u32 values."""
    out = torch.zeros_like(c)
    for i in range(4):
        nib = (c >> (4 * i)) & 0xF
        idx = nib & 7
        src = torch.where(idx < 4, a, b)
        byte = (src >> (8 * (idx & 3))) & 0xFF
        byte = torch.where((nib & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def emulate_prmt_asm(w: torch.Tensor, sw: torch.Tensor) -> list[torch.Tensor]:
    """Torch transcription of PRMT_ASM: w, sw int64 u32 words -> 8 u32 output regs."""
    M = 0xFFFFFFFF
    h0 = (sw >> 1) & 0x7F
    h2 = (sw >> 17) & 0x7F
    lut0 = (h0 * 0x01010101 + 0x01008081) & M
    lut2 = (h2 * 0x01010101 + 0x01008081) & M
    lo = ((sw << 7) & M) & 0x00800080
    regs = []
    r0_shift = {0: ("l", 4), 1: ("l", 2), 2: ("l", 0), 3: ("r", 2)}
    for j in range(4):
        d, n = r0_shift[j]
        t = ((w << n) & M) if d == "l" else (w >> n)
        regs.append(_prmt(lo, lut0, (t & 0x3030) | 0x4040))
        t = w >> (12 + 2 * j)
        regs.append(_prmt(lo, lut2, (t & 0x3030) | 0x4242))
    return regs


def emulate_nb16_asm(w: torch.Tensor, sw: torch.Tensor) -> list[torch.Tensor]:
    M = 0xFFFFFFFF
    s0 = ((sw & 0xFF) * 0x00800080) & M
    s2 = (((sw >> 16) & 0xFF) * 0x00800080) & M
    regs = []
    for r in range(8):
        S = s0 if r % 2 == 0 else s2
        if r < 7:
            d = NB16_SHIFT[r]
            m = (1 << (8 - d)) | (1 << (15 - d)) | (1 << (24 - d)) | (1 << (31 - d))
            regs.append((((w & m) << d) + S) & M)
        else:
            u = (((w & 0x00010001) << 8) + S) & M
            regs.append((((w & 0x00020002) << 14) + u) & M)
    return regs


def regs_to_values(regs: list[torch.Tensor]) -> torch.Tensor:
    """8 regs (order 2j + h) -> float64 [..., 16] in weight order p = 4m + j (m = 2h + half)."""
    vals = [None] * 16
    for r, reg in enumerate(regs):
        j, h = r // 2, r % 2
        for half in range(2):
            bits = ((reg >> (16 * half)) & 0xFFFF).to(torch.int32)
            f = (bits << 16).to(torch.int32).view(torch.float32).double()
            vals[4 * (2 * h + half) + j] = f
    return torch.stack(vals, -1)


def check_asm_emulation(n: int = 1 << 16, seed: int = 0) -> dict:
    """Bit-level check of both asm decoders against the reference decode (CPU, torch)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 256, (n, 4), generator=g, dtype=torch.int64)
    # all 256 byte values appear in every byte position
    words[:256, 0] = torch.arange(256)
    words[256:512, 1] = torch.arange(256)
    words[512:768, 2] = torch.arange(256)
    words[768:1024, 3] = torch.arange(256)
    # scale: bytes 0/1 share one group, bytes 2/3 one (possibly other) group; full range 1..252
    s_lo = torch.randint(1, 253, (n,), generator=g, dtype=torch.int64)
    s_hi = torch.randint(1, 253, (n,), generator=g, dtype=torch.int64)
    s_lo[:252] = torch.arange(1, 253)
    s_hi[252:504] = torch.arange(1, 253)
    sw = s_lo | (s_lo << 8) | (s_hi << 16) | (s_hi << 24)
    code_bytes = words.to(torch.uint8)                              # [n, 4] reference bytes
    codes = unpack_ref(code_bytes.reshape(n, 1, 4)).reshape(n, 16)  # p = 4m + j
    scale_p = torch.stack([s_lo] * 8 + [s_hi] * 8, -1)             # p < 8: bytes 0,1
    ref = torch.tensor(LEVELS, dtype=torch.float64)[codes.long()] * torch.exp2((scale_p - 127).double())
    w = words[:, 0] | (words[:, 1] << 8) | (words[:, 2] << 16) | (words[:, 3] << 24)
    got_prmt = regs_to_values(emulate_prmt_asm(w, sw))
    nb = to_nb16(code_bytes.reshape(n, 1, 4)).reshape(n, 4).to(torch.int64)
    assert torch.equal(from_nb16(nb.to(torch.uint8).reshape(n, 1, 4)).reshape(n, 4), code_bytes)
    wn = nb[:, 0] | (nb[:, 1] << 8) | (nb[:, 2] << 16) | (nb[:, 3] << 24)
    got_nb = regs_to_values(emulate_nb16_asm(wn, sw))
    return {"prmt_bit_exact": bool(torch.equal(got_prmt, ref)),
            "nb16_bit_exact": bool(torch.equal(got_nb, ref)),
            "nb16_roundtrip": True, "cases": n}


# ============================================================================ kernels


@triton.jit
def _nodecode_kernel(codes_ptr, scales_ptr, x_ptr, out_ptr, ids_ptr, N, K: tl.constexpr, stride_ce, stride_se,
                     stride_xa, BN: tl.constexpr, BKW: tl.constexpr):
    """Same bytes as the decode kernels (codes as int32 words), one FMA per word."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    slot = tl.load(ids_ptr + a).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    KW = K // 16
    G = K // 32
    cw = codes_ptr.to(tl.pointer_type(tl.int32)) + slot * (stride_ce // 4) + rows[:, None] * KW
    sp = scales_ptr + slot * stride_se + rows[:, None] * G
    xp = x_ptr + a * stride_xa
    acc = tl.zeros([BN, BKW], dtype=tl.float32)
    accs = tl.zeros([BN, BKW // 2], dtype=tl.int32)
    cols = tl.arange(0, BKW)
    scol = tl.arange(0, BKW // 2)
    for kw in range(0, KW, BKW):
        w = tl.load(cw + kw + cols[None, :])
        s = tl.load(sp + kw // 2 + scol[None, :])
        xv = tl.load(xp + (kw + cols) * 16).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
        accs += s.to(tl.int32)
    res = tl.sum(acc, 1) + tl.sum(accs, 1).to(tl.float32)
    tl.store(out_ptr + a * N + rows, res)


@triton.jit
def _fma_simple_kernel(codes_ptr, scales_ptr, xp_ptr, out_ptr, ids_ptr, N, K: tl.constexpr, stride_ce, stride_se,
                       stride_xa, BN: tl.constexpr, GB: tl.constexpr):
    """T = 1. codes tile [BN, GB, 8] bytes (GB groups of 32), 4 fields, where-chain decode,
    fp32 FMA, scale per group on the partial sums. x_perm [A, 4, K/4, TP] (token 0 used)."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    slot = tl.load(ids_ptr + a).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    KB = K // 4
    G = K // 32
    cb = codes_ptr + slot * stride_ce + rows[:, None, None] * KB
    sp = scales_ptr + slot * stride_se + rows[:, None] * G
    xb = xp_ptr + a * stride_xa
    g_i = tl.arange(0, GB)
    m_i = tl.arange(0, 8)
    acc = tl.zeros([BN], dtype=tl.float32)
    for g0 in range(0, G, GB):
        bcol = (g0 + g_i)[:, None] * 8 + m_i[None, :]            # [GB, 8] byte index
        c = tl.load(cb + bcol[None, :, :])                         # [BN, GB, 8] uint8
        s = tl.load(sp + g0 + g_i[None, :]).to(tl.int32)           # [BN, GB]
        part = tl.zeros([BN, GB], dtype=tl.float32)
        for j in tl.static_range(4):
            xj = tl.load(xb + (j * KB + bcol) * TP).to(tl.float32)  # [GB, 8]
            cj = (c >> (2 * j)) & 3
            lv = tl.where(cj == 0, -4.0, tl.where(cj == 1, -1.0, tl.where(cj == 2, 1.0, 4.0)))
            part += tl.sum(lv * xj[None, :, :], 2)
        sc = (s << 23).to(tl.float32, bitcast=True)                 # 2**(s-127), s >= 1
        acc += tl.sum(part * sc, 1)
    tl.store(out_ptr + a * N + rows, acc)


@triton.jit
def _decode_tl(c, s, j: tl.constexpr):
    """Plain Triton decode of field j: bf16 bits = neg << 15 | (s + 2*big) << 7."""
    cj = ((c >> (2 * j)) & 3).to(tl.int32)
    neg = (cj < 2).to(tl.int32)
    big = ((cj == 0) | (cj == 3)).to(tl.int32)
    bits = (neg << 15) | ((s + 2 * big) << 7)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot_kernel(codes_ptr, scales_ptr, xp_ptr, out_ptr, ids_ptr, N, K: tl.constexpr, T, stride_ce, stride_se,
                stride_xa, BN: tl.constexpr, BKB: tl.constexpr, MODE: tl.constexpr,
                SCALE_BCAST: tl.constexpr, FIX_INTERP: tl.constexpr = False):
    """out[a, t, n] = sum_k W[ids[a]][n, k] * x[a, t, k] with tl.dot.
    MODE 0: plain Triton decode; 1: prmt asm (reference layout); 2: IMAD asm (nb16 layout).
    SCALE_BCAST 0: scale tile [BN, BKB] loaded with repeated addresses; 1: [BN, BKB/8] loaded
    once and broadcast by reshape."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    slot = tl.load(ids_ptr + a).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    KB = K // 4
    G = K // 32
    cb = codes_ptr + slot * stride_ce + rows[:, None] * KB
    sb = scales_ptr + slot * stride_se + rows[:, None] * G
    xb = xp_ptr + a * stride_xa
    bcols = tl.arange(0, BKB)
    tcols = tl.arange(0, TP)
    acc = tl.zeros([BN, TP], dtype=tl.float32)
    for kb in range(0, KB, BKB):
        c = tl.load(cb + kb + bcols[None, :])                              # [BN, BKB] u8
        if SCALE_BCAST:
            s8 = tl.load(sb + kb // 8 + tl.arange(0, BKB // 8)[None, :])    # [BN, BKB/8]
            s = tl.reshape(tl.broadcast_to(s8[:, :, None], (BN, BKB // 8, 8)), (BN, BKB))
        else:
            s = tl.load(sb + (kb + bcols[None, :]) // 8)                    # [BN, BKB] u8
        xrow = xb + (kb + bcols[:, None]) * TP + tcols[None, :]             # [BKB, TP]
        if MODE == 0:
            si = s.to(tl.int32)
            for j in tl.static_range(4):
                xj = tl.load(xrow + j * KB * TP)
                wj = _decode_tl(c, si, j)
                if FIX_INTERP:  # interpreter bug: its bf16 tl.dot multiplies raw bits
                    acc = tl.dot(wj.to(tl.float32), xj.to(tl.float32), acc)
                else:
                    acc = tl.dot(wj, xj, acc)
        else:
            if MODE == 1:
                w0, w1, w2, w3 = tl.inline_asm_elementwise(
                    PRMT_ASM_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [c, s],
                    dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                w0, w1, w2, w3 = tl.inline_asm_elementwise(
                    NB16_ASM_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [c, s],
                    dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            acc = tl.dot(w0, tl.load(xrow), acc)
            acc = tl.dot(w1, tl.load(xrow + KB * TP), acc)
            acc = tl.dot(w2, tl.load(xrow + 2 * KB * TP), acc)
            acc = tl.dot(w3, tl.load(xrow + 3 * KB * TP), acc)
    optr = out_ptr + a * T * N + tcols[None, :] * N + rows[:, None]
    tl.store(optr, acc, mask=tcols[None, :] < T)


@triton.jit
def _decode16_tl(w, s, p: tl.constexpr, NB8: tl.constexpr):
    """Plain Triton decode of slot p of int32-widened 16-bit units (CPU check / baseline)."""
    if NB8:
        if p < 7:
            big = (w >> (8 - p)) & 1
            neg = (w >> (15 - p)) & 1
        else:
            big = w & 1
            neg = (w >> 1) & 1
    else:
        c = (w >> (2 * p)) & 3
        neg = (c < 2).to(tl.int32)
        big = ((c == 0) | (c == 3)).to(tl.int32)
    bits = (neg << 15) | ((s + 2 * big) << 7)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot16_kernel(codes_ptr, scales_ptr, xp_ptr, out_ptr, ids_ptr, N, K: tl.constexpr, T, stride_ce,
                  stride_se, stride_xa, BN: tl.constexpr, BKH: tl.constexpr, MODE: tl.constexpr,
                  FIX_INTERP: tl.constexpr = False, MULTI_ACC: tl.constexpr = False):
    """Codes read as 16-bit units (8 weights): tile [BN, BKH] units, 8 slot tensors, 8 dots.
    MODE 0: plain decode, reference layout; 1: prmt asm, reference layout; 2: IMAD asm, nb8
    layout; 3: plain decode, nb8 layout. x_perm8 [A, 8, K/8, TP]."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    slot = tl.load(ids_ptr + a).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    KH = K // 8
    G = K // 32
    cb = codes_ptr.to(tl.pointer_type(tl.int16)) + slot * (stride_ce // 2) + rows[:, None] * KH
    sb = scales_ptr + slot * stride_se + rows[:, None] * G
    xb = xp_ptr + a * stride_xa
    hcols = tl.arange(0, BKH)
    tcols = tl.arange(0, TP)
    acc = tl.zeros([BN, TP], dtype=tl.float32)
    acc2 = tl.zeros([BN, TP], dtype=tl.float32)
    for kh in range(0, KH, BKH):
        c = tl.load(cb + kh + hcols[None, :])                                   # [BN, BKH] i16
        s4 = tl.load(sb + kh // 4 + tl.arange(0, BKH // 4)[None, :]).to(tl.int32)  # [BN, BKH/4]
        s = tl.reshape(tl.broadcast_to(s4[:, :, None], (BN, BKH // 4, 4)), (BN, BKH))
        xrow = xb + (kh + hcols[:, None]) * TP + tcols[None, :]                 # [BKH, TP]
        if (MODE == 0) or (MODE == 3):
            wi = c.to(tl.int32) & 0xFFFF
            for p in tl.static_range(8):
                wp = _decode16_tl(wi, s, p, MODE == 3)
                xj = tl.load(xrow + p * KH * TP)
                if FIX_INTERP:  # interpreter bug: its bf16 tl.dot multiplies raw bits
                    if MULTI_ACC and (p % 2 == 1):
                        acc2 = tl.dot(wp.to(tl.float32), xj.to(tl.float32), acc2)
                    else:
                        acc = tl.dot(wp.to(tl.float32), xj.to(tl.float32), acc)
                else:
                    if MULTI_ACC and (p % 2 == 1):
                        acc2 = tl.dot(wp, xj, acc2)
                    else:
                        acc = tl.dot(wp, xj, acc)
        else:
            if MODE == 1:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    PRMT16_ASM_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [c, s],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    NB8_ASM_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [c, s],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
            if MULTI_ACC:   # two independent accumulator chains (wgmma overlap experiment)
                acc = tl.dot(w0, tl.load(xrow), acc)
                acc2 = tl.dot(w1, tl.load(xrow + KH * TP), acc2)
                acc = tl.dot(w2, tl.load(xrow + 2 * KH * TP), acc)
                acc2 = tl.dot(w3, tl.load(xrow + 3 * KH * TP), acc2)
                acc = tl.dot(w4, tl.load(xrow + 4 * KH * TP), acc)
                acc2 = tl.dot(w5, tl.load(xrow + 5 * KH * TP), acc2)
                acc = tl.dot(w6, tl.load(xrow + 6 * KH * TP), acc)
                acc2 = tl.dot(w7, tl.load(xrow + 7 * KH * TP), acc2)
            else:
                acc = tl.dot(w0, tl.load(xrow), acc)
                acc = tl.dot(w1, tl.load(xrow + KH * TP), acc)
                acc = tl.dot(w2, tl.load(xrow + 2 * KH * TP), acc)
                acc = tl.dot(w3, tl.load(xrow + 3 * KH * TP), acc)
                acc = tl.dot(w4, tl.load(xrow + 4 * KH * TP), acc)
                acc = tl.dot(w5, tl.load(xrow + 5 * KH * TP), acc)
                acc = tl.dot(w6, tl.load(xrow + 6 * KH * TP), acc)
                acc = tl.dot(w7, tl.load(xrow + 7 * KH * TP), acc)
    if MULTI_ACC:
        acc += acc2
    optr = out_ptr + a * T * N + tcols[None, :] * N + rows[:, None]
    tl.store(optr, acc, mask=tcols[None, :] < T)


PRMT_ASM_C = tl.constexpr(PRMT_ASM)
PRMT16_ASM_C = tl.constexpr(PRMT16_ASM)
NB8_ASM_C = tl.constexpr(NB8_ASM)
NB16_ASM_C = tl.constexpr(NB16_ASM)

# ============================================================================ launchers


class Problem:
    """One projection: resident experts [E, N, K], A active per call, x [A, T, K]."""

    def __init__(self, name, E, N, K, A, device, gen, shared_x):
        self.name, self.E, self.N, self.K, self.A = name, E, N, K, A
        self.shared_x = shared_x
        self.codes = torch.randint(0, 256, (E, N, K // 4), dtype=torch.uint8, device=device, generator=gen)
        self.scales = torch.randint(115, 126, (E, N, K // 32), dtype=torch.uint8, device=device, generator=gen)
        self._alt = {}
        perm = torch.randperm(E, generator=gen, device=device).to(torch.int32)
        self.id_sets = [perm[i * A:(i + 1) * A].contiguous() for i in range(E // A)]
        self.bytes_active = A * N * (K // 4 + K // 32)

    def layout(self, name):
        """codes in another layout (converted per expert: bounded temporary memory)."""
        if name == "ref":
            return self.codes
        if name not in self._alt:
            conv = {"nb16": to_nb16, "nb8": to_nb8}[name]
            out = torch.empty_like(self.codes)
            for e in range(self.E):
                out[e] = conv(self.codes[e])
            self._alt[name] = out
        return self._alt[name]

    def make_x(self, T, gen, device):
        """fresh activations: x [A, T, K] bf16 (shared: one row set, stride 0 over experts)."""
        if self.shared_x:
            x1 = torch.randn(1, T, self.K, device=device, generator=gen).to(torch.bfloat16)
            return x1.expand(self.A, T, self.K)
        return torch.randn(self.A, T, self.K, device=device, generator=gen).to(torch.bfloat16)

    def prep(self, x):
        """the activation forms the kernels read (x_perm for 4 fields, x_perm8 for 8 slots)."""
        if self.shared_x:
            xp = make_x_perm(x[:1])
            xp8 = make_x_perm8(x[:1])
            return {"x": x, "xp": xp.expand(self.A, *xp.shape[1:]), "xp8": xp8.expand(self.A, *xp8.shape[1:])}
        return {"x": x, "xp": make_x_perm(x), "xp8": make_x_perm8(x)}


def launch(variant, prob: Problem, ids, inp, out, T):
    """inp = prob.prep(x); out [A, T, N] fp32."""
    kind, cfg = variant["kind"], variant["cfg"]
    N, K, A = prob.N, prob.K, prob.A
    nw, ns = cfg.get("warps", 4), cfg.get("stages", 3)
    if kind == "nodecode":
        x = inp["x"]
        _nodecode_kernel[(N // cfg["BN"], A)](prob.codes, prob.scales, x, out, ids, N, K,
                                              prob.codes.stride(0), prob.scales.stride(0), x.stride(0),
                                              BN=cfg["BN"], BKW=cfg["BKW"], num_warps=nw, num_stages=ns)
    elif kind == "fma_simple":
        xp = inp["xp"]
        _fma_simple_kernel[(N // cfg["BN"], A)](prob.codes, prob.scales, xp, out, ids, N, K,
                                                prob.codes.stride(0), prob.scales.stride(0), xp.stride(0),
                                                BN=cfg["BN"], GB=cfg["GB"], num_warps=nw, num_stages=ns)
    elif kind == "dot":
        xp = inp["xp"]
        codes = prob.layout("nb16" if cfg["MODE"] == 2 else "ref")
        _dot_kernel[(N // cfg["BN"], A)](codes, prob.scales, xp, out, ids, N, K, T,
                                         codes.stride(0), prob.scales.stride(0), xp.stride(0),
                                         BN=cfg["BN"], BKB=cfg["BKB"], MODE=cfg["MODE"],
                                         SCALE_BCAST=cfg.get("SB", 0), FIX_INTERP=INTERPRET,
                                         num_warps=nw, num_stages=ns)
    elif kind == "dot16":
        xp = inp["xp8"]
        codes = prob.layout("nb8" if cfg["MODE"] in (2, 3) else "ref")
        _dot16_kernel[(N // cfg["BN"], A)](codes, prob.scales, xp, out, ids, N, K, T,
                                           codes.stride(0), prob.scales.stride(0), xp.stride(0),
                                           BN=cfg["BN"], BKH=cfg["BKH"], MODE=cfg["MODE"],
                                           FIX_INTERP=INTERPRET, MULTI_ACC=cfg.get("MA", False),
                                           num_warps=nw, num_stages=ns)
    else:
        raise ValueError(kind)


def variant_list(interpret: bool):
    """GPU order: most informative first (a time guard may cut the tail).
    Run 1 (H200, 2026-11-29 08:22 UTC, RESULTS.md) measured the wgmma configs below (warps >= 4);
    the mma.sync configs (warps 1-2: Triton cannot use wgmma, so no per-dot warpgroup wait)
    and the nodecode_bn64 / equal-bytes bf16 baselines were added after it and are unmeasured."""
    v = [{"name": "nodecode", "kind": "nodecode", "cfg": {"BN": 32, "BKW": 64, "warps": 4}, "T": [1]},
         {"name": "nodecode_bn64", "kind": "nodecode", "cfg": {"BN": 64, "BKW": 32, "warps": 8, "stages": 4},
          "T": [1]}]
    for mode, mname in ((2, "dot16_nb8"), (1, "dot16_prmt"), (0, "dot16_tl"), (3, "dot16_tl_nb8")):
        if interpret != (mode in (0, 3)):
            continue
        if mode in (0, 3):
            cfgs = ((64, 32, 4, 4), (32, 16, 1, 4))
        elif mode == 2:   # mma.sync (warps < 4) first, then the two best wgmma configs of run 1
            cfgs = ((64, 16, 2, 4), (32, 16, 1, 5), (64, 32, 2, 4), (32, 32, 1, 4),
                    (64, 32, 4, 4), (128, 64, 8, 3))
        else:
            cfgs = ((64, 16, 2, 4), (32, 16, 1, 5), (64, 32, 4, 4))
        for bn, bkh, w, st in cfgs:
            v.append({"name": f"{mname}_bn{bn}_bkh{bkh}_w{w}_s{st}", "kind": "dot16",
                      "T": [1] if (mode in (0, 3) or w < 4) else [1, 8],
                      "cfg": {"BN": bn, "BKH": bkh, "MODE": mode, "warps": w, "stages": st}})
        if mode in (2, 3):   # two accumulator chains (shorter HMMA dependency chain for mma.sync)
            bn, bkh, w, st = (64, 16, 2, 4) if mode == 2 else (32, 16, 1, 4)
            v.append({"name": f"{mname}_bn{bn}_bkh{bkh}_w{w}_s{st}_ma", "kind": "dot16", "T": [1],
                      "cfg": {"BN": bn, "BKH": bkh, "MODE": mode, "warps": w, "stages": st, "MA": True}})
    if not interpret:
        v.append({"name": "dot_prmt_bn128_bkb64", "kind": "dot", "T": [1],
                  "cfg": {"BN": 128, "BKB": 64, "MODE": 1, "warps": 8, "stages": 3, "SB": 1}})
    v.append({"name": "dot_tl", "kind": "dot", "T": [1],
              "cfg": {"BN": 64, "BKB": 64, "MODE": 0, "warps": 4, "stages": 3, "SB": 1}})
    v.append({"name": "fma_simple", "kind": "fma_simple", "cfg": {"BN": 32, "GB": 8, "warps": 4}, "T": [1]})
    return v


# ============================================================================ checking / timing


def check_variant(variant, prob: Problem, T, gen, device, n_checks=2):
    """fresh random x per check, output poisoned with NaN; returns ||out-ref||/||ref|| list."""
    errs = []
    for i in range(n_checks):
        ids = prob.id_sets[(3 * i + 1) % len(prob.id_sets)]
        x = prob.make_x(T, gen, device)
        out = torch.full((prob.A, T, prob.N), float("nan"), dtype=torch.float32, device=device)
        launch(variant, prob, ids, prob.prep(x), out, T)
        if device == "cuda":
            torch.cuda.synchronize()
        if variant["kind"] == "nodecode":
            errs.append(0.0 if torch.isfinite(out).all() else float("nan"))
            continue
        if not torch.isfinite(out).all():
            errs.append(float("inf"))
            continue
        ref = ref_moe_gemv(prob.codes, prob.scales, ids, x.float())
        errs.append(float((out.double() - ref).norm() / ref.norm()))
    return errs


def bench(fn_for_set, nsets, device, R=16, reps=2):
    """CUDA graph of R launches rotating through the expert sets; median ms per launch."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for r in range(3):
            fn_for_set(r % nsets)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(R):
            fn_for_set(r % nsets)
    torch.cuda.synchronize()
    res = []
    for _ in range(reps):
        ms = triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median")
        res.append(ms / R)
    return res


def bf16_gemv_bandwidth(device, N=32768, K=7168, nbuf=3):
    ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(nbuf)]
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    outs = [torch.empty(1, N, device=device, dtype=torch.bfloat16) for _ in range(nbuf)]

    def fn(i):
        torch.matmul(x, ws[i].t(), out=outs[i])
    # correctness of the baseline itself (cheap)
    fn(0)
    ref = (x.double() @ ws[0].double().t())
    rel = float((outs[0].double() - ref).norm() / ref.norm())
    ms = bench(fn, nbuf, device, R=16 if nbuf >= 8 else 6)
    nbytes = N * K * 2
    del ws
    return {"N": N, "K": K, "ms": ms, "GBps": [nbytes / m / 1e6 for m in ms], "relerr": rel}


def cpu_check():
    """Interpreter run at tiny shapes + bit-level emulation of the asm decoders."""
    print("asm emulation:", check_asm_emulation(), check_asm16_emulation(), flush=True)
    gen = torch.Generator().manual_seed(1)
    device = "cpu"
    results = {}
    for shared in (True, False):
        prob = Problem("tiny_shared" if shared else "tiny", E=4, N=128, K=512, A=2, device=device,
                       gen=gen, shared_x=shared)
        for v in variant_list(interpret=True):
            for T in ([1, 3] if v["kind"] in ("dot", "dot16") else [1]):
                try:
                    errs = check_variant(v, prob, T, gen, device, n_checks=1)
                    results[f"{prob.name}/{v['name']}/T{T}"] = errs
                    print(prob.name, v["name"], "T", T, "relerr", errs, flush=True)
                except Exception as exc:  # keep going
                    traceback.print_exc()
                    results[f"{prob.name}/{v['name']}/T{T}"] = repr(exc)
    # nb16 layout round trip at a real row length
    c = torch.randint(0, 256, (8, 7168 // 4), dtype=torch.uint8, generator=gen)
    assert torch.equal(from_nb16(to_nb16(c)), c)
    assert torch.equal(from_nb8(to_nb8(c)), c)
    print("nb16 / nb8 round trips ok", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma list of variant-name prefixes")
    ap.add_argument("--resident", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=290.0, help="stop starting variants after this")
    args = ap.parse_args()
    if args.cpu_check or not torch.cuda.is_available():
        res = cpu_check()
        bad = [k for k, v in res.items() if isinstance(v, str) or any(not (e < 1e-4) for e in v)
               if "nodecode" not in k]
        print("CPU CHECK", "FAILED: " + ", ".join(bad) if bad else "OK")
        return
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "triton": triton.__version__, "asm_emulation": [check_asm_emulation(1 << 14), check_asm16_emulation(1 << 14)]}
    outpath = os.path.join(args.out, "w2_gemv_lab.json")

    def dump():
        with open(outpath, "w") as f:
            json.dump(report, f, indent=1)

    print(report, flush=True)
    base = bf16_gemv_bandwidth(device)
    base2 = bf16_gemv_bandwidth(device, N=57344, K=2048, nbuf=4)
    # same bytes as the W2 problems (66 MB / 33 MB per call): what a ~20 us / ~10 us bf16 GEMV
    # reaches, launch and tail effects included
    eq13 = bf16_gemv_bandwidth(device, N=4608, K=7168, nbuf=16)
    eq2 = bf16_gemv_bandwidth(device, N=8064, K=2048, nbuf=16)
    report["bf16_gemv"] = [base, base2]
    report["bf16_gemv_equal_bytes"] = {"w13": eq13, "w2": eq2}
    print(f"bf16 GEMV at equal bytes: N4608 K7168 (66 MB) {eq13['GBps']} GB/s; "
          f"N8064 K2048 (33 MB) {eq2['GBps']} GB/s", flush=True)
    bf16_bw = max(base["GBps"])
    print(f"bf16 GEMV N32768 K7168: {base['GBps']} GB/s (rel {base['relerr']:.1e}); "
          f"N57344 K2048: {base2['GBps']} GB/s", flush=True)
    dump()
    gen = torch.Generator(device=device).manual_seed(0)
    probs = [Problem("w13", args.resident, 4096, 7168, 8, device, gen, shared_x=True),
             Problem("w2", args.resident, 7168, 2048, 8, device, gen, shared_x=False)]
    report["variants"] = {}
    only = [s for s in args.only.split(",") if s]
    for v in variant_list(interpret=False):
        if only and not any(v["name"].startswith(o) for o in only):
            continue
        if time.time() - t0 > args.budget_s:
            print(f"time guard: skipping {v['name']}", flush=True)
            report.setdefault("skipped", []).append(v["name"])
            continue
        for prob in probs:
            for T in v["T"]:
                key = f"{prob.name}/{v['name']}/T{T}"
                rec = {"variant": v["name"], "cfg": v["cfg"], "shape": prob.name, "N": prob.N,
                       "K": prob.K, "T": T}
                try:
                    rec["relerr"] = check_variant(v, prob, T, gen, device)
                    ok = all(e < 1e-4 for e in rec["relerr"]) or v["kind"] == "nodecode"
                    rec["ok"] = ok
                    inp = prob.prep(prob.make_x(T, gen, device))
                    out = torch.empty(prob.A, T, prob.N, device=device, dtype=torch.float32)

                    def fn(i, v=v, prob=prob, inp=inp, out=out, T=T):
                        launch(v, prob, prob.id_sets[i], inp, out, T)
                    ms = bench(fn, len(prob.id_sets), device)
                    rec["us"] = [m * 1e3 for m in ms]
                    rec["GBps"] = [prob.bytes_active / m / 1e6 for m in ms]
                    rec["pct_bf16"] = [100 * g / bf16_bw for g in rec["GBps"]]
                    same = max((base if prob.name == "w13" else base2)["GBps"])
                    rec["pct_bf16_same_shape"] = [100 * g / same for g in rec["GBps"]]
                    eqb = max((eq13 if prob.name == "w13" else eq2)["GBps"])
                    rec["pct_bf16_equal_bytes"] = [100 * g / eqb for g in rec["GBps"]]
                    print(f"{key:40s} rel {max(rec['relerr']):.2e} ok={ok} us {min(rec['us']):7.2f} "
                          f"GB/s {max(rec['GBps']):7.0f} ({max(rec['pct_bf16']):5.1f}% of bf16)  "
                          f"[t={time.time() - t0:.0f}s]", flush=True)
                except Exception as exc:
                    rec["error"] = repr(exc)[:2000]
                    print(f"{key:40s} FAILED {repr(exc)[:300]}", flush=True)
                    traceback.print_exc()
                report["variants"][key] = rec
                dump()
    # table
    print("\n=== W2 grouped GEMV, 8 active experts,", report["device"], report["date"], "===")
    print(f"bf16 GEMV reference: {bf16_bw:.0f} GB/s (N32768 K7168), "
          f"{max(base2['GBps']):.0f} GB/s (N57344 K2048)")
    print(f"{'shape/variant/T':46s} {'relerr':>8s} {'us':>8s} {'GB/s':>7s} {'%bf16':>6s} {'%same':>6s} {'%eqB':>6s}")
    for key, rec in report["variants"].items():
        if "us" in rec:
            print(f"{key:46s} {max(rec['relerr']):8.1e} {min(rec['us']):8.2f} {max(rec['GBps']):7.0f} "
                  f"{max(rec['pct_bf16']):6.1f} {max(rec['pct_bf16_same_shape']):6.1f} "
                  f"{max(rec['pct_bf16_equal_bytes']):6.1f}"
                  + ("" if rec.get("ok") else "  WRONG"))
        else:
            print(f"{key:46s} error: {rec.get('error', '')[:60]}")
    dump()


if __name__ == "__main__":
    main()
