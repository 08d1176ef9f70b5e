"""LLMEngine: requests in, cumulative RequestOutputs out, one scheduled step at a time.

    engine = LLMEngine.from_config(EngineConfig(model=path))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A step: scheduler -> model runner (one forward over every scheduled token) -> sampler for the
sequences whose last token was computed -> detokenizer / stop checks -> finished sequences
free their blocks. Requests with n > 1 run n sequences; with prefix caching the siblings wait
until the first one has prefilled the prompt, then take its full blocks from the cache.
Not thread-safe: AsyncEngine drives it from one thread (EngineProcess: from its own process).

One request never takes another down:
  * add_request refuses what cannot run on this model (RequestError naming the field: stop
    token ids outside the vocabulary, more logprobs than the vocabulary, a seed torch's
    generators cannot take, stop strings without a tokenizer) before anything is queued;
  * a fault in a request's own part of a step (its sampling row, prompt logprobs, the stop
    checks and detokenizer, its RequestOutput) fails that request alone: its sequences finish
    with finish_reason "error", its output carries RequestFailed in `error`, the rest of the
    batch keeps its tokens;
  * a fault in the step as a whole (the forward, the batched sample) fails the requests
    scheduled in it (`error` = MoetError "engine step failed"); waiting requests are untouched
    and the engine serves on.
"""
from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moet.config import EngineConfig
from moet.engine.async_decode import AsyncDecode
from moet.engine.block_manager import BlockManager
from moet.engine.confidence_gate import ConfidenceGate, GateCounters
from moet.engine.detokenizer import IncrementalDetokenizer
from moet.engine.gc_pauses import install_gc_pauses, server_starting
from moet.engine.model_runner import ModelRunner
from moet.engine.sampler import Sampler, new_generator, position_logprobs
from moet.engine.scheduler import Scheduler, SchedulerOutput
from moet.engine.sequence import FINISH_REASONS, Sequence, SequenceStatus
from moet.engine.stats import EngineStats
from moet.engine.structured_output import DEAD_END, GrammarBackend
from moet.errors import ConfigError, MoetError, RequestError, RequestFailed
from moet.kernels.jit_watch import install_jit_watch
from moet.store.repair_pool import RepairPool
from moet.engine.speculative import MTPDrafter
from moet.outputs import CompletionOutput, RequestOutput
from moet.sampling_params import SamplingParams

log = logging.getLogger("moet.engine")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# what torch.Generator.manual_seed takes (a negative seed is taken modulo 2**64)
GENERATOR_SEED_MIN, GENERATOR_SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device} requested but no CUDA device is available; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str, weight_format: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if weight_format != "float":
        return torch.bfloat16
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16)


