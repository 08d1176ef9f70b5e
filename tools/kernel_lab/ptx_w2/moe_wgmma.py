"""Host side of the grouped wgmma MoE decode layer (gen_moe_wgmma.py): pool conversion from moet's
W2Pool (v1 / nb8) to the kernels' byte layouts, a libcuda loader (ctypes, as run_gpu.py) and
`moe_experts_wgmma(...)`, the whole layer on torch's current stream.

  kp = convert_pool(pool)                        # once, at load time (bit-exact, tested on CPU)
  layer = MoeWgmma(kp)                           # assembles the PTX (triton's ptxas), loads the cubins
  out = layer(hidden, topk_ids, topk_weights, slot_table, miss_counter, swiglu_limit=None)

CUDA-graph capturable: no host syncs, grids fixed for a given (T, k), every buffer allocated per
call from torch's allocator (inside a capture: the graph's private pool) or passed in `ws`.
**Activations are quantized to e4m3** (per token for x, per pair for the SwiGLU output): an
approximation, so the production path may take this kernel only behind a named option, after
`moet probe` has measured the quality. Limit: T * k <= 64 pairs (decode; an expert picked by more
than 8 pairs is served in runs of 8).
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import emulate_next as NX  # noqa: E402

MAX_PAIRS = 64


def pad_k(k: int) -> int:
    return -(-k // 256) * 256


@dataclass
class KPool:
    """The kernels' pool (uint8 tensors, leading dim = slot, same slots as the W2Pool):
    gate/up N = 2I, K = H; down N = H, K = Ip (I rounded up to 256)."""
    gu_codes: torch.Tensor      # [S, 2I/16, H/256, 2, 32, 16]  fa8i
    gu_sw: torch.Tensor         # [S, 2I/16, H/256, 32, 4]      sw8
    gu_aux: torch.Tensor        # [S, 2I/64, H/256, 64]         per-chunk refs, all 0 = fallback
    dn_codes: torch.Tensor      # [S, H/16, Ip/256, 2, 32, 16]
    dn_sw: torch.Tensor         # [S, H/16, Ip/256, 32, 4]
    dn_aux: torch.Tensor        # [S, H/64, Ip/256, 64]
    H: int
    I: int
    Ip: int

    @property
    def num_slots(self) -> int:
        return self.gu_codes.shape[0]

    def numpy(self) -> dict:
        d = {k: getattr(self, k).cpu().numpy() for k in ("gu_codes", "gu_sw", "gu_aux", "dn_codes", "dn_sw", "dn_aux")}
        d.update(H=self.H, I=self.I, Ip=self.Ip)
        return d

    def nbytes_per_expert(self) -> int:
        """code + scale bytes of one expert (what the layer must stream; aux adds 1/256 per weight)."""
        return (2 * self.I * self.H + self.H * self.I) * 9 // 32


def _v1(codes: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "v1":
        return codes
    if layout == "nb8":
        from moet.formats import w2
        return w2.from_nb8(codes)
    raise ValueError(f"unknown W2 pool layout {layout!r}")


def pad_down(codes_v1: torch.Tensor, scales: torch.Tensor, ip: int):
    """down codes [H, I/4] / scales [H, I/32] -> K padded to Ip: codes 0 (their activations are 0),
    every padded group's scale byte = the row's last real group's (no chunk's span changes, so no
    padded chunk leaves the fast path because of the padding)."""
    h, iq = codes_v1.shape
    i = iq * 4
    if ip == i:
        return codes_v1, scales
    c = torch.zeros((h, ip // 4), dtype=torch.uint8, device=codes_v1.device)
    c[:, :iq] = codes_v1
    s = scales[:, -1:].expand(h, ip // 32).clone()
    s[:, :i // 32] = scales
    return c, s


def convert_matrix(codes_v1: torch.Tensor, scales: torch.Tensor):
    """one slot's [N, K/4] v1 codes + [N, K/32] scales -> (fa8i, sw8, aux) (emulate_next torch paths)."""
    return NX.to_fa8i_codes_torch(codes_v1), NX.to_sw8_torch(scales), NX.to_aux_torch(scales)


