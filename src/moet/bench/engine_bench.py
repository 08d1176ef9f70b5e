"""The serving-engine "Measured" harness of issue 6: moet's LLMEngine on random-weight models of
real shapes, built ON the device (dense weights bf16 ~N(0, 0.02), W2 expert pools of random code
bytes with scales in the range quantized weights have: never zeros), one model at a time.

    python -m moet.bench.engine_bench [--budget-s 560] [--out DIR] [--models qwen3_30b,glm45air]
        [--streams 1,4,8,16,32,64] [--decode-tokens 128] [--prefill 8192] [--hf-baseline] [--cpu-smoke]
    python -m moet.bench.engine_bench --device cpu [--expert-formats w2,fp4,bf16] [--threads 2]
        [--repeats 3] [--decode-tokens 128]

Per model:
1. correctness first: six identical greedy runs of 4 mixed-length prompts (token ids and
   logprobs bit for bit; the prefix cache reset between runs), and the engine's first-token
   logprobs against the contiguous reference loop (moet.testing.reference_loop) within 0.1
   (bf16: the paged and contiguous attention round differently). A failure is reported and the
   model's timings are skipped.
2. single-stream decode tok/s (prompt 128, --decode-tokens new tokens), TTFT, and % of the
   roofline: bytes one decode step must read (dense weights + the top-k experts of every MoE
   layer in W2 + the KV cache) / bf16 GEMV bandwidth measured in the same run, divided by the
   measured step time.
3. aggregate decode tok/s at each --streams S: S requests of distinct prompts at once; counted
   over pure-decode steps (tokens / their wall time), plus end-to-end tokens / wall.
4. --prefill T: one T-token prompt, max_tokens 1: TTFT and prefill tok/s.
5. --hf-baseline (first model only, if it fits in BF16 and in time): transformers' generate()
   on the same shape in BF16 (random init on the GPU) at batch 1 and 8.
Results go to $OUT/engine_bench.json (rewritten after every measurement) and engine_bench.md.
A time guard stops starting new measurements before --budget-s.
--cpu-smoke: a tiny Qwen3-shaped model on CPU (tests this harness, numbers meaningless).
--device cpu: the shipped moet-tiny (real weights) at batch 1 on the CPU, moet's engine per expert
format against transformers' generate() on the same weights, same process and threads, decode tok/s
from two generation lengths (prefill excluded); to $OUT/engine_bench_cpu.json and .md.
"""
from __future__ import annotations

import argparse
import gc
import math
import time

import torch

from moet.bench.timing import Budget, bf16_gemv_bandwidth, device_info, fail, log, out_dir, write_json

# config.json fields of each shape (model_type picks moet's family spec)
QWEN3_30B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                 max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16",
                 eos_token_id=151645)
GLM45_AIR = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
                 num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                 intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
                 rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False,
                 torch_dtype="bfloat16", eos_token_id=151329, num_nextn_predict_layers=0)
QWEN3_235B = dict(QWEN3_30B, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, intermediate_size=12288,
                  moe_intermediate_size=1536)
SMOKE = dict(QWEN3_30B, vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, max_position_embeddings=4096, eos_token_id=257)
MODELS = {"qwen3_30b": ("Qwen3-30B-A3B", QWEN3_30B), "glm45air": ("GLM-4.5-Air", GLM45_AIR),
          "qwen3_235b": ("Qwen3-235B-A22B", QWEN3_235B)}


# ---------------------------------------------------------------- model on the device

