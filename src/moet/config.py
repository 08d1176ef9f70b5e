"""EngineConfig: every knob of the engine in one dataclass.

Each field is an `LLM(...)` keyword with the same name and a CLI flag with dashes
(`expert_format` -> `--expert-format`); `add_cli_arguments` / `from_cli_args` derive the flags
from the fields, so the two cannot drift. The help text lives in each field's metadata and
doubles as its documentation. Nothing is read from environment variables. `validate()` turns a
bad value into a ConfigError naming the field and the accepted values, before any file is opened.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from moet.errors import ConfigError

EXPERT_FORMATS = ("w2", "fp4", "bf16")
DTYPES = ("auto", "bfloat16", "float16", "float32")
W2_ZERO_MODES = ("auto", "sign", "alt")
W2_SCALE_RULES = ("published", "mse")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
EXPERT_CACHE_POLICIES = ("decayed", "lru")
PACK_VERIFY_MODES = ("lazy", "full")
EXPERT_DECODE_MODES = ("graph", "eager", "auto")


def _knob(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str = field(metadata={"help": "checkpoint directory (Hugging Face layout: config.json + "
                                         "*.safetensors [+ index])"})
    tokenizer: str | None = _knob(None, "tokenizer directory; default: the checkpoint directory")
    expert_format: str = _knob(
        "w2", "how routed experts are held for compute: w2 (2-bit sign-symmetric code, SPEC 2.1), "
              "fp4 (NVFP4 layout: e2m1 + e4m3 block-16 scales + fp32 scale_2), or bf16 (the checkpoint's "
              "values decoded to the model dtype: the reference, most memory)", EXPERT_FORMATS)
    dtype: str = _knob(
        "auto", "activation / dense-weight dtype; auto = the checkpoint's torch_dtype for float "
                "checkpoints, bfloat16 for quantized (FP8 / NVFP4 / MXFP4) ones", DTYPES)
    device: str = _knob("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    max_model_len: int | None = _knob(None, "longest prompt + generation in tokens; default: the "
                                            "config's max_position_embeddings")
    allow_long_max_model_len: bool = _knob(
        False, "accept a max_model_len beyond the checkpoint's trained context (max_position_embeddings); "
               "outputs past it may be wrong")
    seed: int = _knob(0, "seed of the sampler when a request gives no seed of its own")
    w2_zero_mode: str = _knob(
        "auto", "sign rule for exact zeros when re-quantizing experts to W2 (moet.formats.w2): auto "
                "alternates them by K parity when >95 percent share one sign", W2_ZERO_MODES)
    w2_scale_rule: str = _knob(
        "published", "block exponent rule when re-quantizing experts to W2: published (round(log2(amax/6)), "
                     "the original design's) or mse (least squared error per block; docs/formats.md)", W2_SCALE_RULES)
    trust_remote_code: bool = _knob(False, "allow a tokenizer that ships its own Python code (e.g. Kimi-K2's "
                                           "tiktoken tokenizer); model code is never run, moet has its own")
    load_mtp: bool = _knob(True, "load the checkpoint's MTP layers (kept for speculative decoding); "
                                 "false saves their memory")
    # ---- serving engine (moet/engine): paged KV cache and scheduler
    block_size: int = _knob(16, "tokens per KV cache block (page); a power of two")
    kv_cache_dtype: str = _knob(
        "auto", "KV cache element type: auto (the model dtype), bf16, or fp8 (e4m3 with one dynamic scale "
                "per token and 128-element group: half of bf16's bytes)", KV_CACHE_DTYPES)
    gpu_memory_utilization: float = _knob(
        0.9, "fraction of the GPU's memory moet may use in all (weights, activations, KV cache); the KV "
             "cache gets what is left after the weights and a profiled forward of max_num_batched_tokens")
    kv_cache_memory_gb: float | None = _knob(
        None, "KV cache size in GiB, overriding gpu_memory_utilization; on CPU the default is what "
              "max_num_seqs sequences of max_model_len tokens need, at most 4 GiB")
    num_kv_blocks: int | None = _knob(None, "exact number of KV cache blocks, overriding every memory "
                                            "budget (tests, reproducing a run)")
    max_num_seqs: int = _knob(64, "most sequences running at once (decode batch size); CUDA graphs are "
                                  "captured for decode batches of 1, 2, 4, ... up to this")
    max_num_batched_tokens: int = _knob(
        8192, "most tokens one engine step computes (prefill chunks + decodes); with chunked prefill off "
              "it must be at least max_model_len")
    enable_prefix_caching: bool = _knob(True, "reuse the KV blocks of identical prompt prefixes "
                                              "(chained hashes of full blocks)")
    enable_chunked_prefill: bool = _knob(True, "split long prompts across steps so they share steps with "
                                               "running decodes (bounds inter-token latency)")
    enforce_eager: bool = _knob(False, "never capture CUDA graphs for decode (slower; for debugging)")
    overlap_shared_experts: bool = _knob(
        True, "on CUDA, compute the shared experts on a second stream while the routed experts run "
              "(decode graphs included); outputs bit-identical either way (H200, GLM-4.5-Air W2: "
              "133.3 vs 124.0 tok/s single stream, 998 vs 982 at 32 streams)")
    async_scheduling: bool = _knob(
        True, "pure decode steps launch before the previous step's tokens reach the host (the sampled ids "
               "feed the next step on the device; the host processes step N while step N+1 runs), so the GPU "
               "does not idle through scheduling and output processing; the same tokens as synchronous "
               "steps, except that a sequence stopping on a stop token or string is computed once more "
               "(dropped), which can move other rows' last bits in batch-variant kernels. Sequences with "
               "repetition / frequency / presence penalties, and the expert store, run synchronously (H200, "
               "GLM-4.5-Air W2, 2026-12-01, same run: single stream 152.6 vs 145.6 tok/s, 32 streams 1,605 vs "
               "1,532)")
    compile_warmup: bool = _knob(
        True, "on CUDA, before the first request: one prefill at each token count 1, 2, 3, 4, 5, 8, 9, ... "
              "2^k, 2^k + 1 up to max_num_batched_tokens, then groups of 2, 3, 4, 5, 8, 9, ... concurrent "
              "requests (up to max_num_seqs) over a cached prefix with two decode steps each, so the kernel "
              "variants a step can pick (Triton compiles one per new specialization on first use) are compiled "
              "at start-up, not while every running stream waits. Seconds on a first start, "
              "less with Triton's on-disk cache. Not with the expert store (its hot set would learn the "
              "warm-up's random prompts)")
    attention_fused_merge: bool = _knob(
        False, "GQA paged decode on CUDA: each sequence's split partials merged by the split kernel's last "
               "program instead of a second launch (one launch a layer fewer). Off: slower on the H200 (run 18: "
               "0.69x at batch 1, 32K; GLM-4.5-Air single stream 158.4 vs 161.5 tok/s); "
               "process-wide once set, fixed for the model (it may move the last bits, like the split count)")
    small_kernel_pdl: bool = _knob(
        True, "on sm_90+, launch the small Triton kernels of a step (norms, q/k rotary, KV store, attention "
               "decode and split merge, router GEMV and top-k) with programmatic dependent launch: each one's "
               "launch and ramp-up overlap the kernel before, same results (the grouped MoE kernels take "
               "theirs from their launch table). Measured on the H200 (2026-12-01, run 18): GLM-4.5-Air single stream 161.5 vs "
               "153.9 tok/s, Qwen3-30B-A3B 367.9 vs 336.6, greedy outputs bit-identical; process-wide once set")
    # ---- expert residency (moet/store): pack file on disk -> host arena -> device expert cache
    pack_dir: str | None = _knob(
        None, "where pack files live (routed experts converted to expert_format once, keyed by checkpoint "
              "identity and quantizer options: the persistent quantization cache); setting it serves routed "
              "experts through the pack -> host arena -> device cache store; unset: ~/.cache/moet/packs, used "
              "only when the store is on (expert_cache_slots / expert_cache_gb set, or the experts do not fit)")
    expert_cache_slots: int | None = _knob(
        None, "device slots for routed experts (one slot = one expert in expert_format); unset with "
              "expert_cache_gb unset: every expert resident when they fit, else all that fits after weights and KV")
    expert_cache_gb: float | None = _knob(None, "device expert cache size in GiB (instead of expert_cache_slots)")
    expert_cache_policy: str = _knob(
        "decayed", "device cache eviction: decayed (recency-decayed use frequency) or lru", EXPERT_CACHE_POLICIES)
    host_arena_gb: float | None = _knob(
        None, "host memory for pack rows between disk and GPU (pinned when CUDA is available); 0 = read every "
              "miss from the pack; unset = the whole pack if it fits in half the available memory, else that half")
    miss_tolerance: int = _knob(
        0, "expert-cache misses (token, expert pairs) a step may keep instead of being replayed; 0 = strict: "
           "outputs bit-identical to every expert resident")
    expert_demand_fetch: bool = _knob(
        True, "with the expert store, eager passes (prefill and mixed steps) fetch each MoE layer's experts "
              "just before it runs (one host sync per layer) instead of replaying the step after a miss, so a "
              "prefill step may take max_num_batched_tokens through a cache that holds one layer's experts; "
              "captured decode steps keep miss replay")
    expert_decode_mode: str = _knob(
        "graph", "with the expert store, how decode steps run: graph (the captured CUDA graph; a pass that "
                 "missed is replayed), eager (not captured: every layer demand-fetches, one pass, no replay; "
                 "needs expert_demand_fetch), or auto (per batch bucket, whichever measured faster lately)",
        EXPERT_DECODE_MODES)
    expert_prefetch: bool = _knob(
        True, "with the expert store: after each layer's attention, apply the next layer's router to guess "
              "its experts and fetch the missing ones early (eager steps; CUDA-graph decode steps only score "
              "the guesses); never changes outputs, accuracy in the engine stats")
    pack_verify: str = _knob(
        "lazy", "pack checksums: lazy (each row when read from disk) or full (also every row at boot; damaged "
                "layers are rebuilt)", PACK_VERIFY_MODES)
    rebuild_pack: bool = _knob(False, "discard the pack and convert the checkpoint's experts again")
    o_direct: bool = _knob(False, "read pack rows with O_DIRECT (bypasses the page cache; the pack's "
                                  "file system must allow it)")
    expert_stats_interval_s: float = _knob(
        10.0, "with the expert store: log one INFO line of residency statistics (cache and arena hit rates, "
              "bytes moved per token, replay passes per step, fetch latency, prefetch accuracy) every this many "
              "seconds of engine steps; 0 = off")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not supported; choose one of {', '.join(choices)}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a checkpoint directory path")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be a positive integer or None")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two (16 is usual)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                              f"{self.max_num_seqs} (every running sequence decodes one token per step)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be positive (or unset)")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks!r} must be a positive integer (or unset)")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(f"without chunked prefill max_num_batched_tokens={self.max_num_batched_tokens} must be "
                              f">= max_model_len={self.max_model_len}; raise it or enable chunked prefill")
        if self.expert_cache_slots is not None and self.expert_cache_gb is not None:
            raise ConfigError("set expert_cache_slots or expert_cache_gb, not both")
        if self.expert_cache_slots is not None and (not isinstance(self.expert_cache_slots, int)
                                                    or self.expert_cache_slots < 1):
            raise ConfigError(f"expert_cache_slots={self.expert_cache_slots!r} must be a positive integer (or unset)")
        for name in ("expert_cache_gb", "host_arena_gb"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ConfigError(f"{name}={v!r} must be >= 0 (or unset)")
        if not self.expert_stats_interval_s >= 0:
            raise ConfigError(f"expert_stats_interval_s={self.expert_stats_interval_s!r} must be >= 0 (0 = off)")
        if not isinstance(self.miss_tolerance, int) or self.miss_tolerance < 0:
            raise ConfigError(f"miss_tolerance={self.miss_tolerance!r} must be an integer >= 0")
        if self.expert_decode_mode != "graph" and not self.expert_demand_fetch:
            raise ConfigError(f"expert_decode_mode={self.expert_decode_mode!r} runs decode steps eagerly with demand "
                              "fetch; it needs expert_demand_fetch on (or expert_decode_mode=graph)")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def add_cli_arguments(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """One flag per EngineConfig field (`model` is positional unless positional_model=False)."""
    for f in fields(EngineConfig):
        help_text = f.metadata.get("help", "")
        if f.name == "model" and positional_model:
            from moet.assets import default_model
            parser.add_argument("model", nargs="?", default=default_model(),
                                help=f"{help_text}; default: the shipped moet-tiny")
            continue
        default = None if f.default is MISSING else f.default
        t = str(f.type)  # annotations are strings here: "int | None", "bool", "str"
        kind = int if t.startswith("int") else float if t.startswith("float") else _parse_bool if t == "bool" else str
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                            choices=f.metadata.get("choices"), metavar=None if f.metadata.get("choices") else "X",
                            help=f"{help_text} (default: {default})")


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{n: getattr(args, n) for n in EngineConfig.field_names() if hasattr(args, n)})
