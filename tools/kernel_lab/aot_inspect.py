"""Compile the lab's kernels for sm_90 without a GPU (Triton AOT) and count SASS instructions.

  python3 tools/kernel_lab/aot_inspect.py [variant-prefix ...]

Prints per variant: registers, spills (local-memory ops), and an opcode histogram of the
whole kernel plus the instructions per weight of the main loop body (the largest basic block
between a backward branch target and its branch, approximated as the hottest loop: the block
that contains the HGMMA/FFMA work). Uses the cuobjdump/nvdisasm that ship with Triton.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import w2_gemv_lab as lab  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_variant(v, K):
    kind, cfg = v["kind"], v["cfg"]
    if kind == "nodecode":
        fn = lab._nodecode_kernel
        sig = {"codes_ptr": "*u8", "scales_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*fp32",
               "ids_ptr": "*i32", "N": "i32", "K": "constexpr", "stride_ce": "i64",
               "stride_se": "i64", "stride_xa": "i32", "BN": "constexpr", "BKW": "constexpr"}
        const = {"K": K, "BN": cfg["BN"], "BKW": cfg["BKW"]}
    elif kind == "fma_simple":
        fn = lab._fma_simple_kernel
        sig = {"codes_ptr": "*u8", "scales_ptr": "*u8", "xp_ptr": "*bf16", "out_ptr": "*fp32",
               "ids_ptr": "*i32", "N": "i32", "K": "constexpr", "stride_ce": "i64",
               "stride_se": "i64", "stride_xa": "i32", "BN": "constexpr", "GB": "constexpr"}
        const = {"K": K, "BN": cfg["BN"], "GB": cfg["GB"]}
    elif kind == "dot16":
        fn = lab._dot16_kernel
        sig = {"codes_ptr": "*u8", "scales_ptr": "*u8", "xp_ptr": "*bf16", "out_ptr": "*fp32",
               "ids_ptr": "*i32", "N": "i32", "K": "constexpr", "T": "i32", "stride_ce": "i64",
               "stride_se": "i64", "stride_xa": "i32", "BN": "constexpr", "BKH": "constexpr",
               "MODE": "constexpr", "FIX_INTERP": "constexpr", "MULTI_ACC": "constexpr"}
        const = {"K": K, "BN": cfg["BN"], "BKH": cfg["BKH"], "MODE": cfg["MODE"], "FIX_INTERP": False,
                 "MULTI_ACC": cfg.get("MA", False)}
    else:
        fn = lab._dot_kernel
        sig = {"codes_ptr": "*u8", "scales_ptr": "*u8", "xp_ptr": "*bf16", "out_ptr": "*fp32",
               "ids_ptr": "*i32", "N": "i32", "K": "constexpr", "T": "i32", "stride_ce": "i64",
               "stride_se": "i64", "stride_xa": "i32", "BN": "constexpr", "BKB": "constexpr",
               "MODE": "constexpr", "SCALE_BCAST": "constexpr", "FIX_INTERP": "constexpr"}
        const = {"K": K, "BN": cfg["BN"], "BKB": cfg["BKB"], "MODE": cfg["MODE"],
                 "SCALE_BCAST": cfg.get("SB", 0), "FIX_INTERP": False}
    # mimic the JIT's runtime specialisation: pointers and these ints are multiples of 16
    div = {(i,): [["tt.divisibility", 16]] for i, (k, t) in enumerate(sig.items())
           if t.startswith("*") or k in ("N", "stride_ce", "stride_se", "stride_xa")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=div)
    opts = {"num_warps": cfg.get("warps", 4), "num_stages": cfg.get("stages", 3)}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(path)


INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def loop_stats(sass: str):
    """Find backward branches; return the opcode histogram of the largest loop body."""
    lines = []
    for ln in sass.splitlines():
        m = INS.search(ln)
        if m:
            lines.append((int(m.group(1), 16), m.group(3), ln))
    best = None
    for i, (addr, op, ln) in enumerate(lines):
        if op.startswith("BRA"):
            t = re.search(r"BRA\S*\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", ln)
            tgt = None
            if t:
                tgt = int(t.group(1), 16)
            # branches to a label (".L_x_N") are not resolved: only address targets delimit loops
            if tgt is not None and tgt < addr:
                body = [o for (a, o, _) in lines if tgt <= a <= addr]
                if best is None or len(body) > len(best):
                    best = body
    return collections.Counter(best or []), len(best or [])


def main():
    prefixes = sys.argv[1:]
    for v in lab.variant_list(interpret=False):
        if prefixes and not any(v["name"].startswith(p) for p in prefixes):
            continue
        for K in (7168, 2048):
            try:
                c = compile_variant(v, K)
            except Exception as exc:
                print(f"{v['name']} K{K}: COMPILE FAILED {repr(exc)[:500]}")
                continue
            sass = sass_of(c.asm["cubin"])
            md = c.metadata
            regs = getattr(md, "n_regs", None)
            hist_all = collections.Counter(m.group(3) for m in INS.finditer(sass))
            hist, n = loop_stats(sass)
            cfg = v["cfg"]
            if v["kind"] == "dot":
                w_per_iter = cfg["BN"] * cfg["BKB"] * 4
            elif v["kind"] == "dot16":
                w_per_iter = cfg["BN"] * cfg["BKH"] * 8
            elif v["kind"] == "nodecode":
                w_per_iter = cfg["BN"] * cfg["BKW"] * 16
            else:
                w_per_iter = cfg["BN"] * cfg["GB"] * 32
            threads = 32 * cfg.get("warps", 4)
            per_w = n * threads / w_per_iter if n else float("nan")
            lmem = sum(c for o, c in hist_all.items() if o.startswith(("LDL", "STL")))
            print(f"{v['name']:34s} K{K}: regs {regs} local-mem ops {lmem} loop {n} instr/thread "
                  f"-> {per_w:.2f} thread-instr/weight (if one iteration = {w_per_iter} weights)")
            top = ", ".join(f"{o}:{c}" for o, c in hist.most_common(14))
            print("    loop:", top)
            if os.environ.get("DUMP"):
                d = os.environ["DUMP"]
                os.makedirs(d, exist_ok=True)
                open(os.path.join(d, f"{v['name']}_K{K}.sass"), "w").write(sass)
                open(os.path.join(d, f"{v['name']}_K{K}.ttgir"), "w").write(c.asm["ttgir"])
                open(os.path.join(d, f"{v['name']}_K{K}.ptx"), "w").write(c.asm["ptx"])


if __name__ == "__main__":
    main()
