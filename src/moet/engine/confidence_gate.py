"""The confidence gate: W2 experts compute every generated token; the steps where the model is
unsure are recomputed with the FP4 repair tier (EngineConfig.gate, ExpertSlots' repair tier).

With `fp4_prefill` (the default) prompt positions compute with FP4 experts in the step itself
(LLMEngine._fp4_prompt_rows). After a step's forward, each sampling row of a generated position
has its confidence: the largest softmax probability of its logits (temperature 1). A row fires
when that is below `gate_tau`, or when `gate_refresh` generated positions have passed since its
sequence's KV was last FP4's. A fired sequence's positions from the first whose KV is not FP4's
over its present context (`Sequence.repaired_upto` + 1, at most `gate_reach` back, never before the
first generated position, or the prompt's last without fp4_prefill) to the fired one run again in
one varlen pass over the paged KV cache with the FP4 tier: the pass rewrites those
positions' KV and yields repaired logits, which replace the W2 row before sampling. Every fired
sequence of the step shares that one pass. Positions up to `repaired_upto` would come out the same
if recomputed (their context has not changed since FP4 computed them), so skipping them gives the
result of reaching back every time at a fraction of the rows.

On CUDA the pass replays a graph captured under the repair tier (ModelRunner.ensure_repair_graphs)
for a few fixed rows-per-sequence widths: each fired sequence's rows are widened at the front to the
narrowest captured width, the added rows read-only (positions already in the cache, slot -1: their
KV is not written, and the rows after them attend to the cached KV there, as the unwidened pass
does). An eager pass costs far more in host time than the FP4 experts' bytes (a launch per kernel
per layer, and Python between them).

Why (docs/quality.md, moet-tiny): a wrong W2 step comes mostly from KV that drifted over the tokens
the model wrote itself, so FP4 logits over W2 KV recover almost nothing on multi-step answers, while
recomputing the recent generated positions recovers nearly all; answers read from the prompt need
the prompt's KV FP4's too; steps that look sure still sit on drifted KV, which the refresh bounds.
Max probability is the signal because it needs no calibration and the measured curves are monotone
in it.

KV blocks: a repair writes only blocks its sequence holds alone. A block shared through the prefix
cache (ref_count > 1) ends the reach-back at its end; a block of the sequence's own that the prefix
cache registered is dropped from the cache index when rewritten, so the cache never hands out KV
other than what a fresh computation of its tokens would write.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch

from moet.config import EngineConfig
from moet.errors import ConfigError
from moet.model.attention_batch import AttentionBatch
from moet.store.repair_pool import STORE_POOL_SHARE

log = logging.getLogger("moet.engine")


def repair_tier_plan(config: EngineConfig, ckpt, device: torch.device, dtype: torch.dtype,
                     store_reason: str | None) -> tuple[int | None, str]:
    """(FP4 device slots per MoE layer, or None: no repair tier; why, for the log), decided before
    any weight is read. Every expert's FP4 rows when they fit (--fp4-pool-gb auto) or the size asks
    for them all; fewer slots (a partial pool, store/repair_pool.py, every expert's FP4 rows then in
    host memory) when only that fits or the size says so. With the expert store (`store_reason`)
    the FP4 rows come from their own pack through a host arena, and auto gives the device pool
    STORE_POOL_SHARE of the room the dense weights leave (the W2 cache takes what remains after
    it). Explicit requests that cannot be met are a ConfigError naming the flag."""
    from moet.engine.expert_residency import FIT_FRACTION, estimated_weight_bytes
    from moet.store.host_arena import available_host_bytes
    from moet.store.pack_builder import expert_row_bytes, pack_layers

    gate = config.gate
    if not gate.fp4_gate:
        return None, "--no-fp4-gate"
    explicit = gate.fp4_pool_bytes
    if explicit == 0:
        return None, "--fp4-pool-gb 0"
    spec = ckpt.spec
    layers = len(pack_layers(spec))
    if not layers:
        return None, "the model has no routed experts"
    if spec.linear_attention is not None:
        # a repair recomputes past positions; a gated DeltaNet layer's state has already moved past
        # them (it would need the state as it was before them, which is not kept)
        return None, "the model's gated DeltaNet layers keep one state per sequence, which a repair cannot rewind"
    fmt = config.load.expert_format
    if fmt != "w2":
        return None, f"expert_format={fmt}: the experts are not W2, nothing to repair"
    experts, top_k = spec.router.num_experts, spec.router.top_k
    dense, w2_bytes = estimated_weight_bytes(ckpt, "w2", dtype)
    if store_reason is not None:      # the W2 experts are paged: they take no fixed room here
        w2_bytes = 0
    layer_slot = layers * expert_row_bytes(spec, "fp4")           # one slot in every MoE layer
    full = experts * layer_slot
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.cache.gpu_memory_utilization - (total - free)
        room = int(FIT_FRACTION * budget - dense - w2_bytes)
        where = f"the GPU budget ({budget / 2**30:.1f} GiB, {FIT_FRACTION:.0%} of it for weights)"
    else:
        room = available_host_bytes() // 2 - dense - w2_bytes
        where = "half of the host's available memory"
    if store_reason is not None:
        where += " beside the expert store's W2 cache"
        size = explicit if explicit is not None else max(0, room) // STORE_POOL_SHARE
    else:
        size = explicit if explicit is not None else max(0, room)
    slots = min(experts, size // layer_slot)
    if explicit is not None and explicit > room:
        raise ConfigError(f"--fp4-pool-gb {gate.fp4_pool_gb} does not fit beside the weights in {where} (room for "
                          f"{max(0, room) / 2**30:.3g} GiB); lower it or use auto / 0")
    if slots < top_k:
        if explicit is not None:
            raise ConfigError(f"--fp4-pool-gb {gate.fp4_pool_gb} holds {slots} FP4 experts per MoE layer, fewer than "
                              f"the {top_k} one token routes to; give at least {top_k * layer_slot / 2**30:.3g} GiB "
                              "(0 turns the tier off)")
        return None, f"the FP4 pool does not fit beside the weights in {where}"
    if store_reason is not None:
        what = "every expert" if slots == experts else f"{slots} of {experts} experts per MoE layer"
        return slots, (f"FP4 pool of {what} ({slots * layer_slot / 2**30:.3g} GiB) filled from the FP4 pack "
                       f"(the expert store is on: {store_reason})")
    if slots < experts:
        host_room = available_host_bytes() // 2
        if full > host_room:
            msg = (f"a partial FP4 pool keeps every expert's FP4 rows ({full / 2**30:.3g} GiB) in host memory, "
                   f"more than half of what is available ({2 * host_room / 2**30:.3g} GiB)")
            if explicit is not None:
                raise ConfigError(f"--fp4-pool-gb {gate.fp4_pool_gb}: {msg}; use --fp4-pool-gb 0")
            return None, msg
        return slots, (f"FP4 pool of {slots} of {experts} experts per MoE layer ({slots * layer_slot / 2**30:.3g} "
                       "GiB; the rest from host memory as they get hot)")
    return experts, f"FP4 pool of every expert ({full / 2**30:.3g} GiB) beside the W2 experts"


def forced_draw(seq, position: int) -> float:
    """A fixed number in [0, 1) per (request id, completion index, position), the same in every run
    and process: CRC-32 of the id, then Knuth's multiplicative hash."""
    key = zlib.crc32(seq.request_id.encode()) + 7919 * seq.index
    return ((key * 1_000_003 + position) * 2_654_435_761 % 2**32) / 2**32


