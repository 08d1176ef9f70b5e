"""What `moet bench` times: a named real shape with random weights built on the device
(moet.bench.shapes), or a checkpoint loaded the way `moet serve` loads it; and the engine over
it, configured by the same EngineConfig flags as serve and generate."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moet.errors import ConfigError


@dataclass
class Settings:
    """One `moet bench` run, checked before anything loads."""
    scenarios: list[str]
    device: torch.device
    shape: str | None                 # a key of shapes.SHAPES, or None: the checkpoint `model`
    layers: int | None                # --layers: only the shape's first N decoder layers
    model: str                        # the checkpoint (serve always runs one; decode etc. without --shape)
    engine_kw: dict                   # EngineConfig fields the user set (model and device excluded)
    batches: list[int]
    tokens: list[int]
    decode_tokens: int
    prompt_len: int
    peer: str | None
    budget: object                    # moet.bench.timing.Budget
    gpu_budgets: list[str]
    residency_batches: list[int]
    requests: int
    concurrency: int
    report: object = None             # moet.bench.report.Report
    greedy: dict = field(default_factory=dict)   # moet's batch-1 greedy ids, for the peer's comparison
    gate_fire: list[float] = field(default_factory=list)   # decode: forced gate fire rates (--gate-fire)
    speculative: list[int] = field(default_factory=list)   # decode: MTP drafts per step to time (--speculative)
    accept_all: bool = False          # decode: every draft kept (--accept-all: the verify step's cost)
    structured: bool = False          # decode: free and grammar-constrained decoding, in one run


@dataclass
class Target:
    label: str                        # the shape's display name or the checkpoint's directory name
    cfg: dict                         # config.json fields
    model: object
    engine: object
    device: torch.device
    expert_format: str
    checkpoint: str | None = None
    facts: dict = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return int(self.cfg["vocab_size"])

    def close(self) -> None:
        """Free the engine and the model (the peer and the next scenario need the memory)."""
        self.engine.close()
        self.engine = self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checkpoint_config(path: str) -> dict:
    from moet.checkpoint.resolve import resolve_checkpoint

    p = Path(resolve_checkpoint(path))
    try:
        return json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json; pass a checkpoint directory or use --shape") from None


def target_label(s: Settings) -> str:
    from moet.bench.shapes import cut_shape
    return cut_shape(s.shape, s.layers)[0] if s.shape else Path(str(s.model)).name


def engine_config(s: Settings, **kw):
    """EngineConfig of engine_kwargs(s, ...)."""
    from moet.config import EngineConfig
    return EngineConfig(**engine_kwargs(s, **kw))


def engine_kwargs(s: Settings, *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int | None,
                  **over) -> dict:
    """EngineConfig of the user's flags; what the bench needs fills only what they left unset:
    room for the largest batch and the longest request, and no start-up compile ladder (the bench
    warms up what it times itself). Flat EngineConfig keyword arguments."""
    kw = dict(s.engine_kw)
    kw.setdefault("max_model_len", max_model_len)
    kw.setdefault("max_num_seqs", max_num_seqs)
    if max_num_batched_tokens is not None:
        kw.setdefault("max_num_batched_tokens", max_num_batched_tokens)
    kw.setdefault("compile_warmup", False)
    if kw["max_num_seqs"] < max_num_seqs:
        raise ConfigError(f"--max-num-seqs {kw['max_num_seqs']} is below the largest --batch {max_num_seqs}")
    kw.update(over)
    return dict(kw, device=str(s.device))


def open_target(s: Settings, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> Target:
    """The engine over the shape (random weights on the device) or the checkpoint."""
    from moet.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    if s.shape:
        from moet.bench.shapes import cut_shape, random_model
        name, cfg = cut_shape(s.shape, s.layers)
        ec = engine_config(s, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, model=f"random:{cfg['model_type']}")
        dtype = torch.bfloat16 if ec.load.dtype == "auto" else getattr(torch, ec.load.dtype)   # a shape's torch_dtype
        # the FP4 repair tier only when the gate is timed (--gate-fire): on random weights the
        # confidence means nothing, so the gate would fire on every step
        repair = bool(s.gate_fire) and ec.load.expert_format == "w2"
        if not repair:
            ec = replace(ec, gate=replace(ec.gate, fp4_gate=False))
        if any(s.speculative):
            ec = replace(ec, scheduler=replace(ec.scheduler, speculative_config={
                "method": "mtp", "num_speculative_tokens": max(s.speculative)}))
        try:
            model = random_model(cfg, s.device, ec.load.expert_format, dtype=dtype, repair_tier=repair,
                                 mtp=any(s.speculative))
            sync(s.device)
            eng = LLMEngine(ec, model, None, {int(cfg["eos_token_id"])}, s.device, ec.scheduler.max_model_len)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(f"--shape {s.shape} with {ec.load.expert_format} experts does not fit this GPU "
                              f"({str(exc).splitlines()[0][:160]}); try --expert-format w2 or moet bench "
                              f"residency") from None
        t = Target(name, cfg, model, eng, s.device, ec.load.expert_format)
    else:
        cfg = checkpoint_config(s.model)
        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": max(s.speculative)}} \
            if any(s.speculative) else {}
        ec = engine_config(s, max_model_len=min(max_model_len, int(cfg.get("max_position_embeddings", max_model_len))),
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, model=str(s.model),
                           **spec)
        eng = LLMEngine.from_config(ec)
        t = Target(Path(str(s.model)).name, cfg, eng.runner.model, eng, s.device, ec.load.expert_format,
                   checkpoint=str(eng.checkpoint.path))
    t.facts = {"build_s": round(time.perf_counter() - t0, 2), "num_kv_blocks": eng.runner.num_blocks,
               "kv_cache_gib": round(eng.runner.kv_cache_bytes / 2**30, 3), "max_model_len": eng.max_model_len,
               "cuda_graph_buckets": sorted(eng.runner.graphs), "graph_error": eng.runner.graph_error}
    if s.device.type == "cuda":
        t.facts["gpu_mem_allocated_gib"] = round(torch.cuda.memory_allocated(s.device) / 2**30, 2)
    return t
