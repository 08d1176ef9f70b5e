"""`moet bench residency`: decode with the routed experts through the expert store (GPU expert
cache <- host arena <- pack file) on a card smaller than the model, against every expert
resident, on a named shape with random weights.

Correctness first: a tiny checkpoint through the LLM path with the expert cache capped to 10% /
25% / 50% of the experts must give greedy token ids and logprobs bit-identical to all resident
(else nothing is timed). Then the shape: all resident, decode tok/s at each --residency-batch;
its expert pools written as a pack; per --gpu-budget-gb (a card of that many GB, or "N%" of the
experts) the expert cache gets what the card leaves after the dense weights, a 2 GB KV cache and
2 GB of activations (when every expert fits, the card runs all resident: no store), the engine's
other store settings from the flags (--host-arena-gb, --miss-tolerance, --o-direct, ...). Each
card's engine must reproduce the resident greedy outputs (at --miss-tolerance 0, bit for bit),
then decode tok/s, the cache hit rate, bytes fetched per token, and `moet plan`'s prediction for
that configuration with measured / predicted. Every engine uses the same small step budget, so
the resident and cached runs see the same schedule. Random weights route close to uniformly:
hit rates here are a worst case for a cache (trained routers are skewed)."""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time

import torch

from moet.bench.decode import timed_run
from moet.bench.shapes import prompts
from moet.bench.target import Settings, sync

PCIE_GBPS = 55.0
KV_GB = 2.0              # what a card keeps for the KV cache and activations besides the experts
ACTIVATION_GB = 2.0
# the step budget of every engine here: small enough for the smallest cache to hold one step's
# experts, and the same everywhere so resident and cached outputs compare bit for bit
STEP_TOKENS = 4


def h2d_gbps(device, nbytes: int = 1 << 30) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