@dataclass
class GateCounters:
    """Totals since the engine started (EngineStats.extra, /metrics)."""
    rows_checked: int = 0        # sampling rows whose confidence was tested
    fires: int = 0               # rows below tau
    repaired: int = 0            # fired rows whose token came from repaired logits
    recomputed_rows: int = 0     # token rows the repair passes computed with FP4 experts
    read_only_rows: int = 0      # rows a captured pass's width added (computed, no KV written)
    graph_passes: int = 0        # repair passes that replayed a captured graph
    kv_blocks_unregistered: int = 0


class ConfidenceGate:
    def __init__(self, runner, block_manager, tau: float, reach: int, fp4_prefill: bool = False,
                 repair_pool=None, refresh: int = 0):
        self.runner = runner
        self.block_manager = block_manager
        self.tau = float(tau)
        self.reach = int(reach)
        # prompt rows ran with FP4 experts (LLMEngine._prompt_rows_from): the row of a prompt's last
        # position is FP4's already, and a repair never reaches below the first generated position
        self.fp4_prefill = bool(fp4_prefill)
        # fire also once this many generated positions passed since the KV was last FP4's (0: off)
        self.refresh = int(refresh)
        # store/repair_pool.py when the FP4 pool holds part of the experts (promotes after each
        # repair pass), else None: every expert has its FP4 row
        self.repair_pool = repair_pool
        self.counters = GateCounters()
        # rows of the last `apply` whose logits were replaced (speculative verification stops there)
        self.last_repaired_rows: set[int] = set()
        # `moet bench decode --gate-fire`: fire this share of rows whatever their confidence (a
        # fixed pseudo-random choice per sequence and position, the same in every run), to time the
        # gate at chosen fire rates on weights whose confidence means nothing (random shapes).
        # None: the confidence decides.
        self.forced_fire_rate: float | None = None

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """Largest softmax probability of each row (float32, temperature 1)."""
        x = logits.float()
        return torch.exp(x.max(dim=-1).values - torch.logsumexp(x, dim=-1))

    @torch.inference_mode()
    def apply(self, sampling: list, logits: torch.Tensor) -> torch.Tensor:
        """sampling: the step's ScheduledSeqs that sample, in `logits` row order (their forward has
        run and written their KV). -> the logits to sample from: fired rows replaced by repaired
        ones (a new tensor when any fired, else `logits` itself)."""
        c = self.counters
        self.last_repaired_rows: set[int] = set()
        floor = 0 if self.fp4_prefill else -1       # repairs start at prompt length + floor
        if self.fp4_prefill:                        # rows of a prompt's last position: FP4 already
            checked = [row for row, s in enumerate(sampling) if s.seq.num_tokens > s.seq.num_prompt_tokens]
        else:
            checked = list(range(len(sampling)))
        c.rows_checked += len(checked)
        if (self.tau <= 0.0 and not self.refresh) or not checked:
            return logits
        if self.forced_fire_rate is not None:
            fired = [row for row in checked if forced_draw(sampling[row].seq, sampling[row].seq.num_tokens) <
                     self.forced_fire_rate]
        else:
            low = (self.confidence(logits) < self.tau).tolist()
            fired = [row for row in checked if low[row] or self._due(sampling[row].seq)]
        if not fired:
            return logits
        c.fires += len(fired)
        plan = []                       # (row, sequence, first position, last position)
        for row in fired:
            s = sampling[row]
            seq = s.seq
            if seq.is_finished:                        # failed earlier in this step: its blocks are freed
                continue
            last = seq.num_tokens - 1                  # a sampling row computed the sequence's last token
            # positions whose KV FP4 already computed over their present context need no second pass
            first = max(seq.num_prompt_tokens + floor, last - self.reach, seq.repaired_upto + 1, 0)
            if first > last:             # (cannot happen: `last` was just computed with W2)
                continue
            first = self._writable_from(seq, first, last)
            if first is not None:
                plan.append((row, seq, first, last))
        if not plan:
            return logits
        plan.sort(key=lambda p: p[3] - p[2] != 0)      # one-row sequences first (AttentionBatch's decode rows)
        # a captured repair graph takes a fixed number of rows per sequence: each sequence's rows
        # start earlier, the added ones read-only (positions already in the cache, no KV written)
        width = self.runner.repair_graph_width(max(last - first + 1 for _, _, first, last in plan), len(plan))
        if width is not None and any(last + 1 < width for *_, last in plan):
            width = None                 # a sequence shorter than the width: eager
        starts = [first if width is None else last + 1 - width for _, _, first, last in plan]
        ids: list[int] = []
        for (_, seq, _, last), start in zip(plan, starts):
            ids.extend(seq.token_ids[start:last + 1])
        batch = AttentionBatch.build(block_tables=[seq.block_table for _, seq, _, _ in plan],
                                     context_lens=starts,
                                     query_lens=[last - start + 1 for (*_, last), start in zip(plan, starts)],
                                     block_size=self.block_manager.block_size, device=self.runner.device,
                                     pad_blocks_to=self.runner.table_width,
                                     read_only_rows=[first - start for (_, _, first, _), start in zip(plan, starts)])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.runner.device)
        replays = self.runner.repair_replays
        hidden = self.runner.repair_forward(input_ids, batch)
        repaired = self.runner.logits(hidden[batch.logits_indices])
        if self.repair_pool is not None:
            self.repair_pool.after_repair()
        out = logits.clone()
        rows = torch.tensor([row for row, *_ in plan], dtype=torch.long, device=logits.device)
        out[rows] = repaired.to(out.dtype)
        c.repaired += len(plan)
        c.recomputed_rows += sum(last - first + 1 for _, _, first, last in plan)
        c.read_only_rows += len(ids) - sum(last - first + 1 for _, _, first, last in plan)
        c.graph_passes += self.runner.repair_replays - replays
        self.last_repaired_rows = {row for row, *_ in plan}
        for _, seq, first, last in plan:
            c.kv_blocks_unregistered += self.block_manager.unregister_rewritten(seq, first, last)
            seq.repaired_upto = last
        return out

    def _due(self, seq) -> bool:
        """gate_refresh generated positions since the sequence's KV was last FP4's."""
        if not self.refresh:
            return False
        since = max(seq.repaired_upto, seq.num_prompt_tokens - 1)
        return seq.num_tokens - 1 - since >= self.refresh

    def _writable_from(self, seq, first: int, last: int) -> int | None:
        """The first position >= `first` from which the sequence's blocks up to `last` are its own
        (not shared through the prefix cache); None when `last` itself sits in a shared block."""
        bs = self.block_manager.block_size
        ref = self.block_manager.ref_count
        for i in range(last // bs, first // bs - 1, -1):
            if ref[seq.block_table[i]] > 1:
                start = (i + 1) * bs
                return start if start <= last else None
        return first

    def stats(self, generated_tokens: int) -> dict[str, float]:
        c = self.counters
        return {
            "fp4_gate_rows_checked": float(c.rows_checked),
            "fp4_gate_fires": float(c.fires),
            "fp4_gate_fire_rate": c.fires / c.rows_checked if c.rows_checked else 0.0,
            "fp4_gate_repaired": float(c.repaired),
            "fp4_gate_recomputed_rows": float(c.recomputed_rows),
            "fp4_gate_recomputed_rows_per_token": c.recomputed_rows / generated_tokens if generated_tokens else 0.0,
            # with every expert's FP4 row on the device a repair never falls back to W2
            "fp4_pool_hit_rate": 1.0 if c.repaired else 0.0,
            "fp4_gate_kv_blocks_unregistered": float(c.kv_blocks_unregistered),
            "fp4_gate_read_only_rows": float(c.read_only_rows),
            "fp4_gate_graph_passes": float(c.graph_passes),
            "fp4_gate_tau": self.tau,
            "fp4_gate_reach": float(self.reach),
            "fp4_gate_prefill": float(self.fp4_prefill),
            "fp4_gate_refresh": float(self.refresh),
        } | (self.repair_pool.stats() if self.repair_pool is not None else {})
