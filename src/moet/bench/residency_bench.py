"""Issue 7 "Measured": decode with routed experts through the residency store (device expert
cache <- host arena <- pack file) against every expert resident, on a model whose W2 experts do
not fit the GPU budget given (a 32 GB / 96 GB card emulated by capping the cache's slots).

    PYTHONUNBUFFERED=1 python -m moet.bench.residency_bench --out $OUT --budget-s 540 \
        [--model glm45air] [--cards 32,96,25%] [--batch 4] [--decode-tokens 32] [--boot-layers 2] [--cpu-smoke]
        [--accelerate-layers 2] [--expert-prefetch 1] [--skip-boot] [--skip-model]

Stages (each prints as it goes; $OUT/residency_bench.json is rewritten after each):
0. pinned host -> device bandwidth of a 1 GiB copy: the measured PCIe bound next to 55 GB/s.
1. correctness first (exit 1 on failure): a tiny qwen3_moe checkpoint through the LLM path on
   the device, the expert cache capped to 10% / 25% / 50%: greedy token ids AND logprobs of 3
   batched prompts with chunked prefill bit-identical to all experts resident.
2. first boot vs boot from pack: a bf16 checkpoint of the model's expert tensors for
   --boot-layers MoE layers (random values, written here); open_pack in a child process twice
   (quantize + write, then reuse): seconds, GB/s, the child's peak RSS vs the largest shard;
   extrapolated to the full layer count (the checkpoint was just written: its pages are warm,
   so this is conversion + pack write speed, not cold-disk reading).
3. the full-shape model with random weights made on the device (engine_bench.random_model), all
   experts resident: decode tok/s at batch 1 and --batch; its expert pools written as a pack
   (pwrite + fdatasync; the pack rows are the resident pools' bytes).
4. per card (--cards, GB; "N%" = that share of the experts): the cache gets what the card
   leaves after the dense weights, a --kv-gb KV cache and --activation-gb; when every expert
   fits, the card is reported as all resident (no store). Otherwise for (a) cache + a pinned
   arena holding the whole pack and (b) cache + pack read with O_DIRECT + a --small-arena-gb
   arena: strict greedy ids + logprobs equal to resident (else its timings are skipped), then
   decode tok/s at miss tolerance 0 and 8, hit rates, replay passes, bytes fetched per token and
   the PCIe bound (those bytes / 55 GB/s and / the measured bandwidth).
Every engine uses the same step budget (--step-tokens), so the resident and cached runs see
the same schedule and their logprobs can be compared bit for bit. Random weights route close
to uniformly: hit rates here are a worst case for a cache (real routers are skewed).
5. transformers + accelerate offloading side by side (accelerate_stage): the shape cut to
   --accelerate-layers MoE layers in BF16 (random init on the host), device_map from
   infer_auto_device_map with max_memory capping the GPU at the card's share of the BF16
   weights, dispatch_model (the rest offloaded to host memory); decode tok/s at batch 1 on the
   cut model and extrapolated to the full layer count. Needs accelerate (extra `bench`); the GPU
   box has no network: `pip download accelerate==1.15.0 --no-deps -d .whl/bench` here, carry
   .whl/bench (git-ignored) with the run and `pip install --no-deps .whl/bench/accelerate-*.whl`
   first; without it the stage is skipped with that message.
Every decode measurement of stages 3-4 also records `moet plan`'s prediction for that
configuration (store/plan.py: the same slots, arena, batch, context and miss tolerance; HBM and
disk bandwidths at their defaults, host-to-device at stage 0's measurement) and
measured / predicted, under "plan" next to the runs.
--cpu-smoke: a tiny shape on CPU, cards "50%,100%" (tests this harness; numbers meaningless).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from moet.bench.timing import Budget, device_info, fail, log, out_dir, write_json

PCIE_GBPS = 55.0
BOOT_CHILD = r"""
import json, resource, sys, time, torch
from moet.checkpoint import open_checkpoint
from moet.store import open_pack
t = time.perf_counter()
with open_pack(open_checkpoint(sys.argv[1]), sys.argv[2], device=sys.argv[3]) as p:
    built, nbytes = p.built_layers, p.meta.file_bytes
