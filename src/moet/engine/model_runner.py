"""ModelRunner: owns the model and its paged KV cache, and runs one scheduled step.

  * KV cache size: EngineConfig.cache.num_kv_blocks, else kv_cache_memory_gb, else (CUDA) what
    gpu_memory_utilization leaves after the weights and a profiled forward of
    max_num_batched_tokens tokens, else (CPU) what max_num_seqs full-length sequences need,
    at most 4 GiB. Bytes per token come from the model (all attention layers, MTP included).
    A size that cannot hold one max_model_len sequence, or exceeds the free memory, is one
    ConfigError naming the flag and what fits (check_kv_size; the explicit sizes are checked
    before the weights load too, check_kv_request).
  * A step: the scheduler's sequences -> one flat varlen AttentionBatch -> model.forward_paged
    -> logits of the rows that sample (and of prompt rows whose logprobs were asked for).
  * CUDA graphs (engine/cuda_graphs.py): pure-decode steps of up to max_num_seqs sequences
    replay a graph captured for the next bucket (1, 2, 4, 8, ..., max_num_seqs); with MTP
    drafts so do verify steps in which every sequence brings its k drafts (k + 1 rows each).
    CPU always runs eager (the torch references). The confidence gate's repair passes replay
    graphs of their own, captured under the FP4 repair tier for a few rows-per-sequence widths
    (ensure_repair_graphs; the gate pads each fired sequence's rows to a captured width).
  * Expert store (engine/expert_residency.py, when routed experts are not all resident): the
    device expert cache is sized and allocated before the KV cache (so the KV cache gets what
    is left) and before graph capture (graphs read its pool / slot table / counters, which are
    fixed tensors updated in place); every step runs under miss replay. Expert prefetch hooks
    (store/prefetch.py) fetch early only in eager passes; inside a captured decode graph they
    only record their predictions (no Python runs at replay).
Everything is per instance (device from the config, no globals), so one process per GPU can
each hold a runner later; a rank / world size joins the config when parallelism lands.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from moet.config import EngineConfig
from moet.engine.cuda_graphs import GraphSet
from moet.engine.scheduler import SchedulerOutput
from moet.errors import ConfigError
from moet.kernels.attention_ops import set_gqa_fused_merge
from moet.engine.state_slots import StateSlots
from moet.kernels.kv_cache import KVFormat, check_kv_format, kv_format_for, kv_layer_bytes_per_token
from moet.kernels.sparse_attention import index_key_bytes_of
from moet.kernels.pdl_flag import set_small_kernel_pdl
from moet.model.attention_batch import AttentionBatch

log = logging.getLogger("moet.engine")
CPU_DEFAULT_KV_BYTES = 4 << 30
# Rows of the largest captured repair pass: a bucket of more rows reads nearly every expert of a
# layer anyway, where an eager pass's host overhead no longer dominates its time.
REPAIR_GRAPH_MAX_ROWS = 256


def repair_widths(reach: int, longest: int | None = None) -> list[int]:
    """Rows per sequence of the captured repair passes for --gate-reach `reach` (a repair computes
    at most reach + 1 positions): powers of two below reach + 1, then reach + 1 itself (which
    replaces the power just below it when that is within a quarter of it). `longest`: the longest
    sequence a replay may serve; a wider pass would need a sequence longer than that (and its
    capture would attend past the block table's width), so none is listed."""
    top, out, w = reach + 1, [], 1
    while w < top:
        out.append(w)
        w *= 2
    if out and 4 * top <= 5 * out[-1]:
        out.pop()
    return [q for q in out + [top] if longest is None or q <= longest]


def cpu_decoded_experts_budget() -> int:
    """Bytes a CPU run may spend on repacked copies of its routed experts (CausalLM.prepare_cpu): a
    quarter of the machine's memory (the rest stays for the pools, the KV cache and other processes)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 0


def available_kv_bytes(device: torch.device) -> int:
    """Bytes a new KV cache can take on `device` now: free GPU memory, or the host's MemAvailable
    (a CPU tensor larger than that is not refused by the allocator under overcommit: zeroing it
    would page the machine to death or wake the OOM killer instead)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from moet.store.host_arena import available_host_bytes
    return available_host_bytes()


def kv_bytes_per_token_of(spec, kv_format: KVFormat, load_mtp: bool) -> int:
    """CausalLM.kv_bytes_per_token from the spec alone (every attention layer, the MTP layers when
    loaded): the KV checks that run before the weights are read."""
    if spec.compressed_attention is not None:        # DeepSeek-V4: rows per layer type
        check_kv_format(spec.attention, kv_format)
        return kv_format.dtype.itemsize * spec.compressed_attention.cache_elements_per_token(spec.attention.head_dim)
    mtp = spec.num_mtp_layers if load_mtp else 0
    layers = spec.num_layers
    if spec.linear_attention is not None:            # Qwen3.5: gated DeltaNet layers hold no KV
        layers = sum(t == "full" for t in spec.linear_attention.layer_types)
    return kv_layer_bytes_per_token(spec.attention, kv_format) * (layers + mtp) + \
        index_key_bytes_of(spec, kv_format, mtp)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 1000 * 2**30 else f"{n / 2**30:,.0f} GiB"


def check_kv_size(config: EngineConfig, num_blocks: int, bytes_per_token: int, max_model_len: int,
                  available: int | None, device: torch.device, source: str) -> None:
    """One clear ConfigError when `num_blocks` blocks cannot hold one max_model_len sequence or do
    not fit in `available` bytes (None: not known here), saying what fits and which flag to
    change. `source`: what sized the cache ("num_kv_blocks", "kv_cache_memory_gb", "cpu_default",
    "gpu_budget"), so the message names that flag."""
    bs = config.cache.block_size
    per_block = bytes_per_token * bs
    need = -(-max_model_len // bs)
    tokens = num_blocks * bs
    if source == "num_kv_blocks":
        flag = f"--num-kv-blocks {num_blocks}"
    elif source == "kv_cache_memory_gb":
        flag = f"--kv-cache-memory-gb {config.cache.kv_cache_memory_gb:g}"
    elif source == "cpu_default":
        flag = f"the CPU default KV cache (at most {_gib(CPU_DEFAULT_KV_BYTES)})"
    else:
        flag = "the GPU budget left after the weights and activations"
    shorter = (f" or lower --max-model-len to at most {tokens}" if tokens else "")
    if num_blocks < need:
        if source == "num_kv_blocks":
            fix = f"raise --num-kv-blocks to at least {need}"
        elif source == "gpu_budget":
            fix = "raise --gpu-memory-utilization, use --kv-cache-dtype fp8"
        else:
            fix = f"set --kv-cache-memory-gb to at least {need * per_block / 2**30:.3g}"
        raise ConfigError(f"{flag} holds {num_blocks} blocks x {bs} tokens = {tokens} tokens ({bytes_per_token} "
                          f"bytes per token), less than one max_model_len={max_model_len} sequence ({need} blocks); "
                          f"{fix}{shorter}")
    if available is not None and num_blocks * per_block > available:
        fit = available // per_block
        if source == "kv_cache_memory_gb":
            fix = f"lower --kv-cache-memory-gb to at most {available / 2**30:.3g}"
        else:
            fix = f"lower --num-kv-blocks to at most {fit}" if source == "num_kv_blocks" else \
                "set --num-kv-blocks or --kv-cache-memory-gb to fit"
        raise ConfigError(f"{flag}: {num_blocks} blocks need {_gib(num_blocks * per_block)} of KV cache but {device} "
                          f"has {_gib(available)} free ({fit} blocks = {fit * bs} tokens fit); {fix}")


def check_kv_request(config: EngineConfig, spec, max_model_len: int, dtype: torch.dtype, device: torch.device) -> None:
    """The KV sizes the config fixes (num_kv_blocks, kv_cache_memory_gb), checked before the
    weights are read: too small for one max_model_len sequence, or more than the device has free
    now (the runner checks again after loading, against what the weights left)."""
    if config.cache.num_kv_blocks is None and config.cache.kv_cache_memory_gb is None:
        return
    per_token = kv_bytes_per_token_of(spec, kv_format_for(config.cache.kv_cache_dtype, dtype, spec.attention),
                                      config.load.load_mtp)
    blocks, source = _explicit_blocks(config, per_token)
    check_kv_size(config, blocks, per_token, max_model_len, available_kv_bytes(device), device, source)


def _explicit_blocks(config: EngineConfig, bytes_per_token: int) -> tuple[int, str]:
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks, "num_kv_blocks"
    return int(cache.kv_cache_memory_gb * (1 << 30)) // (bytes_per_token * cache.block_size), "kv_cache_memory_gb"


class ModelRunner:
    def __init__(self, config: EngineConfig, model, device: torch.device, max_model_len: int, residency=None):
        self.config = config
        self.residency = residency
        self.model = model
        self.device = device
        if device.type == "cuda":       # one q/k/v GEMV per layer instead of three (decode is launch-bound)
            model.fuse_projections()
            set_small_kernel_pdl(config.kernels.small_kernel_pdl)
            set_gqa_fused_merge(config.kernels.attention_fused_merge)
            if config.kernels.overlap_shared_experts:
                model.overlap_shared_experts(device)
        elif residency is None:
            # CPU, every expert resident for good: repack the routed experts once for CPU GEMVs
            # instead of the torch reference decoding them at every MoE call of every step (most
            # of a CPU decode step); the copies take host memory (a float32 model's exact decode
            # 4 bytes per weight), so only while they stay a small part of the machine's memory
            n = model.prepare_cpu(cpu_decoded_experts_budget())
            if n:
                log.info("routed experts repacked for the CPU: %.0f MiB", n / 2**20)
        self.max_model_len = max_model_len
        # captured graphs serve sequences up to this length. A DSA model is dense while no sequence
        # is longer than its indexer's top-k, and its graphs hold that path; past it, a decode step
        # selects on the device with static shapes (sparse_attention.DecodeSelection), so a second
        # set of decode graphs, captured at the worst case (max_model_len), serves those steps: its
        # replays read every sequence's index keys up to max_model_len, which the dense set spares
        # short contexts. Its other passes (verify, repair, drafting) run eager past top-k.
        dsa = model.spec.sparse_attention
        self.graph_context = max_model_len if dsa is None else min(max_model_len, dsa.top_k)
        self.decode_graph_context = max_model_len
        self.block_size = config.cache.block_size
        self.kv_format = kv_format_for(config.cache.kv_cache_dtype, model.dtype, model.spec.attention)
        self.bytes_per_token = model.kv_bytes_per_token(self.kv_format)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        # On CUDA block tables are padded to one fixed width (graphs need it; eager steps match it)
        self.table_width = self.max_blocks_per_seq if device.type == "cuda" else None
        if residency is not None:
            slots = residency.requested_slots()
            residency.start(slots if slots is not None else residency.auto_slots(self._kv_floor_bytes()))
        self.num_blocks, source = self._plan_num_blocks()
        check_kv_size(config, self.num_blocks, self.bytes_per_token, max_model_len,
                      available_kv_bytes(device) if source != "gpu_budget" else None, device, source)
        # per-sequence recurrent states (Qwen3.5's gated DeltaNet layers): one slot per sequence a
        # step may hold, handed out by build_batch (StateSlots)
        self.state_slots = StateSlots(config.scheduler.max_num_seqs) if getattr(model, "has_recurrent_state",
                                                                                False) else None
        try:
            if self.state_slots is not None:
                self.kv = model.new_kv_cache(self.num_blocks, self.block_size, self.kv_format, device,
                                             state_slots=self.state_slots.size)
            else:
                self.kv = model.new_kv_cache(self.num_blocks, self.block_size, self.kv_format, device)
        except torch.OutOfMemoryError as exc:
            raise ConfigError(f"the KV cache of {self.num_blocks} blocks ({_gib(self.kv_cache_bytes)}) could not be "
                              f"allocated on {device} ({str(exc).splitlines()[0]}); lower --num-kv-blocks / "
                              "--kv-cache-memory-gb / --gpu-memory-utilization") from None
        # rows per sequence of a speculative verify step (1 without drafts): a step whose sequences
        # bring more is a prompt chunk, for the expert store a scan (its rows are evicted first)
        self.verify_width = config.scheduler.num_speculative_tokens + 1
        self.decode_graphs: GraphSet | None = None
        self.long_decode_graphs: GraphSet | None = None  # DSA: decode steps past top-k (graph_context)
        self.spec_graphs: dict[int, GraphSet] = {}       # rows per sequence -> verify graphs
        self.repair_graphs: dict[int, GraphSet] = {}     # rows per sequence -> FP4 repair graphs
        # (input from the main model?, rows per sequence) -> the MTP layer's drafting graphs
        self.draft_graphs: dict[tuple[bool, int], GraphSet] = {}
        # a model whose paged forward reads host lengths to shape its work (DeepSeek-V4's, for now)
        # would replay a capture's worst case: it runs eager
        if device.type == "cuda" and not config.kernels.enforce_eager and getattr(model, "graph_safe", True):
            self._capture_decode_graphs()

    # ------------------------------------------------------------------ sizing

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def _kv_floor_bytes(self) -> int:
        """KV bytes an auto-sized expert cache leaves room for: the explicit KV size when given,
        else min(max_num_seqs, 4) sequences of max_model_len tokens."""
        cache, per_block = self.config.cache, self.bytes_per_token * self.block_size
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks * per_block
        if cache.kv_cache_memory_gb is not None:
            return int(cache.kv_cache_memory_gb * (1 << 30))
        return min(self.config.scheduler.max_num_seqs, 4) * self.max_blocks_per_seq * per_block

    def _plan_num_blocks(self) -> tuple[int, str]:
        """(blocks, what sized them: the flag check_kv_size names)."""
        cfg = self.config
        per_block = self.bytes_per_token * self.block_size
        if cfg.cache.num_kv_blocks is not None or cfg.cache.kv_cache_memory_gb is not None:
            return _explicit_blocks(cfg, self.bytes_per_token)
        if self.device.type != "cuda":
            want = cfg.scheduler.max_num_seqs * self.max_blocks_per_seq
            return max(1, min(want, CPU_DEFAULT_KV_BYTES // per_block)), "cpu_default"
        return self._profile_cuda_blocks(per_block), "gpu_budget"

    @torch.inference_mode()
    def _profile_cuda_blocks(self, per_block: int) -> int:
        """vLLM's rule: budget = total * utilization - memory in use - the activation peak of the
        largest step (one prefill of max_num_batched_tokens tokens through a throwaway cache)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        scratch = self.model.new_kv_cache(blocks, self.block_size, self.kv_format, dev)
        batch = AttentionBatch.build(block_tables=[list(range(blocks))], context_lens=[0], query_lens=[n],
                                     block_size=self.block_size, device=dev, pad_blocks_to=self.table_width)
        batch.state_slots = [0]                          # the scratch cache's one recurrent-state slot, if any
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.randint(0, self.model.spec.vocab_size, (n,), device=dev)
        hidden = self.model.forward_paged(ids, batch, scratch)
        self.model.logits(hidden[batch.logits_indices])
        torch.cuda.synchronize(dev)
        activation = torch.cuda.max_memory_allocated(dev) - base
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # the recurrent states of max_num_seqs sequences come out of the same budget (gated DeltaNet)
        states = self.config.scheduler.max_num_seqs * getattr(self.model, "state_bytes_per_sequence", lambda: 0)()
        budget = total * self.config.cache.gpu_memory_utilization - (total - free) - activation - states
        if budget < per_block:
            raise ConfigError(f"no GPU memory left for the KV cache (total {total / 2**30:.1f} GiB, in use "
                              f"{(total - free) / 2**30:.1f} GiB, activations {activation / 2**30:.1f} GiB); raise "
                              "gpu_memory_utilization, lower max_num_batched_tokens or use a smaller expert format")
        return int(budget // per_block)

    # ------------------------------------------------------------------ one step

    def build_batch(self, sched: SchedulerOutput, input_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, AttentionBatch]:
        """The step's input ids and AttentionBatch; input_ids: already on the device (an async
        decode step's, the previous step's samples), else from the sequences' token ids."""
        ids: list[int] = []
        tables, ctx, q, sample = [], [], [], []
        for s in sched.scheduled:
            c, n = s.context_len, s.num_new_tokens
            toks = s.seq.token_ids
            ids.extend(toks[c:c + n] if c + n <= len(toks) else (toks + s.seq.spec_token_ids)[c:c + n])
            tables.append(s.seq.block_table)
            ctx.append(c)
            q.append(n)
            sample.append(s.samples)
        batch = AttentionBatch.build(block_tables=tables, context_lens=ctx, query_lens=q, block_size=self.block_size,
                                     device=self.device, sample=sample, pad_blocks_to=self.table_width)
        if self.state_slots is not None:
            batch.state_slots = [self.state_slots.slot_for(s.seq) for s in sched.scheduled]
        if input_ids is not None:
            return input_ids, batch
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, repair_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states [N, H] of every row (writes the rows' K/V into the cache). With the
        expert store the step may run several times (miss replay); nothing may read its output
        before this returns. repair_rows (bool [N]): those rows (the step's prompt positions)
        compute with the FP4 repair tier (EngineConfig.gate.fp4_prefill), eagerly."""
        res = self.residency
        if repair_rows is not None:
            with self.model.repair_tier(rows=repair_rows):
                step = lambda: self.model.forward_paged(input_ids, batch, self.kv)  # noqa: E731
                if res is None:
                    return step()
                return res.run(step, scan=True, num_tokens=int(input_ids.shape[0]), repairing=True)
        found = self._graph_for(batch)
        key = None if found is None else (found[0].q, found[1]) + (("long",) if found[0] is self.long_decode_graphs
                                                                    else ())
        # with the expert store a graph step may run eagerly instead (demand fetch, no replay):
        # res.decode_mode decides (engine/decode_mode.py), per (rows per sequence, bucket)
        graph = found is not None and (res is None or res.decode_mode.use_graph(key))
        if not graph:
            step = lambda: self.model.forward_paged(input_ids, batch, self.kv)  # noqa: E731
        else:
            step = lambda: found[0].replay(found[1], input_ids, batch)  # noqa: E731
        if res is None:
            return step()
        if batch.state_slots is not None:
            # a replayed pass must start from the recurrent states the step began with, not from
            # those its discarded pass left (KV writes repeat the same bytes; state updates do not)
            saved, inner = self.model.save_states(self.kv, batch.state_slots), step

            def step():
                self.model.restore_states(self.kv, batch.state_slots, saved)
                return inner()
        t0 = time.perf_counter()
        out = res.run(step, scan=batch.max_seqlen_q > self.verify_width, num_tokens=int(input_ids.shape[0]))
        if key is not None:
            res.decode_mode.record(key, graph, time.perf_counter() - t0)
        return out

    @torch.inference_mode()
    def repair_forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """forward with the FP4 repair tier (engine/confidence_gate.py): a captured repair graph
        when every sequence brings one of its widths (repair_graph_width), else eager."""
        gs = self.repair_graphs.get(batch.max_seqlen_q)
        bucket = gs.bucket_for(batch) if gs is not None else None
        if bucket is not None:
            return gs.replay(bucket, input_ids, batch)
        with self.model.repair_tier():
            step = lambda: self.model.forward_paged(input_ids, batch, self.kv)  # noqa: E731
            if self.residency is None:
                return step()
            # the repaired positions' experts are the decode working set's: not a scan
            return self.residency.run(step, scan=False, num_tokens=int(input_ids.shape[0]), repairing=True)

    @torch.inference_mode()
    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch, from_main: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer 0 over a varlen batch (engine/speculative.py): (output hidden, draft logits)
        of every row. from_main: `hidden` is the main model's (pre-norm) output, which the pass
        norms first; else the MTP layer's own output of the previous draft. A captured drafting
        graph when one fits the batch (ensure_draft_graphs), else eager, under the expert store's
        replay like any step."""
        gs = self.draft_graphs.get((from_main, batch.max_seqlen_q))
        bucket = gs.bucket_for(batch) if gs is not None else None
        if bucket is not None:
            return gs.replay(bucket, next_ids, batch, hidden)
        step = lambda: self._mtp(next_ids, hidden, batch, from_main)  # noqa: E731
        if self.residency is None:
            return step()
        return self.residency.run(step, scan=False, num_tokens=int(next_ids.shape[0]))

    def _mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch, from_main: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if from_main:
            hidden = self.model.model.norm(hidden)
        return self.model.mtp_forward_paged(0, next_ids, hidden, batch, self.kv)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    # ------------------------------------------------------------------ CUDA graphs

    @property
    def graphs(self) -> dict[int, "torch.cuda.CUDAGraph"]:
        """The captured decode graphs by bucket (the verify graphs: verify_graphs)."""
        return self.decode_graphs.graphs if self.decode_graphs is not None else {}

    @property
    def verify_graphs(self) -> dict[tuple[int, int], "torch.cuda.CUDAGraph"]:
        """The captured verify graphs by (rows per sequence, bucket)."""
        return {(q, b): g for q, gs in self.spec_graphs.items() for b, g in gs.graphs.items()}

    @property
    def graph_error(self) -> str | None:
        return self.decode_graphs.error if self.decode_graphs is not None else None

    def _graph_for(self, batch: AttentionBatch) -> tuple[GraphSet, int] | None:
        sets = ([self.decode_graphs, self.long_decode_graphs] if batch.max_seqlen_q == 1
                else [self.spec_graphs.get(batch.max_seqlen_q)])
        for gs in sets:
            bucket = gs.bucket_for(batch) if gs is not None else None
            if bucket is not None:
                return gs, bucket
        return None

    def _forward_for_capture(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.model.forward_paged(ids, batch, self.kv)

    def _capture_decode_graphs(self) -> None:
        self.decode_graphs = GraphSet(1, self.config.scheduler.max_num_seqs, self.table_width,
                                      self.graph_context, self.device, "decode")
        self.decode_graphs.capture(self._forward_for_capture, self.device)
        if self.decode_graph_context > self.graph_context and self.decode_graphs.error is None:
            self.long_decode_graphs = GraphSet(1, self.config.scheduler.max_num_seqs, self.table_width,
                                               self.decode_graph_context, self.device,
                                               "decode past the indexer's top-k")
            self.long_decode_graphs.capture(self._forward_for_capture, self.device)

    def reset_replay_counts(self) -> None:
        """Every graph set's replay count back to 0 (after the engine's compile warm-up, whose
        steps are not served work)."""
        sets = [self.decode_graphs, self.long_decode_graphs, *self.spec_graphs.values(),
                *self.repair_graphs.values(),
                *self.draft_graphs.values()]
        for gs in sets:
            if gs is not None:
                gs.replays = 0

    @property
    def repair_replays(self) -> int:
        """Repair passes that replayed a captured graph so far (the gate counts its graph passes
        by it: a pass the gate did not widen replays too when its rows match a captured width)."""
        return sum(gs.replays for gs in self.repair_graphs.values())

    def repair_graph_width(self, rows: int, num_seqs: int) -> int | None:
        """The narrowest captured repair width that holds `rows` rows per sequence for `num_seqs`
        sequences, or None (the pass runs eager)."""
        return next((q for q, gs in sorted(self.repair_graphs.items())
                     if q >= rows and gs.graphs and max(gs.graphs) >= num_seqs), None)

    def _repair_forward_for_capture(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        with self.model.repair_tier():
            return self.model.forward_paged(ids, batch, self.kv)

    def ensure_repair_graphs(self, reach: int) -> str | None:
        """Captures the confidence gate's repair passes once (repair_widths(reach) rows per
        sequence, each width for as many sequences as REPAIR_GRAPH_MAX_ROWS allows) on CUDA with
        decode graphs. -> why not, when nothing was captured. Not with the expert store or a pool
        of part of the experts: their repair passes fetch, promote and wait on the host's terms."""
        if self.repair_graphs:
            return None
        if self.decode_graphs is None or self.decode_graphs.error is not None:
            return "no decode graphs"
        if self.residency is not None:
            return "the expert store pages experts in eager passes"
        if not all(m.experts.repair_complete for m in self.model.moe_blocks().values()):
            return "the FP4 pool holds part of the experts"
        cap = self.config.scheduler.max_num_seqs
        for q in repair_widths(reach, self.graph_context):
            gs = GraphSet(q, max(1, min(cap, REPAIR_GRAPH_MAX_ROWS // q)), self.table_width, self.graph_context,
                          self.device, f"FP4 repair ({q} rows per sequence)")
            gs.capture(self._repair_forward_for_capture, self.device)
            if gs.error is not None:
                return gs.error
            self.repair_graphs[q] = gs
        return None

    def ensure_verify_graphs(self, q: int) -> None:
        """Captures the graphs of MTP verify steps with q rows per sequence (k drafts + 1) once, on
        CUDA with decode graphs (a process whose decode graphs failed runs verify steps eager too),
        and the MTP layer's drafting passes (ensure_draft_graphs)."""
        if self.decode_graphs is None or self.decode_graphs.error is not None or q > self.graph_context:
            return                        # (a verify step of q rows needs a sequence of q tokens)
        if q not in self.spec_graphs:
            gs = GraphSet(q, self.config.scheduler.max_num_seqs, self.table_width, self.graph_context, self.device,
                          f"MTP verify ({q - 1} drafts)")
            gs.capture(self._forward_for_capture, self.device)
            self.spec_graphs[q] = gs
        self.ensure_draft_graphs(q)

    def ensure_draft_graphs(self, q: int) -> None:
        """The MTP layer's passes of a drafting step (engine/speculative.py), captured once each:
        the first over a step's rows from the main model, q rows per sequence after a verify
        step of q - 1 drafts, 1 after a plain decode step; then the chained one-row passes on the
        MTP layer's own output. Not with the expert store (its passes fetch on the host's terms)."""
        if self.residency is not None or not len(self.model.mtp):
            return
        shape = (self.model.spec.hidden_size, self.model.dtype)
        for from_main, width in ((True, q), (True, 1), (False, 1)):
            if (from_main, width) in self.draft_graphs or width > self.graph_context:
                continue
            gs = GraphSet(width, self.config.scheduler.max_num_seqs, self.table_width, self.graph_context,
                          self.device, f"MTP drafting ({'main model' if from_main else 'chained'}, {width} rows)",
                          hidden=shape)
            gs.capture(lambda ids, batch, gs=gs, m=from_main: self._mtp(ids, gs.hidden[:ids.shape[0]], batch, m),
                       self.device)
            if gs.error is not None:
                return
            self.draft_graphs[(from_main, width)] = gs
