"""Compile the paged attention kernels for sm_90 without a GPU (Triton AOT, ptxas shipped with
triton). The interpreter runs kernels as numpy and accepts things the compiler rejects (types
of loop-carried values, dot shapes, fp8 casts); this catches those on a CPU machine.

    python -m tests.kernels.aot_compile      (TRITON_INTERPRET must be unset)
Run by test_attention_triton_compiles.py in a subprocess; prints one line per kernel.

    python -m tests.kernels.aot_compile --gqa-sass
The GQA decode loop at Qwen3-30B-A3B shapes (32 q / 4 kv heads, d 128, pages of 16, bf16 and fp8
per-tensor) for each num_stages x num_warps: registers, spills,
cp.async (LDGSTS) and plain (LDG) loads, the cp.async waits, and the order of the hot loop's
loads and MMAs. Compiled as the JIT specialises the launch: integer arguments that are
multiples of 16 at run time (the strides, the table width, pages_min) carry tt.divisibility 16
-- without it the K/V loads are scalar 2-byte LDGs and Triton's pipeliner emits no cp.async.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moet.kernels import attention_configs as ac
from moet.kernels import attention_triton as at
from moet.kernels import mla_decode_triton as md
from moet.kernels import kv_write_triton as kw
from moet.kernels import mla_prefill_triton as mp
from moet.kernels import prefill_triton as pt

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, const: dict, options: dict | None = None, div16: tuple = ()):
    if "PDL" in fn.arg_names:            # programmatic dependent launch off unless asked (test_pdl.py)
        const = {"PDL": False, **const}
    if "FUSED_MERGE" in fn.arg_names:    # the two-launch decode unless asked (aot_compile_small.py)
        const = {"FUSED_MERGE": False, **const}
    for flag in ("SWAP_AB", "F8_WORDS", "HEADS_M"):  # the decodes' default forms unless asked
        if flag in fn.arg_names:
            const = {flag: False, **const}
    if "PF_STEPS" in fn.arg_names:       # no prefetch before the PDL wait unless asked
        const = {"PF_STEPS": 0, "KV_BYTES": 2, **const}
    if "LONG_SPLITS" in fn.arg_names:    # the plain split partition (and a one-chunk merge) unless asked
        const = {"LONG_SPLITS": 0, **const}
    if "SKIP_EMPTY" in fn.arg_names:     # every program waits under PDL unless asked
        const = {"SKIP_EMPTY": False, **const}
    if "NCHUNK" in fn.arg_names:
        const = {"NCHUNK": 1, **const}
    if "HAS_SINKS" in fn.arg_names:      # no attention sinks (gpt-oss's) unless asked
        const = {"HAS_SINKS": False, **const}
        types = {"sinks_ptr": "*fp32", **types}
    if "SLACK" in fn.arg_names:          # the lazy-rescale slack the launchers pass by default
        from moet.kernels.attention_triton import RESCALE_SLACK
        const = {"SLACK": RESCALE_SLACK, **const}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    # pointers 16-byte aligned, as the JIT specialises them at run time; so are the integer
    # arguments named in div16 (the JIT marks every int that is a multiple of 16 at launch)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n in div16}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET,
                          options=options)


# GQA decode integer arguments that are multiples of 16 when Qwen3-30B-A3B / GLM-4.5 shapes run
# (strides of q and of the [blocks, 16, Hkv, 128] caches, scale strides 0 or 16-multiples, the
# table width of a max_model_len-padded table, pages_min of 256-token splits)
GQA_DIV16 = ("s_qb", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh", "ss_kb", "ss_kt", "ss_kh",
             "ss_vb", "ss_vt", "ss_vh", "s_btb", "pages_min")


def compile_gqa_decode(kv: str = "*bf16", kind: int = 0, *, g: int = 8, d: int = 128, pages: int = 4,
                       num_warps: int = 4, num_stages: int = 3, window: int = 0, div16: bool = True,
                       swap_ab: bool = False, fp8_words: bool = False, **extra):
    """_gqa_decode_split_kernel as paged_decode_gqa launches it: g query heads per kv head
    (Qwen3-30B-A3B: 8), head dim d (128), pages of 16, bf16 queries, `pages` pages per step (4: 64 tokens)."""
    const = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=triton.next_power_of_2(d), DV=d,
                 BLOCK_DV=triton.next_power_of_2(d), BLOCK_SIZE=16, MAX_SPLITS=32, WINDOW=window, SCALE_KIND=kind,
                 GROUP_K=d, GROUP_V=d, BF16_DOT=True, INTERPRET=False, PAGES=pages, OP_F16=bool(kind),
                 SWAP_AB=swap_ab, F8_WORDS=fp8_words, **at._merge_blocks(32, d), **extra)
    types = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                 lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", scale="fp32")
    return _compile(at._gqa_decode_split_kernel, types, const, dict(num_warps=num_warps, num_stages=num_stages),
                    div16=GQA_DIV16 if div16 else ())


_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([os.path.join(_BIN, "cuobjdump"), flag, path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


def sass_report(c) -> dict:
    """Registers, local memory, load/MMA counts and the hot loop's order of a compiled kernel.
    The hot loop: the longest backward branch. In it: the first load of K/V data (LDG.E.128 or
    LDGSTS) and the first MMA (HMMA/HGMMA) by position, the cp.async waits (DEPBAR.LE SB0, n)."""
    sass = _cuobjdump(c.asm["cubin"], "-sass")
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _cuobjdump(c.asm["cubin"], "-res-usage"))
    ins = [(int(m[1], 16), m[3], m[4]) for m in _INS.finditer(sass)]
    hist = collections.Counter(op for _, op, _ in ins)
    loop, span = [], -1
    for i, (addr, op, rest) in enumerate(ins):
        t = re.search(r"(0x[0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t[1], 16) < addr and addr - int(t[1], 16) > span:
            span, loop = addr - int(t[1], 16), [x for x in ins if int(t[1], 16) <= x[0] <= addr]
    ops = [op for _, op, _ in loop]
    first = lambda pred: next((i for i, o in enumerate(ops) if pred(o)), None)   # noqa: E731
    kv_load = lambda o: o.startswith(("LDG.E.128", "LDG.E.64", "LDGSTS.E.BYPASS.128", "LDGSTS.E.128",  # noqa: E731
                                       "LDGSTS.E.64", "LDGSTS.E.BYPASS.64"))
    mma = lambda o: o.startswith(("HMMA", "HGMMA"))                                  # noqa: E731
    return dict(regs=int(res[1]), stack=int(res[2]), local=int(res[4]), smem=c.metadata.shared,
                spill_ops=sum(n for o, n in hist.items() if o.startswith(("LDL", "STL"))),
                ldgsts=sum(n for o, n in hist.items() if o.startswith("LDGSTS")),   # K/V and block table
                ldg_vec=sum(n for o, n in hist.items() if o.startswith(("LDG.E.128", "LDG.E.64"))),
                ldg_scalar=sum(n for o, n in hist.items() if o in ("LDG.E.U16", "LDG.E.U8", "LDG.E.S16")),
                loop_spill_ops=sum(o.startswith(("LDL", "STL")) for o in ops),
                loop_instrs=len(ops), loop_kv_loads=sum(map(kv_load, ops)), loop_mmas=sum(map(mma, ops)),
                loop_hist=dict(collections.Counter(ops)),
                loop_first_kv_load=first(kv_load), loop_first_mma=first(mma),
                waits=[int(w, 16) for w in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass)],
                loop_waits=[int(re.search(r"0x[0-9a-f]+", r)[0], 16) for _, o, r in loop if o == "DEPBAR.LE"])


def gqa_sass_table() -> None:
    print("GQA decode, Qwen3-30B-A3B shapes (G 8, d 128, pages 16, 64-token steps), sm_90, as the JIT "
          "specialises it")
    print("kv   warps stages | regs spills(all/loop) smem | LDGSTS LDG.128 LDG.U16 | loop: instrs kv-loads "
          "mmas first-kv-load first-mma waits(DEPBAR.LE SB0,n)")
    for kv, kind in (("*bf16", 0), ("*fp8e4nv", 1)):
        for stages in (3, 4, 5, 7):
            for warps in (4, 8):
                r = sass_report(compile_gqa_decode(kv, kind, num_warps=warps, num_stages=stages))
                print(f"{kv[1:5]:4s} {warps:5d} {stages:6d} | {r['regs']:4d} "
                      f"{r['spill_ops']:4d}/{r['loop_spill_ops']:<4d} {r['smem']:6d} | {r['ldgsts']:6d} "
                      f"{r['ldg_vec']:7d} {r['ldg_scalar']:7d} | "
                      f"{r['loop_instrs']:12d} {r['loop_kv_loads']:8d} {r['loop_mmas']:4d} "
                      f"{r['loop_first_kv_load']!s:>14s} {r['loop_first_mma']!s:>9s} {r['loop_waits']}", flush=True)


def main() -> None:
    i64 = {n: "i64" for n in ("s_kb", "s_vb", "ss_kb", "ss_vb", "s_lb", "s_rb", "ss_b")}
    for kv, kind in (("*bf16", 0), ("*fp8e4nv", 1), ("*fp8e4nv", 2)):
        # GLM-4.5-like: 96 q heads / 8 kv heads, head_dim 128, pages of 16, sliding window on the bf16 one
        const = dict(G=12, BLOCK_G=16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, BLOCK_SIZE=16,
                     MAX_SPLITS=32, WINDOW=0 if kind else 4096, SCALE_KIND=kind,
                     GROUP_K=128, GROUP_V=128, BF16_DOT=True, INTERPRET=False, PAGES=4, OP_F16=bool(kind),
                     **at._merge_blocks(32, 128))
        types = dict(i64, q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                     lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", scale="fp32")
        c = _compile(at._gqa_decode_split_kernel, types, const, div16=GQA_DIV16)
        print("gqa split", kv, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        # the prefill/extend kernel, same model, the default launch: 16 query tokens x 16 (12 used)
        # heads = 256 rows per program
        rows, warps, stages = pt.prefill_launch(kind == 2, 128)
        const = dict(G=12, BLOCK_G=16, BLOCK_M=rows // 16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128,
                     BLOCK_SIZE=16, BLOCK_N=pt.PREFILL_BLOCK_N, WINDOW=0 if kind else 4096, SCALE_KIND=kind,
                     GROUP_K=128, GROUP_V=128, INTERPRET=False, BF16_DOT=True)
        types = dict(i64, q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                     cu_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", scale="fp32")
        c = _compile(pt._gqa_prefill_kernel, types, const,
                     dict(num_warps=warps, **({"num_stages": stages} if stages else {})))
        print("gqa prefill", kv, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        # fp32 queries (fp32 dots) at their own default launch fit the shared memory; at the bf16 launch's
        # 256 rows they would not (run 34: 263,168 B)
        rows32, warps32, stages32 = pt.prefill_launch(kind == 2, 128, fp32_queries=True)
        t32 = dict(types, q_ptr="*fp32", out_ptr="*fp32")
        c32 = _compile(pt._gqa_prefill_kernel, t32, dict(const, BLOCK_M=rows32 // 16, BF16_DOT=False),
                       dict(num_warps=warps32, **({"num_stages": stages32} if stages32 else {})))
        assert c32.metadata.shared <= 227 * 1024, (kv, c32.metadata.shared)
        if kind == 0:            # Qwen3-30B-A3B's 8 heads a group: 32 tokens x 8 at 256 rows, 16 at 128
            q3 = dict(const, G=8, BLOCK_G=8, WINDOW=0, BF16_DOT=False)
            div = ("s_qt", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh", "s_btb", "s_ot", "s_oh")
            wide = _compile(pt._gqa_prefill_kernel, t32, dict(q3, BLOCK_M=pt.PREFILL_ROWS // 8),
                            dict(num_warps=pt.PREFILL_NUM_WARPS, num_stages=pt.PREFILL_NUM_STAGES), div16=div)
            ok = _compile(pt._gqa_prefill_kernel, t32, dict(q3, BLOCK_M=rows32 // 8),
                          dict(num_warps=warps32, **({"num_stages": stages32} if stages32 else {})), div16=div)
            assert wide.metadata.shared > 227 * 1024 >= ok.metadata.shared, (wide.metadata.shared, ok.metadata.shared)
        print("gqa fp32-q prefill", kv, "rows", rows32, "smem", c32.metadata.shared)
        # DeepSeek-V3: R 512, P 64, MLA_BLOCK_H heads per program
        lat = "*bf16" if kind == 0 else "*fp8e4nv"
        rope = "*fp8e4nv" if kind == 1 else "*bf16"
        const = dict(H=128, BLOCK_H=md.MLA_BLOCK_H, R=512, BLOCK_R=512, P=64, BLOCK_P=64, BLOCK_N=md.MLA_BLOCK_N,
                     BLOCK_SIZE=16, MAX_SPLITS=32, SCALE_KIND=kind, GROUP=128, NG=4, BF16_DOT=True, INTERPRET=False)
        types = dict(i64, ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr=lat, rope_ptr=rope, ls_ptr="*fp32",
                     bt_ptr="*i32", lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", scale="fp32")
        # the launch options paged_decode_mla uses (warps, stages: shared memory and registers): the
        # transposed tile (devices with less shared memory, fp8 per tensor) and, for the bf16 and
        # fp8-block caches, the heads-as-M 64-token form (mla_decode_form), all wgmma
        c = _compile(md._mla_decode_split_kernel, types, const,
                     dict(num_warps=md.MLA_NUM_WARPS, num_stages=md.MLA_NUM_STAGES))
        # the H200's 227 KB of shared memory per block: over it the launch fails on the GPU only
        assert c.metadata.shared <= 227 * 1024, f"mla decode needs {c.metadata.shared} B of shared memory"
        print("mla split", lat, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]), "smem", c.metadata.shared)
        # fp32 queries (the transposed tile, fp32 dots) at their default heads per program: with
        # MLA_BLOCK_H (64) the fp32 query tile made this ~256 KB, over the H200's 227 KB
        f32 = dict(types, ql_ptr="*fp32", qr_ptr="*fp32")
        c = _compile(md._mla_decode_split_kernel, f32, dict(const, BLOCK_H=md.MLA_BLOCK_H_FP32, BF16_DOT=False),
                     dict(num_warps=md.MLA_NUM_WARPS, num_stages=md.MLA_NUM_STAGES),
                     div16=("s_qlb", "s_qlh", "s_qrb", "s_qrh", "s_lb", "s_lt", "s_btb", "pages_min"))
        assert c.metadata.shared <= 227 * 1024, f"mla decode, fp32 queries, needs {c.metadata.shared} B of shared memory"
        print("mla fp32-q split", lat, "scale kind", kind, "smem", c.metadata.shared)
        if kind != 1:
            hm = dict(const, BLOCK_N=md.MLA_HM_BLOCK_N, HEADS_M=True, SLACK=0.0)
            c = _compile(md._mla_decode_split_kernel, types, hm, dict(num_warps=md.MLA_NUM_WARPS,
                                                                      num_stages=md.MLA_NUM_STAGES),
                         div16=("s_qlb", "s_qlh", "s_qrb", "s_qrh", "s_lb", "s_lt", "s_btb", "pages_min"))
            r = sass_report(c)
            assert md.MLA_HM_MIN_SHARED >= c.metadata.shared, (c.metadata.shared, md.MLA_HM_MIN_SHARED)
            assert r["loop_hist"].get("HGMMA.64", 0) > 0 and not any(o.startswith("HMMA") for o in r["loop_hist"]), r
            print("mla heads-M", lat, "scale kind", kind, "smem", c.metadata.shared, "loop instrs", r["loop_instrs"],
                  "HGMMA", r["loop_hist"].get("HGMMA.64"), "spill ops", r["spill_ops"])
        # MLA prefill/extend, same shapes: 64 heads x 1 query token per program, the decode's launch
        const = dict(H=128, BLOCK_H=md.MLA_BLOCK_H, BLOCK_M=1, R=512, BLOCK_R=512, P=64, BLOCK_P=64,
                     BLOCK_N=md.MLA_BLOCK_N, BLOCK_SIZE=16, SCALE_KIND=kind, GROUP=128, NG=4, INTERPRET=False,
                     BF16_DOT=True)
        types = dict(i64, ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr=lat, rope_ptr=rope, ls_ptr="*fp32",
                     bt_ptr="*i32", cu_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", scale="fp32")
        c = _compile(mp._mla_prefill_kernel, types, const,
                     dict(num_warps=md.MLA_NUM_WARPS, num_stages=md.MLA_NUM_STAGES))
        assert c.metadata.shared <= 227 * 1024, f"mla prefill needs {c.metadata.shared} B of shared memory"
        print("mla prefill", lat, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        f32 = dict(types, ql_ptr="*fp32", qr_ptr="*fp32", out_ptr="*fp32")
        c = _compile(mp._mla_prefill_kernel, f32, dict(const, BLOCK_H=md.MLA_BLOCK_H_FP32, BF16_DOT=False),
                     dict(num_warps=md.MLA_NUM_WARPS, num_stages=md.MLA_NUM_STAGES),
                     div16=("s_qlt", "s_qlh", "s_qrt", "s_qrh", "s_lb", "s_lt", "s_btb", "s_ot", "s_oh"))
        assert c.metadata.shared <= 227 * 1024, f"mla prefill, fp32 queries, needs {c.metadata.shared} B of shared memory"
        print("mla fp32-q prefill", lat, "scale kind", kind, "smem", c.metadata.shared)
        if kind != 1:                    # the rows-as-M 64-key form, the default where the decode's is
            hm = dict(const, BLOCK_N=md.MLA_HM_BLOCK_N, HEADS_M=True, SLACK=0.0)
            c = _compile(mp._mla_prefill_kernel, types, hm, dict(num_warps=md.MLA_NUM_WARPS,
                                                                 num_stages=md.MLA_NUM_STAGES),
                         div16=("s_qlt", "s_qlh", "s_qrt", "s_qrh", "s_lb", "s_lt", "s_btb", "s_ot", "s_oh"))
            r = sass_report(c)
            assert md.MLA_HM_MIN_SHARED >= c.metadata.shared, (c.metadata.shared, md.MLA_HM_MIN_SHARED)
            assert r["loop_hist"].get("HGMMA.64", 0) > 0 and not any(o.startswith("HMMA") for o in r["loop_hist"]), r
            print("mla prefill heads-M", lat, "scale kind", kind, "smem", c.metadata.shared, "loop instrs",
                  r["loop_instrs"], "spill ops", r["spill_ops"])
        # KV write of one part (a GQA head row of 128 / the MLA latent of 512), bf16 source
        dst = "*bf16" if kind == 0 else "*fp8e4nv"
        const = dict(C=128, CHUNK=128, BLOCK=128, KIND=kind, OUT=1 if kind == 0 else 0)
        types = dict(src_ptr="*bf16", slot_ptr="*i64", dst_ptr=dst, scale_ptr="*fp32", s_dst_slot="i64",
                     s_sc_slot="i64")
        c = _compile(kw._store_rows_kernel, types, const)
        print("kv write", dst, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
    # the GQA decode launch table (attention_configs.json): every entry compiles at the shape and
    # with the launch it names, without spills, within the 227 KB of shared memory a block may use on
    # sm_90 (the table only names sm_90 devices so far); fp8 = per-tensor scales (scale kind 1)
    for dev, kernels in ac.load_table()["devices"].items():
        for key, entry in kernels["gqa_decode"].items():
            kv, dim, step = re.fullmatch(r"(\w+) D(\d+) T(\d+)", key).groups()
            stages = entry["num_stages"]
            for st in sorted(set(stages.values()) if isinstance(stages, dict) else {stages}):
                c = compile_gqa_decode({"bf16": "*bf16", "fp8": "*fp8e4nv"}[kv], int(kv == "fp8"), d=int(dim),
                                       pages=int(step) // 16, num_warps=entry["num_warps"], num_stages=st)
                r = sass_report(c)
                assert r["spill_ops"] == 0 and c.metadata.shared <= 227 * 1024, f"{dev} {key} s{st}: {r}"
                print("gqa table", dev, key, f"w{entry['num_warps']} s{st}", "regs", r["regs"], "smem",
                      c.metadata.shared, "cp.async", r["ldgsts"])
    # the GQA decode's optional forms at Qwen3-30B-A3B's shape, 5 stages: fp8_words (the fp8 cache read
    # as int32 words: no single-byte shared-memory loads left in the loop, fewer instructions than the
    # byte tile) and swap_ab (tokens as M: wgmma on sm_90); no spills, within shared memory
    byte = sass_report(compile_gqa_decode("*fp8e4nv", 1, num_stages=5))
    for name, c in (("fp8 words", compile_gqa_decode("*fp8e4nv", 1, num_stages=5, fp8_words=True)),
                    ("fp8 words token-head", compile_gqa_decode("*fp8e4nv", 2, num_stages=5, fp8_words=True)),
                    ("swap_ab", compile_gqa_decode("*bf16", 0, num_stages=5, swap_ab=True))):
        r = sass_report(c)
        assert r["spill_ops"] == 0 and c.metadata.shared <= 227 * 1024, f"gqa {name}: {r}"
        if name.startswith("fp8"):
            assert byte["loop_hist"].get("LDS.U8", 0) > 0 and r["loop_hist"].get("LDS.U8", 0) == 0, (byte, r)
            assert r["loop_instrs"] < byte["loop_instrs"], (byte["loop_instrs"], r["loop_instrs"])
        else:
            assert any(o.startswith("HGMMA") for o in r["loop_hist"]), r
        print("gqa form", name, "loop instrs", r["loop_instrs"], "(byte tile", byte["loop_instrs"], ") regs", r["regs"])
    # the L2 prefetch before the PDL wait (PF_STEPS): one prefetch.global.L2 a line of each K / V row
    # of the first steps (64 tokens x 2 lines x 2 bf16; x 1 x 2 fp8), every one ahead of the wait
    for name, kv, kind, words, steps in (("bf16", "*bf16", 0, False, 2), ("fp8 words", "*fp8e4nv", 1, True, 1)):
        base = compile_gqa_decode(kv, kind, num_stages=5, fp8_words=words, PDL=True)
        c = compile_gqa_decode(kv, kind, num_stages=5, fp8_words=words, PDL=True, PF_STEPS=steps,
                               KV_BYTES=4 if words else 2)
        ptx, ptx0 = c.asm["ptx"], base.asm["ptx"]
        n_pf, wait = ptx.count("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
        assert "prefetch.global.L2" not in ptx0 and n_pf > 0 and wait > ptx.rfind("prefetch.global.L2"), (name, n_pf)
        assert sass_report(c)["spill_ops"] == 0, name
        print("gqa prefetch", name, "steps", steps, "prefetch instructions", n_pf)
    # the long partition (LONG_SPLITS 64): the split kernel and the merge in two chunks of 32, no spills
    c = compile_gqa_decode("*bf16", 0, num_stages=7, LONG_SPLITS=64, PDL=True, SKIP_EMPTY=True, PF_STEPS=1)
    wait = c.asm["ptx"].find("griddepcontrol.wait")
    assert 0 < c.asm["ptx"].find("ld.global.cg") < wait, "the empty-program test reads the length before the wait"
    r = sass_report(c)
    assert r["spill_ops"] == 0, r
    cm = _compile(at._merge_splits_kernel, dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32",
                                                out_ptr="*bf16"),
                  dict(HQ=32, DV=128, BLOCK_DV=128, MAX_SPLITS=32, BLOCK_SIZE=16, LONG_SPLITS=64, NCHUNK=2,
                       **at._merge_blocks(32, 128)))
    rm = sass_report(cm)
    assert rm["spill_ops"] == 0, rm
    print("gqa long partition split regs", r["regs"], "merge regs", rm["regs"])
    # gpt-oss's attention sinks: the fused merge and the merge kernel (one chunk and the long
    # partition's chunks) add them, the prefill at the end; GQA 64 / 8 heads of 64
    oss_dims = dict(G=8, BLOCK_G=16, D=64, BLOCK_D=64, DV=64, BLOCK_DV=64)
    fused = _compile(at._gqa_decode_split_kernel,
                     dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                          lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*bf16",
                          cnt_ptr="*i32", s2_ptr="*fp32", scale="fp32"),
                     dict(oss_dims, BLOCK_SIZE=16, MAX_SPLITS=32, WINDOW=128, SCALE_KIND=0, GROUP_K=64, GROUP_V=64,
                          BF16_DOT=True, INTERPRET=False, PAGES=4, OP_F16=False, FUSED_MERGE=True, HAS_SINKS=True,
                          **at._merge_blocks(32, 64)))
    merge = [_compile(at._merge_splits_kernel, dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32",
                                                    out_ptr="*bf16"),
                      dict(HQ=64, DV=64, BLOCK_DV=64, MAX_SPLITS=32, BLOCK_SIZE=16, HAS_SINKS=True, **chunks,
                           **at._merge_blocks(32, 64)))
             for chunks in ({}, dict(LONG_SPLITS=64, NCHUNK=2))]
    rows, warps, stages = pt.prefill_launch(False, 64)
    prefill = _compile(pt._gqa_prefill_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", ks_ptr="*fp32",
                                                    vs_ptr="*fp32", bt_ptr="*i32", cu_ptr="*i32", lens_ptr="*i32",
                                                    out_ptr="*bf16", scale="fp32"),
                       dict(oss_dims, BLOCK_M=rows // 16, BLOCK_SIZE=16, BLOCK_N=pt.PREFILL_BLOCK_N, WINDOW=128, SCALE_KIND=0,
                            GROUP_K=64, GROUP_V=64, INTERPRET=False, BF16_DOT=True, HAS_SINKS=True),
                       dict(num_warps=warps, **({"num_stages": stages} if stages else {})))
    print("gqa sinks", *(len(c.asm["cubin"]) > 0 for c in (fused, *merge, prefill)))
    # the split merge, all splits loaded at once: GQA rows of 128 (one [32, 128] tile) and MLA's
    # latent rows of 512 (four column tiles), as paged_decode_gqa / _mla launch it; no spills
    for name, hq, dv in (("gqa", 96, 128), ("mla", 128, 512)):
        c = _compile(at._merge_splits_kernel, dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32",
                                                   out_ptr="*bf16"),
                     dict(HQ=hq, DV=dv, BLOCK_DV=dv, MAX_SPLITS=32, BLOCK_SIZE=16, **at._merge_blocks(32, dv)))
        r = sass_report(c)
        assert r["spill_ops"] == 0, f"merge {name}: {r}"
        print("merge", name, "cubin bytes", len(c.asm["cubin"]), "regs", r["regs"])


if __name__ == "__main__":
    gqa_sass_table() if "--gqa-sass" in sys.argv[1:] else main()