print(json.dumps({"seconds": time.perf_counter() - t, "built_layers": built, "pack_bytes": nbytes,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


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


# ---------------------------------------------------------------- 1. correctness (tiny, LLM path)

def check_tiny(device, work: str, pcts=(10, 25, 50), prefetch: bool = True) -> dict:
    from moet.llm import LLM
    from moet.sampling_params import SamplingParams
    from moet.testing.tiny_checkpoint import make_checkpoint

    path = make_checkpoint(os.path.join(work, "tiny"), "qwen3_moe", "bf16", tokenizer=False, num_experts=40)
    kw = dict(expert_format="w2", dtype="float32", device=str(device), max_num_seqs=2, max_num_batched_tokens=2,
              num_kv_blocks=64, block_size=16, max_model_len=64, expert_prefetch=prefetch)
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
        log(f"tiny {pct}%: {out[f'{pct}pct']}")
    out["ok"] = all(v["bit_identical"] for v in out.values())
    return out


# ---------------------------------------------------------------- 2. first boot vs boot from pack

def write_expert_checkpoint(path: str, cfg: dict, moe_layers: int, device) -> dict:
    """config.json (cut to `moe_layers` MoE layers) + one bf16 safetensors shard per layer holding
    only the routed-expert tensors (all open_pack reads), values ~N(0, 0.02) made on `device`."""
    from safetensors.torch import save_file

    from moet.checkpoint.spec import spec_from_config

    dense_first = int(cfg.get("first_k_dense_replace", 0))
    cut = dict(cfg, num_hidden_layers=dense_first + moe_layers, num_nextn_predict_layers=0)
    if "mlp_only_layers" in cut:
        cut["mlp_only_layers"] = [l for l in cut["mlp_only_layers"] if l < cut["num_hidden_layers"]]
    spec = spec_from_config(cut, "bench shape")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cut, f)
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.router.num_experts
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map, largest = {}, 0
    for n, layer in enumerate(spec.moe_layers):
        shard = f"model-{n + 1:05d}-of-{len(spec.moe_layers):05d}.safetensors"
        tensors = {}
        for x in range(e):
            for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
                tensors[f"model.layers.{layer}.mlp.experts.{x}.{proj}.weight"] = t.cpu()
        save_file(tensors, os.path.join(path, shard))
        largest = max(largest, os.path.getsize(os.path.join(path, shard)))
        weight_map.update({k: shard for k in tensors})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return {"moe_layers": len(spec.moe_layers), "largest_shard_gb": largest / 2**30}


def boot_stage(cfg: dict, total_moe_layers: int, args, device, work: str, budget: Budget) -> dict:
    ckpt = os.path.join(work, "boot-ckpt")
    t = time.perf_counter()
    info = write_expert_checkpoint(ckpt, cfg, args.boot_layers, device)
    info["checkpoint_write_s"] = time.perf_counter() - t
    packs = os.path.join(work, "boot-packs")
    runs = []
    for _ in range(2):                           # first boot (quantize + write), then reuse
        p = subprocess.run([sys.executable, "-c", BOOT_CHILD, ckpt, packs, str(device)], capture_output=True, text=True,
                           timeout=max(30.0, budget.left() - 200))     # leave the model stage its time
        if p.returncode:
            raise RuntimeError(f"boot child failed: {p.stderr[-2000:]}")
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    info.update(first_boot=first, boot_from_pack=second,
                first_boot_pack_GBps=first["pack_bytes"] / first["seconds"] / 1e9,
                first_boot_s_extrapolated_full_model=first["seconds"] * total_moe_layers / info["moe_layers"],
                first_boot_rss_over_largest_shard=first["peak_rss_gb"] / max(info["largest_shard_gb"], 1e-9))
    shutil.rmtree(ckpt, ignore_errors=True)
    return info


# ---------------------------------------------------------------- 3./4. the full-shape model

def moe_blocks(model) -> dict:
    return model.moe_blocks()


def write_pack_from_pools(model, work: str, key: str):
    """The resident pools as a complete pack (sidecar + rows with checksums); (paths, meta, seconds)."""
    from moet.store.pack_builder import _fresh_file, quantizer
    from moet.store.pack_file import PackMeta, PackPaths, RowLayout, default_checksum, pool_rows

    blocks = moe_blocks(model)
    names = list(blocks)
    layout = RowLayout.of_pool("w2", blocks[names[0]].pool)
    meta = PackMeta(tag="w2", checkpoint_identity=f"random-{key}", quantizer=quantizer("w2"), layers=names,
                    num_experts=model.spec.router.num_experts, row=layout.to_json(), checksum=default_checksum())
    paths = PackPaths.of(os.path.join(work, "packs"), meta.checkpoint_identity, "w2", "bench", 0)
    os.makedirs(os.path.dirname(paths.data), exist_ok=True)
    _fresh_file(paths, meta)
    from moet.store.pack_file import PackFile

    t = time.perf_counter()
    with PackFile(paths, meta, writable=True) as pf:
        for l, name in enumerate(names):
            pf.commit_layer(l, pf.write_layer(l, pool_rows(blocks[name].pool, layout)))
    return paths, PackMeta.read(paths.sidecar), time.perf_counter() - t


def engine_config(args, device, max_model_len: int, **kw):
    from moet.config import EngineConfig

    return EngineConfig(model="random:bench", device=str(device), max_model_len=max_model_len,
                        max_num_seqs=args.batch, max_num_batched_tokens=args.step_tokens,
                        kv_cache_memory_gb=args.kv_gb, enforce_eager=args.enforce_eager,
                        expert_prefetch=bool(args.expert_prefetch), **kw)


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


def decode_runs(eng, vocab: int, args, device, batches) -> dict:
    from moet.bench.engine_bench import prompts, timed_run
    from moet.sampling_params import SamplingParams

    out = {}
    for b in batches:
        # The small step budget (--step-tokens: one schedule for the resident and cached engines,
        # so their logprobs compare bit for bit) prefills the b prompts one after another while the
        # first sequences already decode and take budget from the later prefills. Each request gets
        # as many extra tokens as it decodes before the last prefill ends (prefill_done_steps), so
        # all b then decode together for --decode-tokens steps; only those steps are timed.
        done = prefill_done_steps(args.prompt_len, b, eng.scheduler.max_num_batched_tokens)
        reqs = [(f"d{b}-{j}", p, SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + max(done) - done[j] + 1,
                                                ignore_eos=True))
                for j, p in enumerate(prompts(b, args.prompt_len, vocab, 11))]
        r = timed_run(eng, reqs, device, min_running=b)
        eng.reset_prefix_cache()
        out[str(b)] = {k: r[k] for k in ("decode_tok_s", "e2e_tok_s", "generated", "wall_s", "decode_steps_s")}
        log(f"    batch {b}: decode {r['decode_tok_s'] or 0:.2f} tok/s")
    return out


def correctness_outputs(eng, vocab: int, prompt_len: int) -> dict:
    from moet.bench.engine_bench import prompts
    from moet.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    ps = [p[:n] for p, n in zip(prompts(2, prompt_len, vocab, 5), (prompt_len // 2 + 3, prompt_len))]
    done = eng.generate_all([(f"c{i}", p, sp) for i, p in enumerate(ps)])
    eng.reset_prefix_cache()
    return outputs_of(done)


def card_slots(card: str, dense_bytes: int, row_bytes: int, total_rows: int, args) -> tuple[int, str]:
    if card.endswith("%"):
        return max(1, int(total_rows * float(card[:-1]) / 100)), f"{card} of the experts"
    budget = float(card) * 2**30 - dense_bytes - (args.kv_gb + args.activation_gb) * 2**30
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
        bw.override("h2d_pinned_gbps", gbps, "measured in this run (residency_bench stage 0)")
    return bw


def predicted(facts, gbps: float | None, slots: int, arena_bytes: int, args, runs: dict, miss_tolerance: int = 0,
              hit_rate: float | None = None) -> dict:
    """The plan's prediction per measured batch, and measured / predicted (store/plan.py compare)."""
    from moet.store import plan as P

    out = {}
    context = args.prompt_len + args.decode_tokens // 2           # mean context of the decode steps
    for b, r in runs.items():
        pl = P.plan_for_rows(facts, slots, arena_bytes, max_num_seqs=args.batch, batch=int(b), context=context,
                             miss_tolerance=miss_tolerance, bandwidths=plan_bandwidths(gbps))
        out[b] = P.compare(pl, r.get("decode_tok_s"), hit_rate)
        if pl.prediction is not None:
            out[b].update(predicted_fetch_bytes_per_step=pl.prediction.fetch_bytes_per_step,
                          predicted_hbm_bytes_per_step=pl.prediction.hbm_bytes_per_step, context=context)
        else:
            out[b]["plan_error"] = pl.fit.message
    return out


def store_run(label: str, model, paths, meta, slots: int, arena_gb: float, o_direct: bool, args, device,
              max_model_len: int, want: dict, budget: Budget, gbps: float | None, facts=None) -> dict:
    from moet.engine.decode_mode import DecodeModeChooser
    from moet.engine.expert_residency import ExpertResidency
    from moet.engine.llm_engine import LLMEngine
    from moet.store.pack_file import PackFile

    rec = {"slots": slots, "host_arena_gb": arena_gb, "o_direct": o_direct}
    if os.path.exists(paths.hot_set):
        os.unlink(paths.hot_set)                     # every configuration starts cold
    cfg = engine_config(args, device, max_model_len, expert_cache_slots=slots, host_arena_gb=arena_gb,
                        o_direct=o_direct)
    t = time.perf_counter()
    res = ExpertResidency(cfg, PackFile(paths, meta, o_direct=o_direct), model.spec, model, device)
    eng = LLMEngine(cfg, model, None, set(), device, max_model_len, residency=res)
    rec["engine_start_s"] = time.perf_counter() - t
    rec["step_tokens"] = eng.scheduler.max_num_batched_tokens
    try:
        rec["correctness"] = compare(correctness_outputs(eng, model.spec.vocab_size, args.prompt_len), want)
        log(f"  {label}: {rec['correctness']}")
        if not rec["correctness"]["bit_identical"]:
            fail(f"{label}: strict replay differs from resident; timings skipped")
            return rec
        phases = [("graph", 0, "tol0"), ("graph", 8, "tol8")]
        phases += [(m, 0, m) for m in args.decode_modes.split(",") if m in ("eager", "auto") and res.demand]
        for mode, tol, key in phases:
            if not budget.ok(60):
                log("  budget: stopping")
                break
            res.miss_tolerance = tol
            res.decode_mode = DecodeModeChooser(mode)
            before = counters(res)
            log(f"  {label}, miss tolerance {tol}, decode steps {mode}:")
            runs = decode_runs(eng, model.spec.vocab_size, args, device, sorted({1, args.batch}))
            d = {k: v - before[k] for k, v in counters(res).items()}      # this phase only
            gen = sum(r["generated"] for r in runs.values())
            per_tok = d["bytes_fetched"] / max(1, gen)
            rec[key] = dict(
                runs=runs, counters=d, generated=gen, decode_mode=mode, miss_tolerance=tol,
                hit_rate=(1 - (d["first_pass_missed_pairs"] + d["demand_missed_pairs"]) / d["pairs"]
                          if d["pairs"] else None),
                passes_per_step=d["passes"] / d["steps"] if d["steps"] else None,
                host_arena_hit_rate=d["arena_hits"] / (d["arena_hits"] + d["arena_misses"])
                if d["arena_hits"] + d["arena_misses"] else None,
                bytes_fetched_per_generated_token=per_tok,
                pcie_bound_tok_s_55GBps=PCIE_GBPS * 1e9 / per_tok if per_tok else None,
                pcie_bound_tok_s_measured=(gbps * 1e9 / per_tok) if per_tok and gbps else None,
                engine_stats=dict(res.stats()))
            r = rec[key]
            if facts is not None:
                r["plan"] = predicted(facts, gbps, slots, int(arena_gb * 2**30), args, runs, tol, r["hit_rate"])
                for b, c in r["plan"].items():
                    if c.get("predicted_tok_s"):
                        log(f"    plan, batch {b}: predicted {c['predicted_tok_s']:.2f} tok/s (hit rate "
                            f"{c['predicted_hit_rate']:.3f}), measured / predicted {c['measured_over_predicted'] or 0:.2f}")
            log(f"    hit rate {r['hit_rate'] or 1:.3f}, passes/step {r['passes_per_step'] or 0:.2f}, "
                f"{per_tok / 2**20:.1f} MiB fetched per generated token, PCIe bound "
                f"{r['pcie_bound_tok_s_55GBps'] or float('inf'):.1f} tok/s at {PCIE_GBPS:.0f} GB/s")
    finally:
        eng.close()
        for b in moe_blocks(model).values():      # let the cache's pool go before the next one is made
            b.pool = None
        del eng, res
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def model_stage(cfg: dict, key: str, args, device, work: str, results: dict, path, budget: Budget,
                gbps: float | None) -> None:
    from moet.bench.engine_bench import random_model
    from moet.engine.llm_engine import LLMEngine
    from moet.store.pack_file import RowLayout

    rec = results.setdefault("model", {})
    t = time.perf_counter()
    model = random_model(cfg, device)
    rec["build_s"] = time.perf_counter() - t
    blocks = moe_blocks(model)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())    # pools are not parameters
    layout = RowLayout.of_pool("w2", next(iter(blocks.values())).pool)
    total_rows = len(blocks) * model.spec.router.num_experts
    rec.update(dense_gb=dense / 2**30, expert_gb=total_rows * layout.row_bytes / 2**30, rows=total_rows,
               row_bytes=layout.row_bytes, moe_layers=len(blocks), top_k=model.spec.router.top_k)
    log(f"model {key}: dense {rec['dense_gb']:.1f} GiB, experts {rec['expert_gb']:.1f} GiB ({total_rows} rows)")
    # room for decode_runs' longest request: the first of a batch decodes while the others prefill
    done = prefill_done_steps(args.prompt_len, args.batch, args.step_tokens)
    max_model_len = args.prompt_len + args.decode_tokens + max(done) - done[0] + 1 + 64
    # all resident
    eng = LLMEngine(engine_config(args, device, max_model_len), model, None, set(), device, max_model_len)
    want = correctness_outputs(eng, model.spec.vocab_size, args.prompt_len)
    log("  all resident:")
    rec["resident"] = {"runs": decode_runs(eng, model.spec.vocab_size, args, device, sorted({1, args.batch}))}
    facts = plan_facts(model, key, dense, layout.row_bytes)
    rec["resident"]["plan"] = predicted(facts, gbps, total_rows, 0, args, rec["resident"]["runs"])
    for b, c in rec["resident"]["plan"].items():
        log(f"    plan, batch {b}: predicted {c['predicted_tok_s'] or 0:.1f} tok/s, measured / predicted "
            f"{c['measured_over_predicted'] or 0:.2f}")
    del eng
    gc.collect()
    write_json(path, results)
    paths, meta, write_s = write_pack_from_pools(model, work, key)
    rec["pack_write_s"] = write_s
    rec["pack_write_GBps"] = meta.file_bytes / write_s / 1e9
    log(f"  pack written: {meta.file_bytes / 2**30:.1f} GiB in {write_s:.1f}s")
    for b in blocks.values():                       # from here on experts come from the store only
        b.pool = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    write_json(path, results)
    rec["cards"] = {}
    for card in args.cards.split(","):
        slots, what = card_slots(card, dense, layout.row_bytes, total_rows, args)
        c = rec["cards"][card] = {"what": what, "slots": slots, "cache_fraction": min(1.0, slots / total_rows)}
        log(f"card {what}: {slots} slots ({c['cache_fraction']:.0%} of the experts)")
        if slots >= total_rows:
            c["all_resident"] = True                # the rule: everything fits -> no store
            write_json(path, results)
            continue
        top = rec["moe_layers"] * rec["top_k"]
        if slots < top:
            c["error"] = f"fewer slots than one token needs ({top}): the card cannot run this model"
            continue
        pack_gb = meta.file_bytes / 2**30
        for label, arena_gb, o_direct in (("cache+arena", pack_gb + 0.01, False),
                                          ("cache+pack+small arena", args.small_arena_gb, args.o_direct)):
            if not budget.ok(90):
                log("budget: stopping")
                break
            try:
                c[label] = store_run(label, model, paths, meta, slots, arena_gb, o_direct, args, device, max_model_len,
                                     want, budget, gbps, facts)
            except Exception as exc:               # keep the other configurations' numbers
                fail(f"{card} {label}: {type(exc).__name__}: {exc}")
                c[label] = {"error": f"{type(exc).__name__}: {exc}"}
            write_json(path, results)


# ---------------------------------------------------------------- 5. transformers + accelerate offloading

ACCELERATE_MISSING = ("accelerate is not installed: pip install 'moet[bench]' (GPU box without network: "
                      "pip install --no-deps .whl/bench/accelerate-*.whl, carried with the run)")


def random_host_weights(model, device, std: float = 0.02, chunk: int = 1 << 28) -> None:
    """Give every meta parameter host storage filled with N(0, std) (norm weights 1): drawn on
    `device` in chunks and copied down, so a many-GiB model is ready in seconds (a host init of
    the same model is single-threaded per tensor and takes minutes). Never zeros."""
    g = torch.Generator(device=device).manual_seed(0)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu")   # pageable, as from_pretrained loads
            flat = host.view(-1)
            if "norm" in type(mod).__name__.lower() or name == "e_score_correction_bias":
                flat.fill_(1.0 if "norm" in type(mod).__name__.lower() else 0.0)
            else:
                for i in range(0, flat.numel(), chunk):
                    n = min(chunk, flat.numel() - i)
                    part = torch.empty(n, dtype=torch.float32, device=device).normal_(0.0, std, generator=g)
                    flat[i:i + n].copy_(part.to(p.dtype))
            mod._parameters[name] = torch.nn.Parameter(host, requires_grad=False)
    model.tie_weights()                                # re-tie where the config ties embeddings
    assert not any(p.is_meta for p in model.parameters()), "a parameter was left on the meta device"
    if device.type == "cuda":
        torch.cuda.synchronize()


def accelerate_stage(cfg: dict, args, device, budget: Budget, results: dict, path) -> None:
    """transformers + accelerate offloading on the same shape in BF16, side by side with the store:
    the shape cut to --accelerate-layers MoE layers (the full BF16 model does not fit host memory),
    random init on the host, then what device_map="auto" does (infer_auto_device_map with
    max_memory capping the GPU, dispatch_model: modules that do not fit stay on the host and are
    copied to the GPU at every forward; weights drawn on the GPU, random_host_weights). Per card the GPU cap is the share of the full model's
    BF16 weights the card holds after KV + activations ("N%": that share), applied to the cut
    model; decode tok/s at batch 1 is measured on the cut model and extrapolated to the full
    layer count (time per token x full MoE layers / cut MoE layers; embeddings and head ignored)."""
    rec = results["accelerate"] = {}
    try:
        import accelerate
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.hooks import remove_hook_from_submodules
    except ImportError:
        rec["skipped"] = ACCELERATE_MISSING
        log(f"accelerate baseline skipped: {ACCELERATE_MISSING}")
        return
    import transformers as tf

    from moet.bench.engine_bench import gen_s
    from moet.checkpoint.spec import spec_from_config

    full = spec_from_config(cfg, "bench shape")
    dense_first = int(cfg.get("first_k_dense_replace", 0))
    cut = dict(cfg, num_hidden_layers=dense_first + args.accelerate_layers, num_nextn_predict_layers=0)
    if "mlp_only_layers" in cut:
        cut["mlp_only_layers"] = [l for l in cut["mlp_only_layers"] if l < cut["num_hidden_layers"]]
    cut_moe = len(spec_from_config(cut, "bench shape").moe_layers)
    hcfg = tf.AutoConfig.for_model(cut["model_type"], **{k: v for k, v in cut.items()
                                                         if k not in ("architectures", "model_type", "torch_dtype")})
    rec.update(accelerate=accelerate.__version__, transformers=tf.__version__, cut_moe_layers=cut_moe,
               full_moe_layers=len(full.moe_layers))
    t = time.perf_counter()
    with accelerate.init_empty_weights():              # parameters on "meta": no host init (a host
        model = tf.AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16).eval()  # init took minutes)
    random_host_weights(model, device)
    rec["init_s"] = time.perf_counter() - t
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    layers = model.model.layers
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    cut_bytes = nbytes(model)
    moe_layer_bytes = nbytes(layers[len(layers) - 1])
    full_bytes = cut_bytes + (len(full.moe_layers) - cut_moe) * moe_layer_bytes
    rec.update(cut_gb=cut_bytes / 2**30, full_bf16_gb_estimate=full_bytes / 2**30)
    log(f"accelerate baseline: {cut_moe} of {len(full.moe_layers)} MoE layers in BF16 ({cut_bytes / 2**30:.1f} GiB; "
        f"the full model ~{full_bytes / 2**30:.0f} GiB)")
    ids = torch.randint(0, cfg["vocab_size"], (1, args.prompt_len))
    n = max(3, min(args.decode_tokens, 16))
    host_cap = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * 0.8)
    rec["cards"] = {}
    try:
        for card in args.cards.split(","):
            if not budget.ok(120):
                log("  budget: stopping")
                break
            if card.endswith("%"):
                share = float(card[:-1]) / 100
            else:
                share = (float(card) - args.kv_gb - args.activation_gb) * 2**30 / full_bytes
            share = max(0.0, min(1.0, share))
            c = rec["cards"][card] = {"gpu_share_of_weights": share}
            if device.type == "cuda":
                cap = int(share * cut_bytes)
                dm = infer_auto_device_map(model, max_memory={0: max(cap, 1), "cpu": host_cap},
                                           no_split_module_classes=list(model._no_split_modules or []), dtype=torch.bfloat16)
                dispatch_model(model, device_map=dm, main_device=0)
                on_gpu = sum(nbytes(model.get_submodule(k)) if k else cut_bytes for k, v in dm.items() if v == 0)
                c.update(gpu_cap_gb=cap / 2**30, weights_on_gpu_gb=on_gpu / 2**30,
                         modules_offloaded=sum(1 for v in dm.values() if v != 0))
                x = ids.to(device)
            else:                                   # --cpu-smoke: no GPU to cap; times the harness only
                x = ids
            try:
                gen_s(model, x, 2, device)                                   # warm-up
                # decode only: minus prefill; best of 3 each, so that host noise cannot make the
                # difference of two short runs negative (it did on a loaded 2-core CPU)
                dt = min(gen_s(model, x, n, device) for _ in range(3)) - min(gen_s(model, x, 1, device) for _ in range(3))
                c["decode_tok_s_cut_model"] = (n - 1) / dt
                c["decode_tok_s_extrapolated_full"] = (n - 1) / dt * cut_moe / len(full.moe_layers)
                log(f"  {card}: {share:.0%} of the BF16 weights on the GPU: {c['decode_tok_s_cut_model']:.2f} tok/s "
                    f"({cut_moe} MoE layers), ~{c['decode_tok_s_extrapolated_full']:.3f} tok/s extrapolated to "
                    f"{len(full.moe_layers)}")
            finally:
                if device.type == "cuda":
                    remove_hook_from_submodules(model)
                    model.to("cpu")
                    torch.cuda.empty_cache()
            write_json(path, results)
    finally:
        del model
        gc.collect()


SMOKE_BENCH = dict(cards="50%,100%", batch=2, decode_tokens=4, prompt_len=6, step_tokens=4, boot_layers=1,
                   kv_gb=0.001, small_arena_gb=0.0)


def main(argv: list[str] | None = None) -> int:
    from moet.bench.engine_bench import MODELS, SMOKE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None, help="scratch directory for checkpoints and packs (default: a temp dir)")
    ap.add_argument("--model", default="glm45air", choices=sorted(MODELS))
    ap.add_argument("--cards", default="32,96,25%", help="GPU budgets in GB, or N%% of the experts")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=4,
                    help="max_num_batched_tokens of every engine (the smallest cache's cap: same schedule everywhere)")
    ap.add_argument("--decode-modes", default="eager",
                    help="besides graph decode (strict and tolerance 8): eager and/or auto decode steps, strict "
                         "(EngineConfig.expert_decode_mode; comma list, '' for none)")
    ap.add_argument("--kv-gb", type=float, default=2.0)
    ap.add_argument("--activation-gb", type=float, default=2.0)
    ap.add_argument("--small-arena-gb", type=float, default=4.0)
    ap.add_argument("--o-direct", type=int, default=1, help="1: the small-arena run reads the pack with O_DIRECT")
    ap.add_argument("--boot-layers", type=int, default=2)
    ap.add_argument("--skip-boot", action="store_true")
    ap.add_argument("--skip-model", action="store_true", help="skip stages 3-4 (e.g. to run the accelerate baseline alone)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--expert-prefetch", type=int, default=1, help="1: the store's engines prefetch (the default)")
    ap.add_argument("--accelerate-layers", type=int, default=2,
                    help="MoE layers of the transformers + accelerate baseline's cut model (0: skip it)")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if args.cpu_smoke:
        for k, v in SMOKE_BENCH.items():
            setattr(args, k, v)
        args.o_direct = 0
    key, cfg = ("smoke", SMOKE) if args.cpu_smoke else (args.model, MODELS[args.model][1])
    path = out_dir(args.out) / "residency_bench.json"
    work = args.work or tempfile.mkdtemp(prefix="moet-residency-bench-")
    results = {"info": device_info(device), "args": vars(args), "model_key": key}
    write_json(path, results)
    try:
        results["h2d_GBps"] = gbps = h2d_gbps(device)
        results["pcie_nominal_GBps"] = PCIE_GBPS
        log(f"pinned host->device: {gbps or 0:.1f} GB/s")
        results["correctness_tiny"] = check_tiny(device, work, (10,) if args.cpu_smoke else (10, 25, 50),
                                                 bool(args.expert_prefetch))
        write_json(path, results)
        if not results["correctness_tiny"]["ok"]:
            fail("expert cache outputs differ from all resident (tiny model)")
            return 1
        from moet.checkpoint.spec import spec_from_config
        total_moe = len(spec_from_config(cfg, "bench shape").moe_layers)
        if not args.skip_boot and budget.ok(240):
            try:
                results["boot"] = boot_stage(cfg, total_moe, args, device, work, budget)
                b = results["boot"]
                log(f"boot: first {b['first_boot']['seconds']:.1f}s (peak RSS {b['first_boot']['peak_rss_gb']:.2f} GB, "
                    f"largest shard {b['largest_shard_gb']:.2f} GB), from pack {b['boot_from_pack']['seconds']:.2f}s")
            except Exception as exc:
                fail(f"boot stage: {type(exc).__name__}: {exc}")
                results["boot"] = {"error": f"{type(exc).__name__}: {exc}"}
            write_json(path, results)
        if args.skip_model:
            log("model stage skipped (--skip-model)")
        elif budget.ok(200):
            model_stage(cfg, key, args, device, work, results, path, budget, gbps)
        else:
            log("budget: model stage skipped")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.accelerate_layers > 0 and budget.ok(150):
            try:
                accelerate_stage(cfg, args, device, budget, results, path)
            except Exception as exc:               # the store's numbers stand without the baseline
                fail(f"accelerate baseline: {type(exc).__name__}: {exc}")
                results["accelerate"] = {"error": f"{type(exc).__name__}: {exc}"}
            write_json(path, results)
    finally:
        results["host_peak_rss_gb"] = host_rss_peak_gb()
        results["elapsed_s"] = budget.elapsed()
        write_json(path, results)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {path} ({budget.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