def load_tokenizer(path: str, trust_remote_code: bool):
    """None when the directory has no tokenizer files (token-id prompts still work)."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types here
        raise MoetError(f"{path}: cannot load a tokenizer ({type(exc).__name__}: {exc}); "
                        "pass tokenizer=DIR, trust_remote_code=True for a tokenizer that ships its own code "
                        "(e.g. Kimi-K2), or prompt_token_ids prompts") from exc


def encode_prompt(tokenizer, prompt, tokenizer_source: str) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a prompt as LLMEngine.encode takes it; a module
    function so that engine_process.py's parent tokenizes exactly as the engine would."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        prompt = prompt["prompt"]
    if isinstance(prompt, (list, tuple)):
        return None, [int(t) for t in prompt]
    if tokenizer is None:
        raise ConfigError(f"{tokenizer_source} has no tokenizer files: pass "
                          "tokenizer=DIR or prompts as {'prompt_token_ids': [...]}")
    return prompt, list(tokenizer(prompt).input_ids)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending: list[Sequence] = field(default_factory=list)   # n > 1 siblings not yet scheduled
    error: Exception | None = None                          # set when it failed inside the engine

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, model, tokenizer, eos_token_ids: set[int], device: torch.device,
                 max_model_len: int, residency=None):
        self.config = config
        self.residency = residency            # engine/expert_residency.py, or None: all experts resident
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_model_len = max_model_len
        sch = config.scheduler
        if not sch.enable_chunked_prefill and sch.max_num_batched_tokens < max_model_len:
            raise ConfigError(f"without chunked prefill max_num_batched_tokens={sch.max_num_batched_tokens} must "
                              f"be >= max_model_len={max_model_len}; raise it or enable chunked prefill")
        self.runner = ModelRunner(config, model, device, max_model_len, residency=residency)
        prefix_caching = config.cache.enable_prefix_caching
        if prefix_caching and getattr(model, "has_recurrent_state", False):
            # a cached prefix gives back its KV, not the recurrent state the gated DeltaNet layers
            # reached at its end (vLLM keeps state snapshots per block for that; moet does not yet)
            log.info("prefix caching off: the model's gated DeltaNet layers keep one state per sequence")
            prefix_caching = False
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size, prefix_caching)
        max_seqs, max_tokens = self._step_limits(max_model_len)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                   enable_chunked_prefill=sch.enable_chunked_prefill)
        self.sampler = Sampler(eos_token_ids)
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seed_stream = random.Random(sch.seed)    # seeds of requests that bring none
        self._grammars: GrammarBackend | None = None   # structured outputs, made on first use
        self._next_seq_id = 0
        self._stats = EngineStats(num_kv_blocks=self.runner.num_blocks, block_size=config.cache.block_size)
        self._token_str_cache: dict[int, str] = {}
        self._failed_now: dict[str, Request] = {}       # requests failed in the running step
        # the confidence gate (engine/confidence_gate.py): where the model holds the FP4 repair tier
        self.gate = None
        if config.gate.fp4_gate and model.has_repair_tier():
            partial = {n: m for n, m in model.moe_blocks().items() if not m.experts.repair_complete}
            pool = residency.repair_pool if residency is not None else None     # the store's (FP4 pack)
            if partial and pool is None:    # a pool of part of the experts: the hot ones move in as they fire
                pool = RepairPool(partial, max_rows_per_repair=len(partial) * model.spec.router.top_k)
                pool.fill()
            self.gate = ConfidenceGate(self.runner, self.block_manager, config.gate.gate_tau, config.gate.gate_reach,
                                       config.gate.fp4_prefill, repair_pool=pool, refresh=config.gate.gate_refresh)
            if device.type == "cuda" and not config.kernels.enforce_eager:
                why = self.runner.ensure_repair_graphs(config.gate.gate_reach)
                if why is not None:
                    log.info("FP4 repair passes run eager: %s", why)
        # MTP speculative decoding (engine/speculative.py), or None
        self.drafter = None
        k = sch.num_speculative_tokens
        if k:
            check_speculative(config, model.spec)
            if not len(model.mtp):
                raise ConfigError("--speculative-config needs the MTP layers loaded: drop --no-load-mtp")
            self.drafter = MTPDrafter(self.runner, self.block_manager, k, max_model_len)
        # pure decode steps one step ahead of the host (engine/async_decode.py), or None
        self._async = AsyncDecode(self) if sch.async_scheduling and self.drafter is None else None
        # Triton compiles on first use: watch it (kernels/jit_watch.py), warm the prefill variants
        # up front, and from then on count (and log) every compile a request had to wait for
        self._jit = install_jit_watch() if device.type == "cuda" else None
        self._gc = install_gc_pauses()                # and the cyclic GC's pauses (engine/gc_pauses.py)
        for w in (self._jit, self._gc):
            if w is not None:
                w.mark_starting()
        if device.type == "cuda" and config.kernels.compile_warmup and residency is None:
            self.compile_warmup()
        if not server_starting():                    # a server marks them once it accepts requests
            for w in (self._jit, self._gc):
                if w is not None:
                    w.mark_ready()

    def compile_warmup(self) -> int:
        """Warm-up requests of random tokens (EngineConfig.kernels.compile_warmup), then no trace of them:
        no request, an empty prefix cache, zeroed token and step counters. -> the number of
        warm-up requests. Two parts, each aimed at what Triton specializes on (constexpr tile
        sizes and launch widths chosen from a step's sizes; integer arguments equal to 1, multiples
        of 16, others):
        - one prefill per size 1, 2^k, 2^k + 1 tokens: every power-of-two bucket of the launch
          tables (tokens, pairs = tokens x top_k) and every integer class;
        - serving-shaped steps at 2^j and 2^j + 1 concurrent requests (up to max_num_seqs): ragged
          prompts prefilled together, all but the first group reading a cached prefix (prefill
          with earlier context from paged blocks), then two decode steps. With the first part
          alone, a server on the H200 still compiled alignment and MLA-prefill variants on its
          first requests."""
        cap = min(self.scheduler.max_num_batched_tokens, self.max_model_len - 1)
        sizes = sorted({1} | {m for j in range(31) for m in (1 << j, (1 << j) + 1) if m <= cap})
        vocab = self.model.spec.vocab_size
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        prefill_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, seed=0)
        for n in sizes:
            self.add_request(f"__moet_warmup_{n}", torch.randint(0, vocab, (n,), generator=gen).tolist(), prefill_only)
            self._drain()
        n_req = len(sizes)
        # the serving-shaped part: prompts of a shared prefix (two blocks where they fit) plus a
        # ragged tail, sized so a group fits one step's token budget and two new tokens fit the
        # model length
        longest = min(self.max_model_len - 3, 2 * self.block_manager.block_size + 8)
        seqs = sorted({m for j in range(1, 31) for m in (1 << j, (1 << j) + 1)
                       if m <= min(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)})
        if longest >= 2 and seqs:
            prefix = torch.randint(0, vocab, (longest,), generator=gen).tolist()
            plen = min(2 * self.block_manager.block_size, longest - 1)
            decode = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=0)
            for c in seqs:
                tail_max = max(1, min(longest - plen, self.scheduler.max_num_batched_tokens // c - plen))
                for r in range(c):
                    tail = torch.randint(0, vocab, (1 + (r * 5) % tail_max,), generator=gen).tolist()
                    self.add_request(f"__moet_warmup_c{c}_{r}", prefix[:plen] + tail, decode)
                self._drain()
                n_req += c
        self.block_manager.reset_prefix_cache()
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        st = self._stats
        st.prompt_tokens_total = st.generation_tokens_total = st.num_steps = st.last_step_num_tokens = 0
        self.scheduler.num_preemptions = 0
        st.last_step_time_s = 0.0
        if self.gate is not None:
            self.gate.counters = GateCounters()
        self.runner.reset_replay_counts()
        log.info("compile warm-up: %d requests (prefills of 1-%d tokens, 2-%d concurrent) in %.1f s", n_req,
                 sizes[-1] if sizes else 0, seqs[-1] if seqs else 1, time.perf_counter() - t0)
        return n_req

    def _drain(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    def _step_limits(self, max_model_len: int) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) the scheduler gets: the config's, lowered when
        a partial expert cache could not hold the experts of a full step at once."""
        cfg = self.config.scheduler
        cap = self.residency.step_token_cap() if self.residency is not None else None
        seqs = self.residency.decode_seq_cap() if self.residency is not None else None
        max_seqs = cfg.max_num_seqs if seqs is None else min(cfg.max_num_seqs, seqs)
        if cap is None or cap >= cfg.max_num_batched_tokens:
            if max_seqs < cfg.max_num_seqs:
                log.warning("expert cache of %d slots: decode steps limited to %d sequences (max_num_seqs=%d)",
                            self.residency.cache.num_slots, max_seqs, cfg.max_num_seqs)
            return max_seqs, cfg.max_num_batched_tokens
        if not cfg.enable_chunked_prefill and cap < max_model_len:
            raise ConfigError(f"the expert cache holds the experts of {cap} tokens per step, fewer than "
                              f"max_model_len={max_model_len}; enable chunked prefill, lower --max-model-len or raise "
                              "--expert-cache-slots / --expert-cache-gb")
        log.warning("expert cache of %d slots: steps limited to %d tokens (max_num_batched_tokens=%d), %d sequences",
                    self.residency.cache.num_slots, cap, cfg.max_num_batched_tokens, min(max_seqs, cap))
        return min(max_seqs, cap), cap

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        from moet.checkpoint import open_checkpoint
        from moet.checkpoint.spec import resolve_max_model_len
        from moet.engine.confidence_gate import repair_tier_plan
        from moet.engine.expert_residency import ExpertResidency, store_reason
        from moet.engine.model_runner import check_kv_request
        from moet.model import load_model

        ckpt = open_checkpoint(config.model)
        device = resolve_device(config.load.device)
        dtype = resolve_dtype(config.load.dtype, ckpt.spec.torch_dtype, ckpt.weight_format)
        # config.json and the flags against each other, before any weight is read
        max_model_len = resolve_max_model_len(ckpt.spec, config.scheduler.max_model_len,
                                              config.scheduler.allow_long_max_model_len, f"{ckpt.path}/config.json")
        check_kv_request(config, ckpt.spec, max_model_len, dtype, device)
        check_speculative(config, ckpt.spec)
        reason = store_reason(config, ckpt, device, dtype)
        repair_slots, why = repair_tier_plan(config, ckpt, device, dtype, reason)
        log.info("FP4 repair tier and confidence gate %s: %s", "off" if repair_slots is None else "on", why)
        model = load_model(ckpt, expert_format=config.load.expert_format, dtype=dtype, device=device,
                           zero_mode=config.load.w2_zero_mode, scale_rule=config.load.w2_scale_rule,
                           load_mtp=config.load.load_mtp, progress=True, routed_experts=reason is None,
                           repair_tier=repair_slots is not None and reason is None, repair_slots=repair_slots)
        residency = None
        if reason is not None:
            log.info("routed experts through the expert store: %s", reason)
            residency = ExpertResidency.open(config, ckpt, model, device, repair_slots=repair_slots)
        try:
            tokenizer = load_tokenizer(config.load.tokenizer or config.model, config.load.trust_remote_code)
            gen = ckpt.reader.generation_config
            eos = gen.get("eos_token_id", None)
            eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set(ckpt.spec.eos_token_ids)
            engine = cls(config, model, tokenizer, {int(e) for e in eos_ids if e is not None}, device, max_model_len,
                         residency=residency)
        except BaseException:
            if residency is not None:
                residency.close()
            raise
        engine.checkpoint = ckpt
        pool = engine.gate.repair_pool if engine.gate is not None else None
        if pool is not None:                  # a partial FP4 pool: start from the last run's heat
            from moet.checkpoint.identity import identity
            from moet.engine.expert_residency import DEFAULT_PACK_DIR
            ident = identity(ckpt.reader)
            engine._heat_file = (os.path.join(os.path.expanduser(config.store.pack_dir or DEFAULT_PACK_DIR),
                                              f"fp4-heat-{ident.rsplit('-', 1)[-1][:24]}.json"), ident)
            if pool.load_heat(*engine._heat_file):
                log.info("FP4 repair pool filled from the saved heat %s", engine._heat_file[0])
        return engine

    def health(self) -> tuple[str, str]:
        """("ok", "") or ("degraded", reason): degraded while an expert row of the pack that failed
        its checksum is not repaired on disk (engine/expert_residency.py). For /health."""
        return self.residency.health() if self.residency is not None else ("ok", "")

    def close(self) -> None:
        """Release the expert store (hot set saved, pack closed) and save a partial FP4 pool's heat;
        idempotent. The engine cannot step afterwards when it had a store."""
        heat = getattr(self, "_heat_file", None)
        if heat is not None and self.gate is not None and self.gate.repair_pool is not None:
            try:
                self.gate.repair_pool.save_heat(*heat)
            except OSError as exc:            # only a hint for the next start: say so, go on closing
                log.warning("could not save the FP4 pool's heat to %s: %s", heat[0], exc)
            self._heat_file = None
        if self.residency is not None:
            self.residency.close()

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self.eos_token_ids = set(ids)
        self.sampler.eos_token_ids = set(ids)
        self._grammars = None                    # its matchers end on the old ids

    def set_grammar_backend(self, backend: GrammarBackend) -> None:
        """Structured outputs over this vocabulary (a model without a tokenizer: `moet bench`)."""
        self._grammars = backend

    def grammar_backend(self) -> GrammarBackend:
        """Structured outputs' compiler and matchers for this tokenizer (made on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need a tokenizer; pass tokenizer=DIR", param="structured_outputs")
            self._grammars = GrammarBackend(self.tokenizer, self.model.spec.vocab_size, self.eos_token_ids)
        return self._grammars

    # ------------------------------------------------------------------ requests

    def encode(self, prompt) -> tuple[str | None, list[int]]:
        """str | list[int] | {"prompt": str} | {"prompt_token_ids": [...], "prompt"?: str}."""
        return encode_prompt(self.tokenizer, prompt, self.config.load.tokenizer or self.config.model)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue. Raises ConfigError for a request that can never run."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already running; use a unique id")
        text, ids = self.encode(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        vocab = self.model.spec.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len}; "
                              "raise --max-model-len or shorten the prompt")
        self._check_params(params)
        so = params.structured_outputs
        compiled = self.grammar_backend().compile(so, params.stop_token_ids) if so is not None else None
        budget = self.max_model_len - len(ids)
        max_new = min(params.max_tokens, budget) if params.max_tokens is not None else budget
        # (it always fits the KV cache: the runner refuses a cache smaller than max_model_len,
        # so a request alone never needs preempting itself)
        seqs = []
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, max_new, arrival=self._next_seq_id)
            self._next_seq_id += 1
            seed = params.seed + i if params.seed is not None else self._seed_stream.getrandbits(63)
            if params.temperature > 0:
                seq.generator = new_generator(seed, self.device)
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, seq)
            if compiled is not None:
                seq.grammar = self._grammars.new_sequence(compiled, params.stop_token_ids)
            seqs.append(seq)
        req = Request(request_id, text, ids, params, seqs)
        # siblings share the prompt: let the first prefill it, the rest hit the prefix cache
        cache = self.config.cache
        wait_for_first = cache.enable_prefix_caching and len(seqs) > 1 and len(ids) > cache.block_size
        req.pending = seqs[1:] if wait_for_first else []
        for s in seqs:
            if s not in req.pending:
                self.scheduler.add(s)
        self.requests[request_id] = req

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone (it needs this model): RequestError naming
        the field. Each of these got past it into a step before and failed it there."""
        vocab = self.model.spec.vocab_size
        bad = [t for t in params.stop_token_ids or ()
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are not token ids of this model (its vocabulary is "
                               f"0..{vocab - 1})", param="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and not (isinstance(k, int) and 0 <= k <= vocab):
                raise RequestError(f"{name}={k!r} must be in [0, {vocab}] (the model's vocabulary size)", param=name)
        seed = params.seed
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)
                                     and GENERATOR_SEED_MIN <= seed and seed + params.n - 1 <= GENERATOR_SEED_MAX):
            # completion i draws from a generator seeded with seed + i
            raise RequestError(f"seed={seed!r} must be an integer with seed and seed + n - 1 (n={params.n}) in "
                               f"[{GENERATOR_SEED_MIN}, {GENERATOR_SEED_MAX}]", param="seed")
        if params.stop_list and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; pass tokenizer=DIR or use stop_token_ids", param="stop")

    def abort_request(self, request_id: str) -> bool:
        """Finish the request now and free its blocks; False if it was not running."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.pending:
            s.status = SequenceStatus.FINISHED_ABORTED
        req.pending = []
        for s in req.seqs:
            if self._async is not None:
                self._async.forget(s)
            if not s.is_finished:
                self.scheduler.finish(s, SequenceStatus.FINISHED_ABORTED)
                s.finish_reason = "abort"
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (when no request runs): later requests recompute from scratch."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def _token_str(self, tid: int) -> str | None:
        if self.tokenizer is None:
            return None
        s = self._token_str_cache.get(tid)
        if s is None:
            s = self._token_str_cache[tid] = self.tokenizer.decode([tid])
        return s

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the RequestOutputs (cumulative) of every request that
        produced a token or finished in it."""
        t0 = time.perf_counter()
        touched: dict[str, Request] = {}
        self._failed_now = {}
        a = self._async
        if a is not None:
            p = a.pending
            try:
                a.before_schedule(touched)
            except Exception as exc:                 # reading the pending step failed: its requests fail
                a.pending = None
                self._fail_step([s for s, k in zip(p.seqs, p.keep) if k] if p is not None else [], exc)
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            pipelined = a is not None and a.eligible_step(sched)
            if not pipelined and a is not None and a.pending is not None:
                raise AssertionError("async decode: a step that cannot be pipelined was scheduled over placeholders")
            try:
                if pipelined:
                    a.run(sched, touched)
                    self._fail_launched_rows(a.pending)
                else:
                    self._run(sched, touched)
            except Exception as exc:                 # the step as a whole: its requests fail, no others
                if a is not None:
                    a.pending = None                 # (its live sequences were all scheduled in this step)
                self._fail_step([s.seq for s in sched.scheduled], exc)
        elif self.scheduler.waiting and not self.scheduler.running:
            # cannot happen (a request alone always fits); fail loudly rather than spin
            raise MoetError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and none running")
        self._release_siblings()
        for rid, req in self._failed_now.items():
            touched[rid] = req
        outs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        st = self._stats
        st.last_step_time_s = time.perf_counter() - t0
        st.last_step_num_tokens = sched.num_tokens
        st.num_steps += 1
        return outs

    def _run(self, sched: SchedulerOutput, touched: dict[str, Request]) -> None:
        ids, batch = self.runner.build_batch(sched)
        hidden = self.runner.forward(ids, batch, self._fp4_prompt_rows(sched))
        if self.drafter is not None:
            return self._run_speculative(sched, batch, hidden, touched)
        sampling = [s for s in sched.scheduled if s.samples]
        logits = self.runner.logits(hidden[batch.logits_indices]) if sampling else None
        # prompt logprobs: rows predicting prompt tokens not yet covered
        for b, s in enumerate(sched.scheduled):
            if s.seq.needs_prompt_logprobs and not s.seq.is_finished:
                try:
                    self._prompt_logprobs(s.seq, hidden, batch.cu_seqlens_q_host[b], s.context_len, s.num_new_tokens)
                except Exception as exc:
                    self._fail_seq(s.seq, exc)
        prompt_tokens = 0
        fp4_prompt = self.gate is not None and self.gate.fp4_prefill
        for s in sched.scheduled:
            seq = s.seq
            if seq.is_finished:                      # failed above: its blocks are already freed
                continue
            prompt_tokens += max(0, min(seq.num_prompt_tokens, s.context_len + s.num_new_tokens) - s.context_len)
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit_full_blocks(seq, seq.num_prompt_tokens if fp4_prompt else None)
        self._stats.prompt_tokens_total += prompt_tokens
        if not sampling:
            return
        if self.gate is not None:                    # unsure rows: their tokens from repaired logits
            logits = self.gate.apply(sampling, logits)
        seqs = [s.seq for s in sampling]
        # every row stays in the sample (a failed sequence's too): the other rows' tokens do not
        # depend on it, and the batch is the one the forward computed
        result = self.sampler(logits, seqs, self._token_str)
        for seq, tok, lp, lps in zip(seqs, result.token_ids, result.token_logprobs, result.logprobs):
            if seq.is_finished:                      # its request failed earlier in this step
                continue
            self._append(seq, tok, lp, lps)
            self._stats.generation_tokens_total += 1
            touched[seq.request_id] = self.requests[seq.request_id]

    def _run_speculative(self, sched: SchedulerOutput, batch, hidden: torch.Tensor,
                         touched: dict[str, Request]) -> None:
        """The rest of a step with MTP speculative decoding (engine/speculative.py): each sampling
        sequence's positions verified one after another, its kept positions counted as computed,
        then the MTP layer over every kept position and the next drafts."""
        # both read num_computed_tokens, which moves below
        drafts = [s.num_drafts for s in sched.scheduled]
        samples = [s.samples for s in sched.scheduled]
        starts = batch.cu_seqlens_q_host
        for b, s in enumerate(sched.scheduled):
            if s.seq.needs_prompt_logprobs and not s.seq.is_finished:
                try:
                    self._prompt_logprobs(s.seq, hidden, starts[b], s.context_len, s.num_new_tokens)
                except Exception as exc:
                    self._fail_seq(s.seq, exc)
        prompt_tokens = 0
        fp4_prompt = self.gate is not None and self.gate.fp4_prefill
        first = []                      # (sequence, first position, first hidden row) of each scheduled one
        for b, s in enumerate(sched.scheduled):
            seq = s.seq
            first.append((seq, s.context_len, starts[b]))
            if seq.is_finished:
                continue
            prompt_tokens += max(0, min(seq.num_prompt_tokens, s.context_len + s.num_new_tokens) - s.context_len)
            seq.num_computed_tokens += s.num_new_tokens - drafts[b]
            self.block_manager.commit_full_blocks(seq, seq.num_prompt_tokens if fp4_prompt else None)
        self._stats.prompt_tokens_total += prompt_tokens
        # verification: (scheduled index, its first verified row) of the sequences that sample
        alive = [(b, starts[b] + s.num_new_tokens - 1 - drafts[b]) for b, s in enumerate(sched.scheduled)
                 if samples[b] and not s.seq.is_finished]
        kept = [0] * len(sched.scheduled)
        # every verified row's logits in one head pass; position j reads its rows from it
        where, rows = {}, []
        for b, r in alive:
            for j in range(drafts[b] + 1):
                where[(b, j)] = len(rows)
                rows.append(r + j)
        every = self.runner.logits(hidden[torch.tensor(rows, device=hidden.device)]) if rows else None
        j = 0
        while alive:
            subset = [sched.scheduled[b] for b, _ in alive]
            logits = every[torch.tensor([where[(b, j)] for b, _ in alive], device=every.device)]
            repaired = set()
            if self.gate is not None:
                logits = self.gate.apply(subset, logits)
                repaired = self.gate.last_repaired_rows
            seqs = [s.seq for s in subset]
            result = self.sampler(logits, seqs, self._token_str)
            nxt = []
            for i, ((b, r), seq, tok, lp, lps) in enumerate(zip(alive, seqs, result.token_ids, result.token_logprobs,
                                                                 result.logprobs)):
                if seq.is_finished:
                    continue
                draft = seq.spec_token_ids[j] if j < drafts[b] else None
                if draft is not None and self.drafter.accept_all:     # bench only (MTPDrafter.accept_all)
                    tok = draft
                self._append(seq, tok, lp, lps)
                self._stats.generation_tokens_total += 1
                touched[seq.request_id] = self.requests[seq.request_id]
                if tok == draft and i not in repaired and not seq.is_finished:
                    kept[b] += 1
                    nxt.append((b, r))
                elif drafts[b]:
                    self.drafter.record(drafts[b], kept[b], kept[b] + 1)
            alive, j = nxt, j + 1
        rows = []
        for b, (seq, p, h) in enumerate(first):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += kept[b]
            self.block_manager.commit_full_blocks(seq, seq.num_prompt_tokens if fp4_prompt else None)
            rows.append((seq, p, h, seq.num_computed_tokens - p))
        self.drafter.propose(rows, hidden)

    def _fp4_prompt_rows(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """With the gate's FP4 prefill: a bool mask over the step's rows, True at prompt positions
        (they compute with FP4 experts); None when the step has none. Marks those sequences' FP4 KV
        (Sequence.repaired_upto) for the gate's reach."""
        if self.gate is None or not self.gate.fp4_prefill:
            return None
        mask: list[bool] = []
        for s in sched.scheduled:
            c, n, p = s.context_len, s.num_new_tokens, s.seq.num_prompt_tokens
            mask.extend(c + j < p for j in range(n))
            if c < p:
                s.seq.repaired_upto = max(s.seq.repaired_upto, min(c + n, p) - 1)
        if not any(mask):
            return None
        return torch.tensor(mask, dtype=torch.bool, device=self.device)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, row0: int, ctx: int, n: int) -> None:
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        k = seq.params.prompt_logprobs
        first = len(seq.prompt_logprobs) - 1          # position whose logits predict the next missing token
        last = min(ctx + n, seq.num_prompt_tokens - 1)   # exclusive: position num_prompt-1 predicts output
        if first < ctx or first >= last:
            return
        rows = hidden[row0 + first - ctx: row0 + last - ctx]
        lp = self.runner.logits(rows).float().log_softmax(-1)
        for j in range(last - first):
            p = first + j
            seq.prompt_logprobs.append(position_logprobs(lp[j], seq.token_ids[p + 1], k, self._token_str))

    def _append(self, seq: Sequence, tok: int, lp: float, lps) -> None:
        seq.append_token(tok)
        self._after_token(seq, tok, lp, lps)

    def _after_token(self, seq: Sequence, tok: int, lp: float, lps) -> None:
        """seq's newest token `tok` is in place: logprobs, stop / length checks, finish. A
        failed sampling row (seq.error) or a fault here fails seq's request alone."""
        if seq.error is not None:
            seq.token_ids.pop()                      # the failed row's token is no token
            self._fail_seq(seq, seq.error)
            return
        g = seq.grammar
        if g is not None and (g.dead_end or not g.accept(tok)):
            seq.token_ids.pop()                      # its grammar allowed no token: nothing was sampled
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            seq.finish_reason = DEAD_END
            if seq.detok is not None:
                seq.detok.finish()
            return
        try:
            self._check_token(seq, tok, lp, lps)
        except Exception as exc:
            self._fail_seq(seq, exc)

    def _check_token(self, seq: Sequence, tok: int, lp: float, lps) -> None:
        seq.cumulative_logprob += lp
        if seq.output_logprobs is not None:
            seq.output_logprobs.append(lps)
        sp = seq.params
        status = None
        if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in (sp.stop_token_ids or ()):
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, (tok if tok in (sp.stop_token_ids or ()) else None)
            if seq.detok is not None:
                seq.detok.finish()
        elif seq.detok is not None:
            hit = seq.detok.update()
            if hit is not None:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, hit
        if status is None and seq.num_output_tokens >= seq.max_new_tokens:
            status = SequenceStatus.FINISHED_LENGTH
            if seq.detok is not None:
                seq.detok.finish()
        if status is not None:
            self.scheduler.finish(seq, status)
            seq.finish_reason = FINISH_REASONS[status]

    def _release_siblings(self) -> None:
        for req in self.requests.values():
            if req.pending:
                first = req.seqs[0]
                if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens - 1:
                    for s in req.pending:
                        self.scheduler.add(s)
                    req.pending = []

    # ------------------------------------------------------------------ failures

    def _fail_seq(self, seq: Sequence, exc: BaseException) -> None:
        """A fault in seq's own work: its request fails, alone (RequestFailed)."""
        req = self.requests.get(seq.request_id)
        if req is None or req.error is not None:
            return
        log.error("request %r failed inside the engine; the other requests go on", seq.request_id, exc_info=exc)
        self._fail_request(req, RequestFailed(
            f"request {seq.request_id!r} failed inside the engine ({type(exc).__name__}: {exc}); "
            "the engine and its other requests go on"))

    def _fail_step(self, seqs: list[Sequence], exc: BaseException) -> None:
        """The step itself failed: fail the requests of the sequences it ran (each with an
        error of its own), none other; the engine serves on."""
        reqs = {s.request_id: self.requests[s.request_id] for s in seqs
                if s.request_id in self.requests and not self.requests[s.request_id].finished}
        log.error("engine step failed; failing its %d request(s): %s", len(reqs), ", ".join(map(repr, reqs)),
                  exc_info=exc)
        for req in reqs.values():
            self._fail_request(req, MoetError(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _fail_request(self, req: Request, err: Exception) -> None:
        """Finish every sequence of req now (finish_reason "error", blocks freed) and report it
        in this step's outputs with `error`."""
        if req.error is not None:
            return
        req.error = err
        for s in req.pending:                         # never scheduled: not in the scheduler's queues
            s.status, s.finish_reason = SequenceStatus.FINISHED_FAILED, "error"
        req.pending = []
        for s in req.seqs:
            if self._async is not None:
                self._async.forget(s)
            if not s.is_finished:
                self.scheduler.finish(s, SequenceStatus.FINISHED_FAILED)
                s.finish_reason = "error"
        self._failed_now[req.request_id] = req

    def _fail_launched_rows(self, pending) -> None:
        """Rows of a pipelined step's sample that failed at launch: fail them now rather than
        at the next step's read (their sequences would be computed once more for nothing)."""
        if pending is None or not pending.sample.failed:
            return
        for b, exc in pending.sample.failed.items():
            seq = pending.seqs[b]
            if pending.keep[b] and not seq.is_finished:
                self._fail_seq(seq, exc)

    def _output(self, req: Request) -> RequestOutput:
        try:
            return self._build_output(req)
        except Exception as exc:                     # building this one output: this request fails
            self._fail_seq(req.seqs[0], exc)         # (also when it had just finished: its end was not sent)
            outs = [CompletionOutput(s.index, "", s.output_token_ids, s.cumulative_logprob, None,
                                     s.finish_reason or "error", s.stop_reason) for s in req.seqs]
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, None, outs, finished=True,
                                 error=req.error)

    def _build_output(self, req: Request) -> RequestOutput:
        finished = req.finished
        outs = []
        for s in req.seqs:
            text = s.detok.visible_text(s.is_finished) if s.detok is not None else ""
            outs.append(CompletionOutput(s.index, text, s.output_token_ids, s.cumulative_logprob,
                                         list(s.output_logprobs) if s.output_logprobs is not None else None,
                                         s.finish_reason, s.stop_reason))
        plp = req.seqs[0].prompt_logprobs if req.params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, plp, outs, finished=finished,
                             error=req.error)

    # ------------------------------------------------------------------ statistics

    def stats(self) -> EngineStats:
        st = self._stats
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting) + sum(len(r.pending) for r in self.requests.values())
        st.kv_usage = self.block_manager.usage
        st.num_free_kv_blocks = self.block_manager.num_free_blocks
        st.prefix_cache_hit_rate = self.block_manager.prefix_hit_rate
        st.num_preemptions = self.scheduler.num_preemptions
        st.extra["cuda_graphs"] = float(len(self.runner.graphs) + len(self.runner.verify_graphs) +
                                        sum(len(gs.graphs) for gs in self.runner.repair_graphs.values()) +
                                        sum(len(gs.graphs) for gs in self.runner.draft_graphs.values()) +
                                        (len(self.runner.long_decode_graphs.graphs)
                                         if getattr(self.runner, "long_decode_graphs", None) is not None else 0))
        if self._jit is not None:
            st.extra.update(self._jit.snapshot())
        st.extra.update(self._gc.snapshot())
        if self._async is not None:
            st.extra["async_pipelined_steps"] = float(self._async.num_pipelined_steps)
            st.extra["async_sync_resolves"] = float(self._async.num_sync_resolves)
        if self.residency is not None:
            st.extra.update(self.residency.stats())
        if self.gate is not None:
            st.extra.update(self.gate.stats(st.generation_tokens_total))
        if self.drafter is not None:
            st.extra.update(self.drafter.stats())
        return EngineStats(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(st).items()})

    def generate_all(self, requests: list[tuple[str, Any, SamplingParams]], progress=None) -> dict[str, RequestOutput]:
        """Add every request, step until all finish; the last RequestOutput of each."""
        for rid, prompt, sp in requests:
            self.add_request(rid, prompt, sp)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        return done


def check_speculative(config: EngineConfig, spec) -> None:
    """--speculative-config against the checkpoint, before any weight is read."""
    if not config.scheduler.num_speculative_tokens:
        return
    if not spec.num_mtp_layers:
        raise ConfigError("--speculative-config asks for MTP drafts but this checkpoint has no MTP layer "
                          "(num_nextn_predict_layers is 0 or absent in its config.json); drop the flag")
    if spec.compressed_attention is not None:
        raise ConfigError("--speculative-config: DeepSeek-V4's MTP layer is not built in moet yet (its weights "
                          "are skipped at load); drop the flag")
    if spec.linear_attention is not None:
        raise ConfigError("--speculative-config: Qwen3.5's MTP block is not built in moet yet, and a rejected draft "
                          "would need the gated DeltaNet layers' state rewound; drop the flag")
    if not config.load.load_mtp:
        raise ConfigError("--speculative-config needs the MTP layers loaded: drop --no-load-mtp")