def convert_pool(pool, device=None) -> KPool:
    """moet W2Pool (layout v1 or nb8) -> KPool, slot by slot (bit-exact; inverse: unconvert_slot)."""
    dev = device or pool.gate_up_codes.device
    s, two_i, hq = pool.gate_up_codes.shape
    h, i = hq * 4, two_i // 2
    ip = pad_k(i)
    if h % 256 or two_i % 64 or h % 64 or i % 32:
        raise ValueError(f"wgmma MoE layouts need H % 256 == 0, 2I % 64 == 0, I % 32 == 0; got H={h} I={i}")
    out = {k: [] for k in ("gu_codes", "gu_sw", "gu_aux", "dn_codes", "dn_sw", "dn_aux")}
    for slot in range(s):
        gc = _v1(pool.gate_up_codes[slot].to(dev), pool.layout)
        a = convert_matrix(gc, pool.gate_up_scales[slot].to(dev))
        dc, ds = pad_down(_v1(pool.down_codes[slot].to(dev), pool.layout), pool.down_scales[slot].to(dev), ip)
        b = convert_matrix(dc, ds)
        for key, v in zip(("gu_codes", "gu_sw", "gu_aux", "dn_codes", "dn_sw", "dn_aux"), a + b):
            out[key].append(v)
    return KPool(**{k: torch.stack(v).contiguous() for k, v in out.items()}, H=h, I=i, Ip=ip)