@torch.no_grad()
def random_model(cfg: dict, device: torch.device, expert_format: str = "w2", seed: int = 0):
    """moet's CausalLM of `cfg`'s shape, every tensor made on `device` (no host copy of the
    weights ever exists), every expert resident."""
    from moet.checkpoint.spec import spec_from_config
    from moet.model.loader import allocate_pool
    from moet.model.layers.moe import MoE
    from moet.model.model import CausalLM

    spec = spec_from_config(cfg, "bench shape")
    with torch.device(device):
        model = CausalLM(spec, torch.bfloat16, load_mtp=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    # Scaled the way trained models are (GPT-2 / Megatron init): weights ~N(0, 0.02), the
    # projections that write into the residual stream (o_proj, down_proj, expert down) smaller
    # by sqrt(2 L). With every branch at full size, the residual stream of a 48-layer random
    # model grows to rms ~400 and a 2^-9 relative perturbation of the embeddings decorrelates
    # the final hidden state completely (a diagnostic on the H200 showed it): such a model cannot
    # tell a correct engine from a wrong one.
    depth = math.sqrt(2 * spec.num_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif "bias" in name:
            p.normal_(0.0, 0.02, generator=gen) if p.dim() else p.zero_()
        elif "o_proj" in name or "down_proj" in name:
            p.normal_(0.0, 0.02 / depth, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    # UE8M0 scale bytes: W2 levels (+-1, +-4) have rms ~2.9, so 2^-10 .. 2^-6 gives expert
    # weights of rms ~0.02 like the dense ones; the down projection 2^-log2(sqrt(2L)) lower
    shift = round(math.log2(depth))
    u8 = dict(dtype=torch.uint8, device=device, generator=gen)
    for mod in model.modules():
        if isinstance(mod, MoE):
            allocate_pool(mod, expert_format, torch.bfloat16, device)
            pool = mod.pool
            for f in pool.__slots__:
                t = getattr(pool, f, None)
                if not isinstance(t, torch.Tensor):
                    continue
                if t.dtype == torch.uint8 and "scale" not in f:
                    t.copy_(torch.randint(0, 256, t.shape, **u8))              # codes
                elif t.dtype == torch.uint8:
                    lo = 117 - (shift if f.startswith("down") else 0)
                    t.copy_(torch.randint(lo, lo + 5, t.shape, **u8))
                else:
                    t.normal_(0.0, 0.02, generator=gen)
            if mod.gate.e_score_correction_bias is not None:
                mod.gate.e_score_correction_bias.zero_()
    return model.eval()


def decode_step_bytes(model, kv_bytes_per_token: int, context: int) -> int:
    """Bytes one single-sequence decode step must read: every dense weight except the embedding
    table (one row), top_k experts per MoE layer, the KV cache of `context` tokens."""
    from moet.bench.moe_bench import expert_bytes
    from moet.model.layers.moe import MoE

    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    for mod in model.modules():
        if isinstance(mod, MoE):
            total += mod.spec.router.top_k * expert_bytes(mod.pool)
    return total + kv_bytes_per_token * context


# ---------------------------------------------------------------- engine runs

def make_engine(model, cfg: dict, device, args, max_model_len: int):
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine

    ec = EngineConfig(model=f"random:{cfg['model_type']}", device=str(device), max_model_len=max_model_len,
                      max_num_seqs=max(int(s) for s in args.streams.split(",")),
                      max_num_batched_tokens=max(args.prefill, 512), gpu_memory_utilization=args.gpu_memory_utilization,
                      kv_cache_memory_gb=args.kv_cache_memory_gb, enforce_eager=args.enforce_eager,
                      overlap_shared_experts=not getattr(args, "no_overlap_shared_experts", False),
                      async_scheduling=getattr(args, "async_scheduling", True),
                      small_kernel_pdl=getattr(args, "small_kernel_pdl", True),
                      attention_fused_merge=getattr(args, "attention_fused_merge", False),
                      # the bench warms up what it times itself; the start-up ladder would only add
                      # compiles of variants it never runs to its device budget
                      compile_warmup=False)
    return LLMEngine(ec, model, None, {int(cfg["eos_token_id"])}, device, max_model_len)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(eng, reqs, device, min_running: int = 1) -> dict:
    """Submit all, step to the end; per-step wall times split into decode-only and other. A step
    counts as decode-only when every running sequence decodes, none waits, and at least
    `min_running` run (so a batch-b rate is not diluted by steps after some have finished).
    Synchronous steps are timed to a device sync; async steps (EngineConfig.async_scheduling) are
    not synced: a sync would drain the one-step-ahead pipeline they exist for, and step() returns
    only once its tokens are on the host, so the step times still add up to the wall."""
    pipelined = bool(getattr(getattr(eng, "config", None), "async_scheduling", False))
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    sync(device)
    t0 = time.perf_counter()
    first_token = {}
    dec_time = dec_tokens = 0.0
    gen = 0
    while eng.has_unfinished_requests():
        running = eng.scheduler.running
        pure_decode = all(s.num_computed_tokens == s.num_tokens - 1 for s in running) \
            and not eng.scheduler.waiting and len(running) >= min_running
        ts = time.perf_counter()
        outs = eng.step()
        if not pipelined:
            sync(device)
        dt = time.perf_counter() - ts
        n = sum(1 for _ in outs)
        for o in outs:
            first_token.setdefault(o.request_id, time.perf_counter() - t0)
        gen += n
        if pure_decode and n:
            dec_time += dt
            dec_tokens += n
    sync(device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "generated": gen, "decode_tok_s": dec_tokens / dec_time if dec_time else None,
            "e2e_tok_s": gen / wall, "ttft_s_mean": sum(first_token.values()) / max(1, len(first_token)),
            "decode_steps_s": dec_time}


def first_token_lps(got: dict[int, float], want: dict[int, float]) -> tuple[int, float]:
    """(top-20 overlap, max |logprob difference| over the overlap) of two first-token dicts."""
    both = set(want) & set(got)
    return len(both), max((abs(got[t] - want[t]) for t in both), default=float("inf"))


def check_correctness(eng, model, device, vocab: int) -> dict:
    """Six identical greedy runs (bit for bit), then the engine's first-token distribution against
    the contiguous reference loop, held to the model's own bf16 noise floor: the same reference
    with its embedding output perturbed by 2^-9 relative (two seeds). A random-weight model has
    nearly flat logits (top-1 / top-2 gaps of a few hundredths), so paged vs contiguous rounding
    flips argmaxes without anything being wrong (a diagnostic on the H200 showed it); the check
    compares the top-20 logprobs where both sides have them. Agreement within 2x the floor (+0.05)
    is "ok"; identical argmaxes and 8-token continuations are reported as information."""
    from moet.sampling_params import SamplingParams
    from moet.testing.reference_loop import ReferenceLoop

    ps = [p[:n] for p, n in zip(prompts(4, 300, vocab, 1), (17, 64, 129, 300))]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    runs = []
    for _ in range(6):
        done = eng.generate_all([(f"c{i}", p, sp) for i, p in enumerate(ps)])
        eng.reset_prefix_cache()
        runs.append([(done[f"c{i}"].outputs[0].token_ids,
                      [{t: v.logprob for t, v in d.items()} for d in done[f"c{i}"].outputs[0].logprobs])
                     for i in range(len(ps))])
    identical = all(r == runs[0] for r in runs[1:])
    ref = ReferenceLoop(model, None, eng.eos_token_ids, eng.max_model_len)
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20)

    def ref_first(p, noise_seed=None):
        hook = None
        if noise_seed is not None:
            g = torch.Generator(device=device).manual_seed(noise_seed)
            hook = model.model.embed_tokens.register_forward_hook(
                lambda m, i, o: o * (1 + 2 ** -9 * torch.randn(o.shape, device=o.device, generator=g)).to(o.dtype))
        try:
            r = ref.generate(p, sp if noise_seed is None else sp1).outputs[0]
        finally:
            if hook is not None:
                hook.remove()
        return r, {t: v.logprob for t, v in r.logprobs[0].items()}

    eng_ov, eng_dlp, floor_ov, floor_dlp, same_first, same_ids = 20, 0.0, 20, 0.0, 0, 0
    for i, p in enumerate(ps):
        r, want = ref_first(p)
        got_ids, got_lps = runs[0][i]
        same_ids += int(got_ids == r.token_ids)
        same_first += int(got_ids[0] == r.token_ids[0])
        ov, d = first_token_lps(got_lps[0], want)
        eng_ov, eng_dlp = min(eng_ov, ov), max(eng_dlp, d)
        for seed in (1, 2):
            ov, d = first_token_lps(ref_first(p, seed)[1], want)
            floor_ov, floor_dlp = min(floor_ov, ov), max(floor_dlp, d)
    agrees = eng_ov >= floor_ov - 3 and eng_dlp <= 2 * floor_dlp + 0.05
    return {"six_runs_bit_identical": identical, "first_token_top20_min_overlap": eng_ov,
            "first_token_max_abs_dlogprob_on_overlap": eng_dlp,
            "noise_floor_2^-9_embedding": {"top20_min_overlap": floor_ov, "max_abs_dlogprob": floor_dlp},
            "reference_agreement_within_noise": agrees,
            "prompts_with_same_first_token": f"{same_first}/{len(ps)}",
            "prompts_with_identical_8_tokens_vs_reference": f"{same_ids}/{len(ps)}", "ok": identical and agrees}


def bench_model(key: str, name: str, cfg: dict, device, args, budget: Budget, results: dict, path) -> None:
    from moet.sampling_params import SamplingParams

    r = results["models"].setdefault(key, {"name": name, "shape": {k: v for k, v in cfg.items() if k != "architectures"}})
    log(f"== {name}: building random W2 model on {device}")
    t = time.perf_counter()
    model = random_model(cfg, device)
    sync(device)
    r["build_s"] = time.perf_counter() - t
    max_len = max(args.prefill + 64, 1024)
    eng = make_engine(model, cfg, device, args, max_len)
    r["engine"] = {"num_kv_blocks": eng.runner.num_blocks, "kv_cache_gib": eng.runner.kv_cache_bytes / 2**30,
                   "cuda_graph_buckets": sorted(eng.runner.graphs), "graph_error": eng.runner.graph_error}
    if device.type == "cuda":
        r["engine"]["gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
    log(f"   engine: {r['engine']}")
    write_json(path, results)
    vocab = cfg["vocab_size"]

    if not budget.ok(60):
        return
    r["correctness"] = c = check_correctness(eng, model, device, vocab)
    log(f"   correctness: {c}")
    write_json(path, results)
    if not c["six_runs_bit_identical"]:
        fail(f"{name}: greedy runs differ run to run; timings skipped")
        return
    if not c["ok"]:                 # timings still taken: they do not depend on the values
        fail(f"{name}: first-token logprobs differ from the reference beyond the noise floor (timed anyway, flagged)")

    # single stream
    if budget.ok(60):
        n_new = args.decode_tokens
        sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
        res = timed_run(eng, [("s0", prompts(1, 128, vocab, 2)[0], sp)], device)
        step_s = 1 / res["decode_tok_s"] if res["decode_tok_s"] else None
        need = decode_step_bytes(model, eng.runner.bytes_per_token, 128 + n_new // 2)
        roof_s = need / (results["bf16_gemv"]["GBps"] * 1e9) if results.get("bf16_gemv") else None
        res.update(bytes_per_step=need, roofline_tok_s=1 / roof_s if roof_s else None,
                   pct_of_roofline=100 * roof_s / step_s if roof_s and step_s else None)
        r["single_stream"] = res
        log(f"   single stream: {res['decode_tok_s']:.1f} tok/s decode, TTFT {res['ttft_s_mean'] * 1e3:.1f} ms, "
            f"{res['pct_of_roofline'] or 0:.0f}% of roofline ({need / 1e9:.2f} GB/step)")
        write_json(path, results)

    # aggregate
    r["aggregate"] = {}
    for s in [int(x) for x in args.streams.split(",")]:
        if not budget.ok(60):
            log("   budget: stopping aggregate sweep")
            break
        sp = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        ps = prompts(s, 128, vocab, 100 + s)
        res = timed_run(eng, [(f"a{s}-{i}", p, sp) for i, p in enumerate(ps)], device)
        single = (r.get("single_stream") or {}).get("decode_tok_s")
        res["x_single_stream"] = res["decode_tok_s"] / single if single and res["decode_tok_s"] else None
        r["aggregate"][s] = res
        log(f"   {s:3d} streams: {res['decode_tok_s'] or 0:.1f} tok/s decode aggregate "
            f"({res['x_single_stream'] or 0:.2f}x single), e2e {res['e2e_tok_s']:.1f} tok/s")
        write_json(path, results)

    # long prefill
    if args.prefill and budget.ok(90):
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        timed_run(eng, [("warm", prompts(1, 512, vocab, 3)[0], sp)], device)
        res = timed_run(eng, [("p0", prompts(1, args.prefill, vocab, 4)[0], sp)], device)
        r["prefill"] = {"tokens": args.prefill, "ttft_s": res["ttft_s_mean"], "tok_s": args.prefill / res["ttft_s_mean"]}
        log(f"   prefill {args.prefill}: TTFT {res['ttft_s_mean'] * 1e3:.0f} ms, {r['prefill']['tok_s']:.0f} tok/s")
        write_json(path, results)
    r["stats"] = vars(eng.stats())
    del eng, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gen_s(model, ids, k: int, device) -> float:
    """Seconds of one transformers generate() of exactly k new tokens."""
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
    sync(device)
    return time.perf_counter() - t0


def hf_baseline(cfg: dict, device, args, budget: Budget, results: dict, path) -> None:
    """transformers' generate() on the same shape in BF16, random init on the device."""
    import transformers as tf

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    hcfg = tf.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                         if k not in ("architectures", "model_type", "torch_dtype")})
    experts = getattr(hcfg, "num_experts", None) or getattr(hcfg, "n_routed_experts", 0)
    n_params = hcfg.num_hidden_layers * (experts * 3 * hcfg.hidden_size * hcfg.moe_intermediate_size)
    if device.type == "cuda" and 2 * n_params * 1.15 > free:
        results["hf_baseline"] = {"skipped": f"BF16 needs ~{2 * n_params / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
        return
    log("== transformers generate() baseline (BF16)")
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = results["hf_baseline"] = {"transformers": tf.__version__}
    for b in (1, 8):
        if not budget.ok(90):
            break
        ids = torch.randint(0, cfg["vocab_size"], (b, 128), device=device)
        n = 32
        gen_s(model, ids, 2, device)                                          # warm-up
        dt = gen_s(model, ids, n, device) - gen_s(model, ids, 1, device)     # decode only: minus prefill
        out[f"batch{b}_decode_tok_s"] = b * (n - 1) / dt
        log(f"   transformers batch {b}: {b * (n - 1) / dt:.1f} tok/s decode")
        write_json(path, results)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- CPU: moet-tiny against transformers

CPU_PROMPT = "The capital of Poland is Warsaw. The capital of Germany is Berlin. The capital of France is"
# moet's expert_format -> the weights transformers gets (moet.probe.loader): for the shipped NVFP4
# checkpoint "nvfp4" is exactly what moet's fp4 and bf16 formats compute with
HF_EXPERTS = {"w2": "w2", "fp4": "nvfp4", "bf16": "nvfp4"}


def decode_tok_s(run, n: int) -> tuple[float, list[int]]:
    """Decode tok/s of a greedy generation: the n-token run's wall time less a 1-token run's (same
    prompt: prefill and the first token cancel), over the n - 1 decode steps. -> (tok/s, ids)."""
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    ids = run(n)
    t2 = time.perf_counter()
    return (n - 1) / ((t2 - t1) - (t1 - t0)), ids


def moet_cpu_runner(expert_format: str, prompt_ids: list[int]):
    """moet's engine on the shipped moet-tiny (CPU, the checkpoint's dtype, every default but the
    expert format) -> run(n): the greedy token ids of one n-token request."""
    from moet.assets import default_model
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    from moet.sampling_params import SamplingParams

    eng = LLMEngine.from_config(EngineConfig(model=str(default_model()), expert_format=expert_format, device="cpu"))

    def run(n: int) -> list[int]:
        eng.reset_prefix_cache()                   # every run prefills the whole prompt
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(eng.generate_all([("bench", prompt_ids, sp)])["bench"].outputs[0].token_ids)
    return run, eng


def hf_cpu_runner(hf_experts: str, prompt_ids: list[int], dtype: torch.dtype):
    """transformers' DeepseekV3ForCausalLM with moet-tiny's weights (routed experts decoded from
    `hf_experts`, moet.probe.loader) -> run(n): generate()'s greedy ids for n new tokens."""
    from moet.probe.loader import load

    model = load(experts=hf_experts, device="cpu", dtype=dtype).model
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    x = torch.tensor([prompt_ids])

    @torch.inference_mode()
    def run(n: int) -> list[int]:
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        return out[0, x.shape[1]:].tolist()
    return run


def cpu_compare(args) -> int:
    """--device cpu: single-stream greedy decode tok/s of moet's engine on the shipped moet-tiny,
    per expert format, against transformers' generate() on the same weights, in one process with
    the same torch threads; each system timed --repeats times, interleaved, median reported."""
    import statistics

    import transformers as tf

    from moet.assets import default_model
    from moet.engine.llm_engine import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f for f in args.expert_formats.split(",") if f]
    unknown = sorted(set(formats) - set(HF_EXPERTS))
    if unknown:
        raise SystemExit(f"engine_bench: error: unknown --expert-formats {unknown}; choose from {sorted(HF_EXPERTS)}")
    n = args.decode_tokens
    path = out_dir(args.out) / "engine_bench_cpu.json"
    tok = load_tokenizer(str(default_model()), False)
    prompt_ids = tok(CPU_PROMPT)["input_ids"]
    dtype = torch.bfloat16                        # moet-tiny's torch_dtype: what moet's engine runs in
    res = {"info": device_info(torch.device("cpu")) | {"transformers": tf.__version__,
                                                     "threads": torch.get_num_threads(), "dtype": str(dtype)},
           "args": vars(args), "prompt_tokens": len(prompt_ids), "decode_tokens": n, "moet": {}, "transformers": {}}
    systems = {}
    for f in formats:
        log(f"== loading moet-tiny, {f} experts")
        systems[("moet", f)] = moet_cpu_runner(f, prompt_ids)[0]
    for hf in sorted({HF_EXPERTS[f] for f in formats}):
        log(f"== loading transformers DeepseekV3ForCausalLM, {hf} experts")
        systems[("transformers", hf)] = hf_cpu_runner(hf, prompt_ids, dtype)
    runs: dict = {key: [] for key in systems}
    ids: dict = {}
    for key, run in systems.items():               # warm-up: first calls allocate and fill caches
        run(4)
    for rep in range(args.repeats):
        order = list(systems.items())
        for key, run in (order if rep % 2 == 0 else order[::-1]):
            rate, ids[key] = decode_tok_s(run, n)
            runs[key].append(rate)
            log(f"   {key[0]} {key[1]}: {rate:.1f} tok/s decode (repeat {rep + 1})")
    for (who, f), rates in runs.items():
        res[who][f] = {"decode_tok_s": statistics.median(rates), "runs": rates}
    for f in formats:
        m, h = ids[("moet", f)], ids[("transformers", HF_EXPERTS[f])]
        same = next((i for i, (a, b) in enumerate(zip(m, h)) if a != b), min(len(m), len(h)))
        res["moet"][f].update(transformers_experts=HF_EXPERTS[f], same_greedy_prefix_tokens=same,
                              x_transformers=res["moet"][f]["decode_tok_s"]
                              / res["transformers"][HF_EXPERTS[f]]["decode_tok_s"])
    write_json(path, res)
    lines = [f"# engine_bench --device cpu {res['info']['date_utc']}: moet-tiny, batch 1, {n} tokens, "
             f"{res['info']['threads']} threads, {dtype}", "",
             "| system | experts | decode tok/s (median) | runs | x transformers | same greedy tokens |",
             "|---|---|---|---|---|---|"]
    for f in formats:
        r = res["moet"][f]
        lines.append(f"| moet | {f} | {r['decode_tok_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['runs'])} | "
                     f"{r['x_transformers']:.2f} | {r['same_greedy_prefix_tokens']}/{n} |")
    for hf, r in res["transformers"].items():
        lines.append(f"| transformers {tf.__version__} generate() | {hf} | {r['decode_tok_s']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['runs'])} | 1.00 | |")
    (path.parent / "engine_bench_cpu.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


def write_md(results: dict, path) -> None:
    lines = [f"# engine_bench {results['info'].get('date_utc')} on {results['info'].get('gpu', results['info']['device'])}", ""]
    if results.get("bf16_gemv"):
        lines.append(f"bf16 GEMV reference: {results['bf16_gemv']['GBps']:.0f} GB/s")
    for key, r in results["models"].items():
        lines += ["", f"## {r['name']} (W2 experts, BF16 dense)", f"correctness: {r.get('correctness')}"]
        s = r.get("single_stream")
        if s:
            lines.append(f"single stream: {s['decode_tok_s']:.1f} tok/s, {s['pct_of_roofline'] or 0:.0f}% of roofline, "
                         f"TTFT {s['ttft_s_mean'] * 1e3:.0f} ms")
        if r.get("aggregate"):
            lines += ["", "| streams | decode tok/s | x single | e2e tok/s |", "|---|---|---|---|"]
            for n, a in r["aggregate"].items():
                lines.append(f"| {n} | {a['decode_tok_s'] or 0:.1f} | {a['x_single_stream'] or 0:.2f} | {a['e2e_tok_s']:.1f} |")
        if r.get("prefill"):
            p = r["prefill"]
            lines.append(f"\nprefill {p['tokens']}: {p['tok_s']:.0f} tok/s, TTFT {p['ttft_s'] * 1e3:.0f} ms")
    if results.get("hf_baseline"):
        lines.append(f"\ntransformers generate() BF16: {results['hf_baseline']}")
    (path.parent / "engine_bench.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="qwen3_30b,glm45air")
    ap.add_argument("--streams", default="1,4,8,16,32,64")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-overlap-shared-experts", action="store_true",
                    help="EngineConfig.overlap_shared_experts off (default on: shared experts on a second CUDA stream)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.async_scheduling (default on: decode steps launched one step ahead of "
                         "the host; --no-async-scheduling for synchronous steps)")
    ap.add_argument("--small-kernel-pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.small_kernel_pdl (default on: the step's small Triton kernels under "
                         "programmatic dependent launch; --no-small-kernel-pdl for the A/B)")
    ap.add_argument("--attention-fused-merge", action="store_true",
                    help="EngineConfig.attention_fused_merge on (GQA decode without the merge launch)")
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cpu: moet-tiny's single-stream decode against transformers' generate() on the same "
                         "weights (--expert-formats, --threads, --repeats, --decode-tokens); else the random-"
                         "weight shapes on the GPU")
    ap.add_argument("--expert-formats", default="w2,fp4,bf16", help="--device cpu: moet expert formats to time")
    ap.add_argument("--threads", type=int, default=None,
                    help="--device cpu: torch threads for both systems (default: torch's own choice)")
    ap.add_argument("--repeats", type=int, default=3, help="--device cpu: timed runs per system (median reported)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        return cpu_compare(args)
    budget = Budget(args.budget_s)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    models = {"smoke": ("tiny Qwen3-shaped (smoke)", SMOKE)} if args.cpu_smoke else \
        {k: MODELS[k] for k in args.models.split(",")}
    if args.cpu_smoke:
        args.streams, args.decode_tokens, args.prefill = "1,4", 8, 256
    path = out_dir(args.out) / "engine_bench.json"
    results = {"info": device_info(device), "args": vars(args), "models": {}}
    if device.type == "cuda":
        results["bf16_gemv"] = bf16_gemv_bandwidth(device)
        log(f"bf16 GEMV: {results['bf16_gemv']['GBps']:.0f} GB/s")
    write_json(path, results)
    for i, (key, (name, cfg)) in enumerate(models.items()):
        if not budget.ok(120):
            log(f"budget: skipping {name}")
            continue
        try:
            bench_model(key, name, cfg, device, args, budget, results, path)
        except Exception as exc:            # keep the other models' numbers
            fail(f"{name}: {type(exc).__name__}: {exc}")
            results["models"].setdefault(key, {})["error"] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write_json(path, results)
        if i == 0 and args.hf_baseline and budget.ok(150):
            try:
                hf_baseline(cfg, device, args, budget, results, path)
            except Exception as exc:
                fail(f"transformers baseline: {type(exc).__name__}: {exc}")
                results["hf_baseline"] = {"error": f"{type(exc).__name__}: {exc}"}
    write_json(path, results)
    write_md(results, path)
    log(f"wrote {path} ({budget.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
