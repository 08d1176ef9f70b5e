"""The residency plan: where a checkpoint's W2 experts live for a given GPU and host budget, and
the decode speed that placement predicts from measured bandwidths (issue 7 item 6; `moet plan`).

Tiers (one W2 row per (MoE layer, expert); MTP layers are not planned: no speculative decoding):
  GPU HBM      dense stack (model dtype) + KV reserve + activation reserve + the expert slot pool
               (what is left, in rows; the engine's auto-sized cache does the same);
  host arena   pinned host slots of one pack stride each (default: half the host memory, the
               engine's default rule), counted as holding rows the GPU does not (best case: the
               arena is an LRU in front of the pack, not exclusive of the GPU cache);
  pack on disk every row at its 4 KiB stride; rows in neither cache are read from here.
Fit check (the engine's, ExpertResidency.start): the slot pool must hold at least MoE layers x
top_k x min(max_num_seqs, 4) rows; a plan that fails says which flag fixes it.

Decode prediction for one step of `batch` sequences at `context` tokens each:
  HBM time  = (dense bytes read per step + distinct experts x W2 row + batch x context x KV bytes
              per token) / HBM bandwidth. The dense bytes read are the dense stack minus the
              input embedding table (one row per token; the LM head is read whole).
  expected hit rate: each needed (layer, expert) pair independently is on the GPU with
              probability F(gpu rows per layer), in the arena with F(gpu + arena) - F(gpu), else on
              disk, where F(n) is the share of routing mass of a layer's n most popular experts:
              uniform routing (default) F(n) = n / experts, i.e. hit rate = resident fraction;
              `zipf` s > 0: expert popularity ~ 1 / rank^s and the caches hold the most popular
              rows (an ideal frequency cache); or a given `hit_rate` (the arena / disk split of the
              misses then stays uniform).
  fetch time = misses x (row / host-to-device bandwidth) + disk misses x stride / disk bandwidth.
  passes     = 1 + P(more than miss_tolerance pairs miss) (strict replay reruns the step once in
              practice: the first replay fetches everything the pass routed to), misses ~ binomial.
  step time  = passes x HBM time + fetch time; tok/s = batch / step time. By default the HBM time
              is the roofline; `kernel_efficiency` (share of the bandwidth the kernels reach) and
              `pass_overhead_ms` (launches, host work per pass) calibrate it from measured kernels.
              Prefetch overlap is not modelled; `compare()` reports measured / predicted.
Distinct experts per layer for a batch: experts x (1 - (1 - top_k / experts)^batch) (uniform).
Prefill: a long prompt's chunk routes to every expert of every layer, and with demand fetch
(store/demand.py) copies each row the GPU does not hold once, layer by layer: (rows - GPU rows) x
row / host-to-device bandwidth, plus the rows the arena lacks read from disk, is the floor of one
chunk's time (prefill_chunk_fetch_s).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from moet.store.expert_cache import min_cache_slots
from moet.store.repair_pool import STORE_POOL_SHARE

GiB = 2**30
PAGE = 4096

# Default bandwidths (GB/s = 1e9 bytes/s), measured on an H200 machine, with the words `moet plan`
# prints beside each: where the number comes from and the flag that replaces it with this machine's.
DEFAULT_BANDWIDTHS = {
    "hbm_gbps": (3670.0, "measured on an H200 (bf16 GEMV); override with --hbm-gbps"),
    "h2d_pinned_gbps": (55.0, "measured on an H200 machine (pinned copy); override with --h2d-gbps"),
    "h2d_pageable_gbps": (8.8, "measured on an H200 machine (pageable copy); override with --h2d-pageable-gbps"),
    "disk_gbps": (1.6, "measured on an H200 machine's local disk; override with --disk-gbps"),
}


@dataclass
class Bandwidths:
    hbm_gbps: float = DEFAULT_BANDWIDTHS["hbm_gbps"][0]
    h2d_pinned_gbps: float = DEFAULT_BANDWIDTHS["h2d_pinned_gbps"][0]
    h2d_pageable_gbps: float = DEFAULT_BANDWIDTHS["h2d_pageable_gbps"][0]
    disk_gbps: float = DEFAULT_BANDWIDTHS["disk_gbps"][0]
    pinned: bool = True                  # the arena is pinned on CUDA: copies run at the pinned rate
    # calibration from measured kernels (defaults: the roofline): the share of hbm_gbps the
    # decode step's kernels reach (e.g. ~0.4 for the W2 MoE layer at T = 1 on the DeepSeek-V3
    # shape, docs/perf.md), and a fixed cost per forward pass (launches, host work)
    kernel_efficiency: float = 1.0
    pass_overhead_ms: float = 0.0
    sources: dict[str, str] = field(default_factory=lambda: {k: v[1] for k, v in DEFAULT_BANDWIDTHS.items()})

    def override(self, name: str, gbps: float, source: str) -> None:
        setattr(self, name, gbps)
        self.sources[name] = source

    @property
    def h2d_gbps(self) -> float:
        return self.h2d_pinned_gbps if self.pinned else self.h2d_pageable_gbps


@dataclass
class ModelFacts:
    """What the plan needs of a model (from a checkpoint's headers, a spec, or by hand)."""
    name: str
    moe_layers: int                      # decoder MoE layers (one row per layer and expert)
    experts: int
    top_k: int
    row_bytes: int                       # one W2 (layer, expert) row as the device cache holds it
    dense_bytes: int                     # the dense stack on the GPU (model dtype)
    embedding_bytes: int = 0             # input embedding table (read one row per token); 0 if tied
    kv_bytes_per_token: int = 0          # KV cache bytes per token, every decoder attention layer
    fp4_row_bytes: int = 0               # one (layer, expert) row of the FP4 repair tier; 0: unknown

    @property
    def rows(self) -> int:
        return self.moe_layers * self.experts

    @property
    def stride(self) -> int:
        """Pack / arena bytes per row (rounded up to 4 KiB, O_DIRECT legal)."""
        return -(-self.row_bytes // PAGE) * PAGE

    @property
    def expert_bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass
class Tier:
    name: str
    rows: int                 # W2 expert rows held
    bytes: int                # bytes those rows take in this tier (device rows / arena or pack strides)
    capacity_bytes: int       # what the tier was given for experts


@dataclass
class GpuBudget:
    total_bytes: int          # the card (--gpu-memory)
    utilization: float        # share moet may use (gpu_memory_utilization)
    dense_bytes: int
    kv_reserve_bytes: int
    activation_reserve_bytes: int

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def expert_room_bytes(self) -> int:
        return self.budget_bytes - self.dense_bytes - self.kv_reserve_bytes - self.activation_reserve_bytes


@dataclass
class Fit:
    ok: bool
    all_resident: bool        # every row on the GPU: no store, no pack at run time
    min_slots: int            # MoE layers x top_k x min(max_num_seqs, 4)
    message: str              # what is wrong and the flag that fixes it ("" when ok)


@dataclass
class Prediction:
    batch: int
    context: int
    hit_model: str
    hit_rate: float           # pairs found on the GPU
    arena_share: float        # pairs found in the arena (fetched host -> device)
    disk_share: float         # pairs read from the pack
    hbm_bytes_per_step: int
    hbm_s: float
    misses_per_step: float
    fetch_bytes_per_step: float
    disk_bytes_per_step: float
    fetch_s: float
    passes_per_step: float
    step_s: float
    tok_s: float
    resident_tok_s: float     # the same step with every expert on the GPU (the HBM bound)
    pcie_bound_tok_s: float | None   # fetches alone: batch / (fetch bytes / H2D bandwidth)
    # a long prompt's prefill chunk routes to every expert of every layer; with demand fetch
    # (store/demand.py) it copies each row the GPU does not hold once, layer by layer: the floor
    # of that chunk's time from expert traffic alone (0 when every expert is resident)
    prefill_chunk_fetch_bytes: float = 0.0
    prefill_chunk_disk_bytes: float = 0.0
    prefill_chunk_fetch_s: float = 0.0


@dataclass
class Plan:
    facts: ModelFacts
    gpu: GpuBudget
    host_memory_bytes: int
    host_arena_bytes: int
    max_num_seqs: int
    miss_tolerance: int
    tiers: list[Tier]
    fit: Fit
    bandwidths: Bandwidths
    prediction: Prediction | None    # None when the plan does not fit
    zipf: float = 0.0
    hit_rate_override: float | None = None

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def to_json(self) -> dict:
        d = asdict(self)
        d["gpu"]["budget_bytes"] = self.gpu.budget_bytes
        d["gpu"]["expert_room_bytes"] = self.gpu.expert_room_bytes
        d["facts"].update(rows=self.facts.rows, stride=self.facts.stride, expert_bytes=self.facts.expert_bytes)
        return d


# ---------------------------------------------------------------- facts

def facts_from_checkpoint(path: str, dtype: str = "auto", kv_cache_dtype: str = "bf16"):
    """(ModelFacts, inspect Summary) from a checkpoint's headers (no tensor data read); the KV
    bytes per token of `kv_cache_dtype` (the engine's --kv-cache-dtype names; auto = bf16 here,
    the serving dtype)."""
    from moet.checkpoint import open_checkpoint
    from moet.checkpoint.inspect_cli import summarize

    s = summarize(path)
    spec = open_checkpoint(path).spec
    kv = kv_bytes_per_token_of(spec, kv_cache_dtype=kv_cache_dtype)
    return facts_from_summary(s, spec=spec, dtype=dtype, kv_bytes_per_token=kv), s


def _dtype_bytes(dtype: str, summary) -> int:
    if dtype == "float32":
        return 4
    if dtype in ("bfloat16", "float16"):
        return 2
    return summary.dense_loaded_bytes // max(1, summary.dense_params)      # auto: what inspect loads


def facts_from_summary(s, *, spec=None, dtype: str = "auto", kv_bytes_per_token: int | None = None,
                       embedding_bytes: int | None = None) -> ModelFacts:
    """ModelFacts from `moet inspect`'s Summary; `spec` (the checkpoint's ModelSpec) adds the exact
    W2 and FP4 rows, the embedding table and bf16 KV bytes per token (without it: pass them, or 0)."""
    elem = _dtype_bytes(dtype, s)
    rows = max(1, s.moe_layers * s.experts)
    row = s.w2_expert_bytes // rows
    fp4_row = s.fp4_expert_bytes // rows
    if spec is not None:
        from moet.store.pack_builder import expert_row_bytes

        row = expert_row_bytes(spec, "w2")
        fp4_row = expert_row_bytes(spec, "fp4")
        if embedding_bytes is None:
            embedding_bytes = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size * elem
        if kv_bytes_per_token is None:
            kv_bytes_per_token = kv_bytes_per_token_of(spec)
    return ModelFacts(name=f"{s.family} ({s.path})", moe_layers=s.moe_layers, experts=s.experts, top_k=s.top_k,
                      row_bytes=row, embedding_bytes=embedding_bytes or 0,
                      # auto: FP8 / NVFP4 dense weights keep their bytes on the GPU (model/kept_dense.py)
                      dense_bytes=s.dense_gpu_bytes if dtype == "auto" and s.dense_gpu_bytes else s.dense_params * elem,
                      kv_bytes_per_token=kv_bytes_per_token or 0, fp4_row_bytes=fp4_row)


def kv_bytes_per_token_of(spec, kv_dtype_bytes: int = 2, *, kv_cache_dtype: str | None = None) -> int:
    """KV cache bytes per token over the decoder's attention layers (MTP excluded): bf16 (fp32
    with kv_dtype_bytes 4), or the layout of a --kv-cache-dtype name (auto = bf16; a dtype the
    attention cannot hold is a ConfigError naming those it can)."""
    import torch

    from moet.kernels.kv_cache import KVFormat, kv_format_for, kv_layer_bytes_per_token
    from moet.kernels.sparse_attention import index_key_bytes_of

    model_dtype = torch.bfloat16 if kv_dtype_bytes == 2 else torch.float32
    if kv_cache_dtype is None:
        fmt = KVFormat("auto", dtype=model_dtype)
    else:
        fmt = kv_format_for(kv_cache_dtype, model_dtype, spec.attention)
    if getattr(spec, "compressed_attention", None) is not None:      # DeepSeek-V4: rows per layer type
        return fmt.dtype.itemsize * spec.compressed_attention.cache_elements_per_token(spec.attention.head_dim)
    return kv_layer_bytes_per_token(spec.attention, fmt) * spec.num_layers + index_key_bytes_of(spec, fmt, 0)


# ---------------------------------------------------------------- placement

def default_kv_reserve(facts: ModelFacts, max_num_seqs: int, context: int) -> int:
    """The engine's KV floor for an auto-sized cache: min(max_num_seqs, 4) sequences of `context`."""
    return min(max_num_seqs, 4) * context * facts.kv_bytes_per_token


def place(facts: ModelFacts, gpu: GpuBudget, host_arena_bytes: int, max_num_seqs: int) -> tuple[list[Tier], Fit]:
    room = gpu.expert_room_bytes
    gpu_rows = max(0, min(facts.rows, room // facts.row_bytes)) if room > 0 else 0
    arena_slots = max(0, host_arena_bytes // facts.stride)
    host_rows = min(arena_slots, facts.rows - gpu_rows)
    disk_rows = facts.rows - gpu_rows - host_rows
    all_resident = gpu_rows >= facts.rows
    tiers = [
        Tier("gpu", gpu_rows, gpu_rows * facts.row_bytes, max(room, 0)),
        Tier("host_arena", host_rows, host_rows * facts.stride, host_arena_bytes),
        # the pack holds every row when the store is on; the tier counts the rows served from it
        Tier("disk", disk_rows, disk_rows * facts.stride, 0 if all_resident else facts.rows * facts.stride),
    ]
    need = min_cache_slots(facts.moe_layers, facts.top_k, max_num_seqs)
    rule = (f"{facts.moe_layers} MoE layers x top_k {facts.top_k} x min(max_num_seqs {max_num_seqs}, 4) = "
            f"{need} slots")
    if room < 0 and gpu.budget_bytes - gpu.dense_bytes < 0:
        msg = (f"the dense stack ({gpu.dense_bytes / GiB:.2f} GiB) alone exceeds the GPU budget "
               f"({gpu.budget_bytes / GiB:.2f} GiB): raise --gpu-memory (more or bigger GPUs)")
        return tiers, Fit(False, False, need, msg)
    if gpu_rows < need and not all_resident:
        msg = (f"the expert slot pool holds {gpu_rows} rows, fewer than a decode step needs ({rule}): raise "
               f"--gpu-memory, or lower --max-num-seqs / --kv-reserve / --context (engine: raise --expert-cache-slots "
               f"/ --expert-cache-gb / --gpu-memory-utilization or lower --max-num-seqs)")
        return tiers, Fit(False, False, need, msg)
    return tiers, Fit(True, all_resident, need, "")


# ---------------------------------------------------------------- hit-rate model and prediction

def popularity_cdf(n: float, experts: int, zipf: float = 0.0) -> float:
    """Share of a layer's routing mass on its n most popular experts (n may be fractional)."""
    if n <= 0:
        return 0.0
    if n >= experts:
        return 1.0
    if zipf <= 0:
        return n / experts
    w = [1.0 / (i + 1) ** zipf for i in range(experts)]
    total = sum(w)
    whole = int(n)
    part = sum(w[:whole]) + (n - whole) * (w[whole] if whole < experts else 0.0)
    return part / total


def _binomial_tail(n: int, p: float, k: int) -> float:
    """P(X > k) for X ~ Binomial(n, p)."""
    if p <= 0 or k >= n:
        return 0.0
    if p >= 1:
        return 1.0
    log_q = math.log1p(-p)
    pmf = math.exp(n * log_q)                           # P(X = 0)
    cdf = pmf
    for i in range(1, k + 1):
        pmf *= (n - i + 1) / i * p / (1 - p)
        cdf += pmf
    return max(0.0, 1.0 - cdf)


def predict(facts: ModelFacts, gpu_rows: int, host_rows: int, bw: Bandwidths, *, batch: int = 1, context: int = 4096,
            miss_tolerance: int = 0, zipf: float = 0.0, hit_rate: float | None = None) -> Prediction:
    """Decode step time of `batch` sequences at `context` tokens with `gpu_rows` rows in the device
    cache and `host_rows` more in the arena (module docstring: the model)."""
    e, k = facts.experts, facts.top_k
    distinct = e * (1 - (1 - min(k, e) / e) ** batch)          # experts one layer needs per step
    needed = facts.moe_layers * distinct
    g = gpu_rows / max(1, facts.moe_layers)
    a = host_rows / max(1, facts.moe_layers)
    if hit_rate is not None:
        hit = min(1.0, max(0.0, hit_rate))
        rest = facts.rows - gpu_rows
        arena_frac = min(1.0, host_rows / rest) if rest > 0 else 1.0
        arena = (1 - hit) * arena_frac
        model = f"given hit rate {hit:.3f}; misses split arena/disk by the arena's share of the rest"
    else:
        hit = popularity_cdf(g, e, zipf)
        arena = popularity_cdf(g + a, e, zipf) - hit
        model = ("uniform routing: hit rate = resident fraction of the cache" if zipf <= 0 else
                 f"Zipf({zipf:g}) expert popularity, caches hold the most popular rows")
    if gpu_rows >= facts.rows:
        hit, arena = 1.0, 0.0
    disk = max(0.0, 1.0 - hit - arena)
    hbm_bytes = (facts.dense_bytes - facts.embedding_bytes + needed * facts.row_bytes
                 + batch * context * facts.kv_bytes_per_token)
    if not 0 < bw.kernel_efficiency <= 1 or bw.pass_overhead_ms < 0:
        raise ValueError(f"kernel efficiency must be in (0, 1] and the pass overhead >= 0, got "
                         f"{bw.kernel_efficiency} and {bw.pass_overhead_ms} ms")
    hbm_s = hbm_bytes / (bw.hbm_gbps * 1e9 * bw.kernel_efficiency) + bw.pass_overhead_ms * 1e-3
    misses = needed * (1 - hit)
    fetch_bytes = misses * facts.row_bytes
    disk_bytes = needed * disk * facts.stride
    fetch_s = fetch_bytes / (bw.h2d_gbps * 1e9) + disk_bytes / (bw.disk_gbps * 1e9)
    passes = 1.0 + _binomial_tail(int(round(needed)), 1 - hit, miss_tolerance)
    step_s = passes * hbm_s + fetch_s
    absent = max(0, facts.rows - gpu_rows)
    pre_disk = max(0, absent - host_rows) * facts.stride
    pre_bytes = absent * facts.row_bytes
    pre_s = pre_bytes / (bw.h2d_gbps * 1e9) + pre_disk / (bw.disk_gbps * 1e9)
    return Prediction(batch=batch, context=context, hit_model=model, hit_rate=hit, arena_share=arena,
                      disk_share=disk, hbm_bytes_per_step=int(hbm_bytes), hbm_s=hbm_s, misses_per_step=misses,
                      fetch_bytes_per_step=fetch_bytes, disk_bytes_per_step=disk_bytes, fetch_s=fetch_s,
                      passes_per_step=passes, step_s=step_s, tok_s=batch / step_s, resident_tok_s=batch / hbm_s,
                      pcie_bound_tok_s=batch / (fetch_bytes / (bw.h2d_gbps * 1e9)) if fetch_bytes else None,
                      prefill_chunk_fetch_bytes=float(pre_bytes), prefill_chunk_disk_bytes=float(pre_disk),
                      prefill_chunk_fetch_s=pre_s)


def make_plan(facts: ModelFacts, *, gpu_memory_bytes: int, host_memory_bytes: int,
              host_arena_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
              kv_reserve_bytes: int | None = None, activation_reserve: float = 0.05, max_num_seqs: int = 64,
              context: int = 4096, batch: int = 1, miss_tolerance: int = 0, zipf: float = 0.0,
              hit_rate: float | None = None, bandwidths: Bandwidths | None = None) -> Plan:
    """The plan for a card of `gpu_memory_bytes` and a host of `host_memory_bytes`.
    kv_reserve_bytes default: min(max_num_seqs, 4) x context tokens of KV (the engine's floor);
    activation_reserve: share of the GPU budget kept for activations (the engine keeps 5%);
    host_arena_bytes default: half the host memory (the engine's default arena rule)."""
    bw = bandwidths or Bandwidths()
    kv = default_kv_reserve(facts, max_num_seqs, context) if kv_reserve_bytes is None else kv_reserve_bytes
    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    gpu = GpuBudget(gpu_memory_bytes, gpu_memory_utilization, facts.dense_bytes, kv, int(budget * activation_reserve))
    arena = host_memory_bytes // 2 if host_arena_bytes is None else host_arena_bytes
    return _placed(facts, gpu, host_memory_bytes, arena, max_num_seqs, batch, context, miss_tolerance, zipf,
                   hit_rate, bw)


def _placed(facts: ModelFacts, gpu: GpuBudget, host_memory_bytes: int, arena: int, max_num_seqs: int, batch: int,
            context: int, miss_tolerance: int, zipf: float, hit_rate: float | None, bw: Bandwidths) -> Plan:
    """Place the rows for this GPU budget and arena, predict where the fit check passes."""
    tiers, fit = place(facts, gpu, arena, max_num_seqs)
    pred = None
    if fit.ok:
        pred = predict(facts, tiers[0].rows, tiers[1].rows, bw, batch=batch, context=context,
                       miss_tolerance=miss_tolerance, zipf=zipf, hit_rate=hit_rate)
    return Plan(facts=facts, gpu=gpu, host_memory_bytes=host_memory_bytes, host_arena_bytes=arena,
                max_num_seqs=max_num_seqs, miss_tolerance=miss_tolerance, tiers=tiers, fit=fit, bandwidths=bw,
                prediction=pred, zipf=zipf, hit_rate_override=hit_rate)


# ---------------------------------------------------------------- the FP4 repair tier

@dataclass
class RepairTierPlan:
    """The FP4 repair tier and the confidence gate (engine/confidence_gate.py) for this budget: the
    engine loads every expert's FP4 rows when every W2 expert is resident and they fit in the room
    left, else a partial pool of what fits (slots per MoE layer). With the expert store the FP4 rows
    come from their own pack and the pool gets STORE_POOL_SHARE of the experts' room. A repair is
    one eager pass over the positions written since the last one, at most reach + 1: it re-reads
    the dense stack and the FP4 rows of the distinct experts those tokens route to (a partial
    pool's misses read W2 rows instead: the same bound, roughly)."""
    fp4_bytes: int
    room_bytes: int            # GPU room left for it after the dense stack, reserves and W2 experts
    fits: bool                 # every expert's FP4 rows on the device
    slots: int                 # FP4 slots per MoE layer (0: the tier is off: fewer than top_k fit)
    from_pack: bool            # the expert store is on: FP4 rows from the FP4 pack
    reach: int
    repair_bytes: int          # HBM bytes of one batch-1 repair pass over reach + 1 positions
    repair_s: float
    tok_s_at_fire: dict        # fire rate -> predicted batch-1 decode tok/s (0: bare W2)


def repair_tier_plan(plan: Plan, reach: int = 32, fire_rates=(0.0, 0.1, 0.3)) -> RepairTierPlan | None:
    """None when the model's FP4 row size is unknown or the plan does not fit at all."""
    f, p, bw = plan.facts, plan.prediction, plan.bandwidths
    if not f.fp4_row_bytes or p is None:
        return None
    fp4 = f.rows * f.fp4_row_bytes
    from_pack = not plan.fit.all_resident
    room = plan.gpu.expert_room_bytes // STORE_POOL_SHARE if from_pack else plan.gpu.expert_room_bytes - f.expert_bytes
    slots = min(f.experts, max(0, room) // (f.moe_layers * f.fp4_row_bytes))
    slots = slots if slots >= f.top_k else 0
    fits = slots == f.experts
    def pass_bytes(tokens: float) -> float:
        distinct = f.experts * (1 - (1 - min(f.top_k, f.experts) / f.experts) ** tokens)
        # the pass's attention reads the sequence's context once for all its queries
        return (f.dense_bytes - f.embedding_bytes + f.moe_layers * distinct * f.fp4_row_bytes
                + p.context * f.kv_bytes_per_token)

    def seconds(nbytes: float) -> float:
        return nbytes / (bw.hbm_gbps * 1e9 * bw.kernel_efficiency) + bw.pass_overhead_ms * 1e-3

    repair_bytes = pass_bytes(reach + 1)
    step = p.step_s / p.batch            # per token at the plan's batch
    tok_s = {}
    for r in fire_rates:
        # a repair recomputes the positions since the last one (engine/confidence_gate.py): about
        # 1 / fire rate of them, at most reach + 1
        tokens = min(reach + 1, max(1.0, 1.0 / r)) if r > 0 else 1.0
        tok_s[r] = 1.0 / (step + r * seconds(pass_bytes(tokens)))
    return RepairTierPlan(fp4_bytes=fp4, room_bytes=room, fits=fits, slots=slots, from_pack=from_pack, reach=reach,
                          repair_bytes=int(repair_bytes),
                          repair_s=seconds(repair_bytes), tok_s_at_fire=tok_s)


# ---------------------------------------------------------------- prediction vs measurement

def plan_for_rows(facts: ModelFacts, gpu_rows: int, host_arena_bytes: int, *, max_num_seqs: int = 64,
                  batch: int = 1, context: int = 4096, miss_tolerance: int = 0, zipf: float = 0.0,
                  hit_rate: float | None = None, bandwidths: Bandwidths | None = None) -> Plan:
    """A plan for a device cache of exactly `gpu_rows` rows (e.g. a bench's --expert-cache-slots)
    and an arena of `host_arena_bytes`; the GPU budget is reported as just what those take."""
    bw = bandwidths or Bandwidths()
    gpu_rows = min(gpu_rows, facts.rows)
    room = gpu_rows * facts.row_bytes
    gpu = GpuBudget(facts.dense_bytes + room, 1.0, facts.dense_bytes, 0, 0)
    return _placed(facts, gpu, host_arena_bytes, host_arena_bytes, max_num_seqs, batch, context, miss_tolerance,
                   zipf, hit_rate, bw)


def with_hit_rate(plan: Plan, hit_rate: float) -> Plan:
    """The same placement, predicted at a given (e.g. measured) hit rate."""
    p = plan.prediction
    if p is None:
        return plan
    pred = predict(plan.facts, plan.tier("gpu").rows, plan.tier("host_arena").rows, plan.bandwidths, batch=p.batch,
                   context=p.context, miss_tolerance=plan.miss_tolerance, hit_rate=hit_rate)
    return replace(plan, prediction=pred, hit_rate_override=hit_rate)


def compare(plan: Plan, measured_tok_s: float | None, measured_hit_rate: float | None = None) -> dict:
    """A run's decode tok/s against the plan's prediction: measured / predicted; with the measured
    hit rate, also the prediction redone at that hit rate (an error of the hit-rate model vs one
    of the bandwidth model)."""
    p = plan.prediction
    out = {"predicted_tok_s": p.tok_s if p else None, "measured_tok_s": measured_tok_s,
           "measured_over_predicted": measured_tok_s / p.tok_s if p and measured_tok_s else None,
           "predicted_hit_rate": p.hit_rate if p else None, "measured_hit_rate": measured_hit_rate,
           "predicted_passes_per_step": p.passes_per_step if p else None}
    if p is not None and measured_hit_rate is not None:
        redo = with_hit_rate(plan, measured_hit_rate).prediction
        out.update(predicted_tok_s_at_measured_hit_rate=redo.tok_s,
                   measured_over_predicted_at_measured_hit_rate=measured_tok_s / redo.tok_s if measured_tok_s else None)
    return out