def unconvert_slot(kp: KPool, slot: int):
    """-> (gate_up codes v1 [2I, H/4], gate_up scales, down codes v1 [H, I/4], down scales) (numpy)."""
    h, i, ip = kp.H, kp.I, kp.Ip
    gc = NX.from_fa8i_codes(kp.gu_codes[slot].cpu().numpy(), 2 * i, h)
    gs = NX.from_sw8(kp.gu_sw[slot].cpu().numpy(), 2 * i, h)
    dc = NX.from_fa8i_codes(kp.dn_codes[slot].cpu().numpy(), h, ip)[:, :i // 4]
    ds = NX.from_sw8(kp.dn_sw[slot].cpu().numpy(), h, ip)[:, :i // 32]
    return gc, gs, dc, ds


# ----------------------------------------------------------------------------- loader + launcher

class Cu:
    """libcuda through ctypes (the same as run_gpu.Cu; modules kept alive)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._bufs = []

    def chk(self, r, what):
        if r != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(r, ctypes.byref(s))
            raise RuntimeError(f"{what} failed: CUresult {r} {s.value.decode() if s.value else ''}")

    def load(self, cubin: bytes, name: str):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        buf = ctypes.create_string_buffer(cubin)
        self._bufs.append(buf)
        self.chk(self.lib.cuModuleLoadData(ctypes.byref(mod), buf), "cuModuleLoadData")
        self.chk(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return fn

    def launch(self, fn, grid, block, smem, args, pdl: bool = False):
        """pdl: programmatic dependent launch (cuLaunchKernelEx with PROGRAMMATIC_STREAM_SERIALIZATION):
        the kernel may start once the previous kernel in the stream has triggered
        (griddepcontrol.launch_dependents) and reads that kernel's outputs only after
        griddepcontrol.wait (gen_moe_wgmma: every read of produced data is behind it)."""
        arr = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not pdl:
            self.chk(self.lib.cuLaunchKernel(fn, grid[0], grid[1], 1, block[0], block[1], 1, smem, stream, arr, None),
                     "cuLaunchKernel")
            return
        attr = _LaunchAttr()
        attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1                                  # programmaticStreamSerializationAllowed (int)
        cfg = _LaunchConfig(grid[0], grid[1], 1, block[0], block[1], 1, smem, stream, ctypes.pointer(attr), 1)
        self.chk(self.lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, arr, None), "cuLaunchKernelEx")


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # cuda.h (triton's bundled include)


class _LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute: id (enum), 4 bytes pad, value (64-byte union, 8-byte aligned)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CUBINS: dict = {}


def _cubin(key: str, gen) -> bytes:
    """ptxas once per kernel / config per process (a module load per layer object is cheap)."""
    if key not in _CUBINS:
        import gen_ptx
        _CUBINS[key] = gen_ptx.assemble(gen())[0]
    return _CUBINS[key]
Q_BF16, Q_SWIGLU, Q_LIMIT = 1, 2, 4


_TRACE: dict | None = None     # emulate_moe.FakeCu: data_ptr -> tensor of every pointer argument


def _u64(t):
    if _TRACE is not None:
        _TRACE[t.data_ptr()] = t
    return ctypes.c_uint64(t.data_ptr())


class MoeWgmma:
    """The layer's kernels, assembled and loaded once. cfg_a / cfg_b: gemv configs 'MGxKGsST' for
    gate/up and down (gen_wgmma; defaults = the single-GEMV lab's best on the H200 for
    K 7168 (1x2s4, 92%) and K 2048 (1x1s4, 78%)). desc: the B descriptor variant (the device
    probe of 2026-11-29 confirmed lbo128_sbo256). pdl: launch every kernel but the first with
    programmatic dependent launch (the gemvs then stream their first weight chunks while the kernel
    before them finishes); same bits either way."""

    def __init__(self, kp: KPool, cfg_a: str = "1x2s4", cfg_b: str = "1x1s4", desc: str = "lbo128_sbo256",
                 cu: Cu | None = None, pdl: bool = False):
        import gen_moe_wgmma as GM
        import gen_wgmma as GW
        self.kp, self.cu, self.pdl = kp, cu or Cu(), pdl
        self.desc = GW.desc_template(*GW.DESC_VARIANTS[desc])
        self.cfg = {}
        for tag, cfg in (("a", cfg_a), ("b", cfg_b)):
            mg, kg, st = GM.parse_config(cfg)
            fn = self.cu.load(_cubin(cfg, lambda: GM.gen_gemv(mg, kg, st)), GM.GEMV)
            k = kp.H if tag == "a" else kp.Ip
            n = 2 * kp.I if tag == "a" else kp.H
            if n % (64 * mg):
                raise ValueError(f"config {cfg}: N {n} is not a multiple of {64 * mg}")
            smem = GW.smem_bytes(k, mg, kg, st)
            self.cu.chk(self.cu.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       ctypes.c_int(smem)), "cuFuncSetAttribute")
            self.cfg[tag] = (fn, mg, kg, smem, n, k)
        self.fq = self.cu.load(_cubin("quant", GM.gen_quant), GM.QUANT)
        self.fc = self.cu.load(_cubin("combine", GM.gen_combine), GM.COMBINE)
        self.QT, self.CT = GM.QUANT_THREADS, GM.COMBINE_THREADS

    def quant(self, src, dst, scale, rows, k, kp, stride, ioff=0, flags=0, limit=0.0, pdl=False):
        c = ctypes
        self.cu.launch(self.fq, (rows, 1), (self.QT, 1), 0,
                       [_u64(src), _u64(dst), _u64(scale), c.c_uint32(k), c.c_uint32(kp), c.c_uint32(stride),
                        c.c_uint32(ioff), c.c_uint32(flags), c.c_float(limit)], pdl=pdl)

    def gemv(self, tag, codes, sw, aux, x, xs, y, p, ids, table, miss, xdiv):
        fn, mg, kg, smem, n, k = self.cfg[tag]
        c = ctypes
        self.cu.launch(fn, (n // (64 * mg), p), (128 * mg, kg), smem,
                       [_u64(codes), _u64(sw), _u64(aux), _u64(x), _u64(xs), _u64(y), c.c_uint32(n), c.c_uint32(k),
                        c.c_uint32(p), c.c_uint64(self.desc), _u64(ids), _u64(table),
                        _u64(miss) if miss is not None else c.c_uint64(0), c.c_uint32(xdiv)], pdl=self.pdl)

    def __call__(self, hidden, topk_ids, topk_weights, slot_table, miss_counter, swiglu_limit=None, ws=None,
                 stages: int = 5):
        """hidden bf16 (or fp32) [T, H]; topk_ids [T, k] int; topk_weights [T, k] float; slot_table
        int32 [E]; miss_counter int32 [1] (incremented by the missed pairs). Returns bf16 [T, H].
        ws: optional dict of preallocated buffers (the `workspace` shapes); NaN-poisoned by tests.
        stages < 5: only the first `stages` launches (quantize x, gate/up, SwiGLU + quantize, down,
        combine) and None back: the timing breakdown of run_moe_wgmma.py --breakdown."""
        kp = self.kp
        t, kk = topk_ids.shape
        p = t * kk
        h, i, ip = kp.H, kp.I, kp.Ip
        dev = hidden.device
        if p > MAX_PAIRS or t == 0:
            raise ValueError(f"moe_experts_wgmma serves decode: 1 <= T * k <= {MAX_PAIRS}, got T={t} k={kk}")
        if miss_counter.dtype != torch.int32:
            raise TypeError("miss_counter must be int32 [1] (red.global.add.u32)")
        if hidden.dtype not in (torch.bfloat16, torch.float32) or hidden.shape[1] != h:
            raise ValueError(f"hidden must be bf16 / fp32 [T, {h}], got {hidden.dtype} {tuple(hidden.shape)}")
        hidden = hidden.contiguous()
        ids = topk_ids.to(torch.int32).reshape(-1).contiguous()
        tw = topk_weights.to(torch.float32).reshape(-1).contiguous()
        table = slot_table.to(torch.int32).contiguous()
        w = ws or workspace(t, kk, h, i, ip, dev)
        self.quant(hidden, w["xq"], w["xs"], t, h, h, h, 0, Q_BF16 if hidden.dtype == torch.bfloat16 else 0)
        if stages == 1:
            return None
        self.gemv("a", kp.gu_codes, kp.gu_sw, kp.gu_aux, w["xq"], w["xs"], w["gu"], p, ids, table, miss_counter, kk)
        if stages == 2:
            return None
        flags = Q_SWIGLU | (Q_LIMIT if swiglu_limit is not None else 0)
        self.quant(w["gu"], w["aq"], w["as"], p, i, ip, 2 * i, i, flags,
                   float(swiglu_limit) if swiglu_limit is not None else 0.0, pdl=self.pdl)
        if stages == 3:
            return None
        self.gemv("b", kp.dn_codes, kp.dn_sw, kp.dn_aux, w["aq"], w["as"], w["y"], p, ids, table, None, 1)
        if stages == 4:
            return None
        out = w["out"]
        self.cu.launch(self.fc, (-(-h // (4 * self.CT)), t), (self.CT, 1), 0,
                       [_u64(w["y"]), _u64(ids), _u64(table), _u64(tw), _u64(out), ctypes.c_uint32(h),
                        ctypes.c_uint32(kk)], pdl=self.pdl)
        return out


def workspace(t, kk, h, i, ip, dev, fill=None):
    p = t * kk
    mk = (lambda shape, dt: torch.empty(shape, dtype=dt, device=dev)) if fill is None else \
        (lambda shape, dt: torch.full(shape, fill, dtype=dt, device=dev) if dt.is_floating_point else
         torch.full(shape, 0x7F, dtype=dt, device=dev))
    return {"xq": mk((t, h), torch.uint8), "xs": mk((t,), torch.float32), "gu": mk((p, 2 * i), torch.float32),
            "aq": mk((p, ip), torch.uint8), "as": mk((p,), torch.float32), "y": mk((p, h), torch.float32),
            "out": mk((t, h), torch.bfloat16)}


_LAYERS: dict = {}


def moe_experts_wgmma(hidden, topk_ids, topk_weights, slot_table, kpool: KPool, miss_counter, *,
                      swiglu_limit=None, ws=None):
    """moe_experts_reference's signature with the kernels' pool (KPool, from convert_pool) and e4m3
    activations. The first call per pool assembles and loads the kernels (not capturable: call once
    before capturing a graph)."""
    key = id(kpool)
    if key not in _LAYERS:
        _LAYERS[key] = MoeWgmma(kpool)
    return _LAYERS[key](hidden, topk_ids, topk_weights, slot_table, miss_counter, swiglu_limit, ws)