def outputs_of(done: dict) -> dict:
    return {rid: (o.outputs[0].token_ids, [{t: v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs])
            for rid, o in sorted(done.items())}


def compare(got: dict, want: dict) -> dict:
    same_ids = all(got[r][0] == want[r][0] for r in want)
    identical = got == want
    dlp = 0.0
    for r in want:
        for a, b in zip(got[r][1], want[r][1]):
            for t in set(a) & set(b):
                dlp = max(dlp, abs(a[t] - b[t]))
    return {"bit_identical": identical, "same_token_ids": same_ids, "max_abs_dlogprob": dlp}


# ---------------------------------------------------------------- correctness (tiny, LLM path)

def check_tiny(device, work: str, pcts=(10, 25, 50), prefetch: bool = True) -> dict:
    from moet.llm import LLM
    from moet.sampling_params import SamplingParams
    from moet.testing.tiny_checkpoint import make_checkpoint

    path = make_checkpoint(os.path.join(work, "tiny"), "qwen3_moe", "bf16", tokenizer=False, num_experts=40)
    kw = dict(expert_format="w2", dtype="float32", device=str(device), max_num_seqs=2, max_num_batched_tokens=2,
              num_kv_blocks=64, block_size=16, max_model_len=64, expert_prefetch=prefetch,
              fp4_gate=False)   # the store's own cost: bare W2 on both sides (the gate is timed by bench decode)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 7, 3)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)

    def run(llm):
        return {str(i): (o.outputs[0].token_ids, [{t: v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs])
                for i, o in enumerate(llm.generate(prompts, sp, use_tqdm=False))}

    ref = LLM(path, **kw)
    want = run(ref)
    del ref
    out = {}
    for pct in pcts:
        with LLM(path, pack_dir=os.path.join(work, "tiny-packs"), expert_cache_slots=80 * pct // 100, **kw) as llm:
            got = run(llm)
            st = llm.engine.stats().extra
        out[f"{pct}pct"] = dict(compare(got, want), replay_passes_per_step=st["expert_replay_passes_per_step"],
                                hit_rate=st["expert_cache_hit_rate"],
                                prefetch_precision=st["expert_prefetch_precision"],
                                prefetch_recall=st["expert_prefetch_recall"])
        print(f"[residency] tiny checkpoint, cache {pct}% of the experts: {out[f'{pct}pct']}", flush=True)
    out["ok"] = all(v["bit_identical"] for v in out.values())
    return out


# ---------------------------------------------------------------- the shape through the store

def moe_blocks(model) -> dict:
    return model.moe_blocks()


def drop_experts(model) -> None:
    """Every MoE block back to no pool, every expert absent (the memory goes with the last reference)."""
    from moet.store.expert_slots import ExpertSlots

    for b in model.moe_blocks().values():
        b.experts = ExpertSlots.absent(b.spec.router.num_experts)


def write_pack_from_pools(model, work: str, key: str):
    """The resident pools as a complete pack (sidecar + rows with checksums); (paths, meta, seconds)."""
    from moet.store.pack_builder import _fresh_file, quantizer
    from moet.store.pack_file import PackMeta, PackPaths, RowLayout, default_checksum, pool_rows

    blocks = moe_blocks(model)
    names = list(blocks)
    layout = RowLayout.of_pool("w2", blocks[names[0]].experts.pool)
    meta = PackMeta(tag="w2", checkpoint_identity=f"random-{key}", quantizer=quantizer("w2"), layers=names,
                    num_experts=model.spec.router.num_experts, row=layout.to_json(), checksum=default_checksum())
    paths = PackPaths.of(os.path.join(work, "packs"), meta.checkpoint_identity, "w2", "bench", 0)
    os.makedirs(os.path.dirname(paths.data), exist_ok=True)
    _fresh_file(paths, meta)
    from moet.store.pack_file import PackFile

    t = time.perf_counter()
    with PackFile(paths, meta, writable=True) as pf:
        for l, name in enumerate(names):
            pf.commit_layer(l, pf.write_layer(l, pool_rows(blocks[name].experts.pool, layout)))
    return paths, PackMeta.read(paths.sidecar), time.perf_counter() - t


def prefill_done_steps(prompt_len: int, batch: int, step_tokens: int) -> list[int]:
    """The step (1-based) in which each of `batch` equal prompts finishes its prefill under the
    scheduler's policy: running sequences in admission order take min(left, budget) tokens (a
    decoder takes 1), then waiting ones are admitted into what budget is left."""
    left: list[int] = []
    done: list[int | None] = []
    step, waiting = 0, batch
    while waiting or any(d is None for d in done):
        step += 1
        budget = step_tokens
        for j in range(len(left)):
            if budget == 0:
                break
            n = min(left[j], budget) if left[j] else 1
            if left[j]:
                left[j] -= n
                if not left[j]:
                    done[j] = step
            budget -= n
        while waiting and budget > 0:
            n = min(prompt_len, budget)
            left.append(prompt_len - n)
            done.append(step if n == prompt_len else None)
            budget -= n
            waiting -= 1
    return done  # type: ignore[return-value]


def decode_runs(eng, vocab: int, s: Settings, device) -> dict:
    """Decode tok/s at each --residency-batch. The small step budget prefills the B prompts one
    after another while the first sequences already decode and take budget from the later
    prefills: each request gets as many extra tokens as it decodes before the last prefill ends
    (prefill_done_steps), so all B then decode together for --decode-tokens steps; only those
    steps are timed."""
    from moet.sampling_params import SamplingParams

    out = {}
    for b in s.residency_batches:
        done = prefill_done_steps(s.prompt_len, b, eng.scheduler.max_num_batched_tokens)
        reqs = [(f"d{b}-{j}", p, SamplingParams(temperature=0.0, max_tokens=s.decode_tokens + max(done) - done[j] + 1,
                                                ignore_eos=True))
                for j, p in enumerate(prompts(b, s.prompt_len, vocab, 11))]
        r = timed_run(eng, reqs, device, min_running=b)
        eng.reset_prefix_cache()
        out[str(b)] = {k: r[k] for k in ("decode_tok_s", "e2e_tok_s", "generated", "wall_s", "decode_steps_s")}
    return out


def correctness_outputs(eng, vocab: int, prompt_len: int) -> dict:
    from moet.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    ps = [p[:n] for p, n in zip(prompts(2, prompt_len, vocab, 5), (prompt_len // 2 + 3, prompt_len))]
    done = eng.generate_all([(f"c{i}", p, sp) for i, p in enumerate(ps)])
    eng.reset_prefix_cache()
    return outputs_of(done)


def card_slots(card: str, dense_bytes: int, row_bytes: int, total_rows: int) -> tuple[int, str]:
    """Expert cache slots of a --gpu-budget-gb entry: N% of the experts, or what a card of N GB
    leaves after the dense weights, the KV cache and activations."""
    if card.endswith("%"):
        return max(1, int(total_rows * float(card[:-1]) / 100)), f"{card} of the experts"
    budget = float(card) * 2**30 - dense_bytes - (KV_GB + ACTIVATION_GB) * 2**30
    return max(0, int(budget // row_bytes)), f"{card} GB card"


def counters(res) -> dict:
    """Monotonic counters of the store (per-phase numbers are differences of two of these)."""
    c, a = res.cache, res.arena
    return {"pairs": c.pairs, "first_pass_missed_pairs": c.first_pass_missed_pairs,
            "demand_missed_pairs": c.demand_missed_pairs, "demand_rows": c.demand_rows, "passes": c.passes,
            "steps": c.steps, "tolerated_pairs": c.tolerated_pairs, "rows_fetched": c.rows_fetched,
            "bytes_fetched": c.bytes_fetched, "fetch_s": c.fetch_seconds, "pack_bytes_read": res.pack.bytes_read,
            "arena_hits": a.hits, "arena_misses": a.misses}


def plan_facts(model, key: str, dense_bytes: int, row_bytes: int):
    """store/plan.py's ModelFacts of the bench model (random weights, no checkpoint)."""
    from moet.store import plan as P

    spec = model.spec
    elem = next(model.parameters()).element_size()
    return P.ModelFacts(name=key, moe_layers=len(moe_blocks(model)), experts=spec.router.num_experts,
                        top_k=spec.router.top_k, row_bytes=row_bytes, dense_bytes=dense_bytes,
                        embedding_bytes=0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size * elem,
                        kv_bytes_per_token=P.kv_bytes_per_token_of(spec))


def plan_bandwidths(gbps: float | None):
    from moet.store import plan as P

    bw = P.Bandwidths()
    if gbps:
        bw.override("h2d_pinned_gbps", gbps, "measured in this run (moet bench residency)")
    return bw


def predicted(facts, gbps: float | None, slots: int, arena_bytes: int, s: Settings, runs: dict,
              miss_tolerance: int = 0, hit_rate: float | None = None) -> dict:
    """The plan's prediction per measured batch, and measured / predicted (store/plan.py compare)."""
    from moet.store import plan as P

    out = {}
    context = s.prompt_len + s.decode_tokens // 2           # mean context of the decode steps
    for b, r in runs.items():
        pl = P.plan_for_rows(facts, slots, arena_bytes, max_num_seqs=max(s.residency_batches), batch=int(b), context=context,
                             miss_tolerance=miss_tolerance, bandwidths=plan_bandwidths(gbps))
        out[b] = P.compare(pl, r.get("decode_tok_s"), hit_rate)
        if pl.prediction is not None:
            out[b].update(predicted_fetch_bytes_per_step=pl.prediction.fetch_bytes_per_step,
                          predicted_hbm_bytes_per_step=pl.prediction.hbm_bytes_per_step, context=context)
        else:
            out[b]["plan_error"] = pl.fit.message
    return out


def store_run(model, paths, meta, slots: int, s: Settings, max_model_len: int, want: dict,
              gbps: float | None, facts) -> dict:
    """One card: the engine over the expert store with `slots` cache slots and the user's store
    flags; correctness against all resident, then decode_runs, the store's counters and the plan."""
    from moet.engine.expert_residency import ExpertResidency
    from moet.engine.llm_engine import LLMEngine
    from moet.store.pack_file import PackFile

    if os.path.exists(paths.hot_set):
        os.unlink(paths.hot_set)                     # every card starts cold
    cfg = _store_config(s, max_model_len, slots)
    t = time.perf_counter()
    res = ExpertResidency(cfg, PackFile(paths, meta, o_direct=cfg.store.o_direct), model.spec, model, s.device)
    eng = LLMEngine(cfg, model, None, set(), s.device, max_model_len, residency=res)
    rec = {"slots": slots, "engine_start_s": time.perf_counter() - t, "miss_tolerance": cfg.store.miss_tolerance,
           "host_arena_gb": cfg.store.host_arena_gb, "o_direct": cfg.store.o_direct}
    try:
        rec["correctness"] = compare(correctness_outputs(eng, model.spec.vocab_size, s.prompt_len), want)
        strict = cfg.store.miss_tolerance == 0
        if strict and not rec["correctness"]["bit_identical"]:
            rec["error"] = "outputs differ from all resident at --miss-tolerance 0; nothing timed"
            return rec
        before = counters(res)
        rec["runs"] = runs = decode_runs(eng, model.spec.vocab_size, s, s.device)
        d = {k: v - before[k] for k, v in counters(res).items()}
        gen = sum(r["generated"] for r in runs.values())
        per_tok = d["bytes_fetched"] / max(1, gen)
        rec.update(counters=d, hit_rate=(1 - (d["first_pass_missed_pairs"] + d["demand_missed_pairs"]) / d["pairs"]
                                         if d["pairs"] else None),
                   passes_per_step=d["passes"] / d["steps"] if d["steps"] else None,
                   bytes_fetched_per_generated_token=per_tok,
                   pcie_bound_tok_s_55GBps=PCIE_GBPS * 1e9 / per_tok if per_tok else None,
                   engine_stats=dict(res.stats()))
        arena_gb = cfg.store.host_arena_gb
        arena = int((arena_gb if arena_gb is not None else meta.file_bytes / 2**30) * 2**30)
        rec["plan"] = predicted(facts, gbps, slots, arena, s, runs, cfg.store.miss_tolerance, rec["hit_rate"])
    finally:
        eng.close()
        drop_experts(model)                          # the cache's pool goes before the next one is made
        del eng, res
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def _store_config(s: Settings, max_model_len: int, slots: int | None):
    from moet.bench.target import engine_config

    over = {"expert_cache_slots": slots} if slots is not None else {}
    if "kv_cache_memory_gb" not in s.engine_kw and "num_kv_blocks" not in s.engine_kw:
        # a card's KV share, not what the free memory allows (that memory is the experts' here)
        over["kv_cache_memory_gb"] = KV_GB if s.device.type == "cuda" else 0.01
    return engine_config(s, max_model_len=max_model_len, max_num_seqs=max(s.residency_batches),
                         max_num_batched_tokens=STEP_TOKENS, model="random:bench", **over)


def run_residency(s: Settings) -> None:
    from moet.bench.shapes import cut_shape, random_model
    from moet.engine.llm_engine import LLMEngine
    from moet.errors import ConfigError
    from moet.store.pack_file import RowLayout

    report = s.report
    if not s.shape:
        raise ConfigError("moet bench residency runs a named shape: give --shape (e.g. --shape glm45air)")
    name, cfg = cut_shape(s.shape, s.layers)
    fmt = s.engine_kw.get("expert_format", "w2")
    if fmt != "w2":
        raise ConfigError(f"moet bench residency: the expert store holds W2 experts, not --expert-format {fmt}")
    work = tempfile.mkdtemp(prefix="moet-bench-residency-")
    try:
        gbps = h2d_gbps(s.device)
        report.note("residency", "h2d_GBps", gbps)
        tiny = check_tiny(s.device, work, (10, 25, 50) if s.device.type == "cuda" else (25,),
                          s.engine_kw.get("expert_prefetch", True))
        report.note("residency", "correctness_tiny", tiny)
        if not tiny["ok"]:
            report.note("residency", "error", "expert cache outputs differ from all resident (tiny model); "
                                              "nothing timed")
            return
        t = time.perf_counter()
        model = random_model(cfg, s.device)
        sync(s.device)
        blocks = model.moe_blocks()
        dense = sum(p.numel() * p.element_size() for p in model.parameters())    # pools are not parameters
        layout = RowLayout.of_pool("w2", next(iter(blocks.values())).experts.pool)
        total_rows = len(blocks) * model.spec.router.num_experts
        report.note("residency", "model", {"build_s": time.perf_counter() - t, "dense_gib": dense / 2**30,
                                           "experts_gib": total_rows * layout.row_bytes / 2**30, "rows": total_rows})
        done = prefill_done_steps(s.prompt_len, max(s.residency_batches), STEP_TOKENS)
        max_model_len = s.prompt_len + s.decode_tokens + max(done) - done[0] + 1 + 64
        eng = LLMEngine(_store_config(s, max_model_len, None), model, None, set(), s.device, max_model_len)
        want = correctness_outputs(eng, model.spec.vocab_size, s.prompt_len)
        runs = decode_runs(eng, model.spec.vocab_size, s, s.device)
        del eng
        gc.collect()
        facts = plan_facts(model, s.shape, dense, layout.row_bytes)
        plan = predicted(facts, gbps, total_rows, 0, s, runs)
        for b, r in runs.items():
            report.add({"scenario": "residency", "shape": name, "system": "moet", "batch": int(b),
                        "series": "all resident", "config": f"moet w2, all experts resident, batch {b}",
                        "tok_s": r["decode_tok_s"], "details": r | {"plan": plan.get(b)}})
        paths, meta, write_s = write_pack_from_pools(model, work, s.shape)
        report.note("residency", "pack", {"gib": meta.file_bytes / 2**30, "write_s": write_s})
        drop_experts(model)                             # from here on experts come from the store only
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
        for card in s.gpu_budgets:
            slots, what = card_slots(card, dense, layout.row_bytes, total_rows)
            top = len(blocks) * model.spec.router.top_k
            if slots >= total_rows:
                report.note("residency", what, "every expert fits: the card runs all resident (no store)")
                continue
            if slots < top:
                report.note("residency", what, f"{slots} cache slots, fewer than one token needs ({top}): "
                                               f"the card cannot run this shape")
                continue
            if not s.budget.ok(60):
                report.note("residency", what, "skipped: time budget (--budget-s) spent")
                continue
            try:
                rec = store_run(model, paths, meta, slots, s, max_model_len, want, gbps, facts)
            except Exception as exc:                    # keep the other cards' numbers
                report.note("residency", what, f"error: {type(exc).__name__}: {exc}")
                continue
            if "error" in rec:
                report.note("residency", what, rec)
                continue
            for b, r in rec["runs"].items():
                ratio = (r["decode_tok_s"] / runs[b]["decode_tok_s"]
                         if r["decode_tok_s"] and runs[b]["decode_tok_s"] else None)
                pl = rec["plan"].get(b) or {}
                report.add({"scenario": "residency", "shape": name, "system": "moet", "batch": int(b),
                            "series": what, "tok_s": r["decode_tok_s"],
                            "config": f"moet w2, {what}" + ("" if card.endswith("%") else
                                                            f" (cache: {slots / total_rows:.0%} of the experts)")
                                      + f", batch {b}",
                            "notes": f"hit rate {rec['hit_rate'] or 0:.2f}, "
                                     f"{rec['bytes_fetched_per_generated_token'] / 2**20:.1f} MiB fetched/token, "
                                     f"{ratio or 0:.2f}x resident, plan predicted "
                                     f"{pl.get('predicted_tok_s') or 0:.1f} tok/s",
                            "details": r | {k: v for k, v in rec.items() if k != "runs"}})
        del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
