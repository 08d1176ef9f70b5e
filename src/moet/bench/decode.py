"""`moet bench decode` and `moet bench prefill`: moet's engine on a shape or a checkpoint.

Correctness first: six identical greedy runs of 4 mixed-length prompts (token ids and logprobs
bit for bit; the prefix cache reset between runs), and the engine's first-token logprobs against
the contiguous reference loop (moet.testing.reference_loop), held to the model's own bf16 noise
floor. A run that differs run to run times nothing; a reference disagreement is timed but flagged.

decode, per --batch B: B requests of distinct --prompt-len prompts, --decode-tokens new tokens
each, after an untimed short run of the same batch (compiles and graph captures land there).
tok/s counts the steps in which all B sequences decode (tokens / their wall time); TTFT is the
mean first-token time of the batch. GB/s = the bytes one decode step must read
(moet.bench.roofline) / the step time; % of roofline against the reference bandwidth measured in
the same run.

prefill, per --tokens T: one T-token prompt, max_tokens 1, after an untimed 512-token prompt:
TTFT and T / TTFT."""
from __future__ import annotations

import time

import torch

from moet.bench.shapes import prompts
from moet.bench.target import Settings, Target, sync


def timed_run(eng, reqs, device, min_running: int = 1) -> dict:
    """Submit all, step to the end; per-step wall times split into decode-only and other. A step
    counts as decode-only when every running sequence decodes, none waits, and at least
    `min_running` run (so a batch-B rate is not diluted by steps after some have finished).
    Synchronous steps are timed to a device sync; async steps (EngineConfig.scheduler.async_scheduling)
    are not synced: a sync would drain the one-step-ahead pipeline they exist for, and step() returns
    only once its tokens are on the host, so the step times still add up to the wall."""
    scheduler = getattr(getattr(eng, "config", None), "scheduler", None)
    pipelined = bool(getattr(scheduler, "async_scheduling", False))
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    sync(device)
    t0 = time.perf_counter()
    first_token = {}
    dec_time = dec_tokens = 0.0
    gen = 0
    ids: dict[str, list[int]] = {}
    seen: dict[str, int] = {}          # tokens of each request so far (an MTP step emits several)
    while eng.has_unfinished_requests():
        running = eng.scheduler.running
        pure_decode = all(s.num_computed_tokens == s.num_tokens - 1 for s in running) \
            and not eng.scheduler.waiting and len(running) >= min_running
        ts = time.perf_counter()
        outs = eng.step()
        if not pipelined:
            sync(device)
        dt = time.perf_counter() - ts
        n = 0
        for o in outs:
            total = sum(len(c.token_ids) for c in o.outputs)
            n += total - seen.get(o.request_id, 0)
            seen[o.request_id] = total
            first_token.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                ids[o.request_id] = list(o.outputs[0].token_ids)
        gen += n
        if pure_decode and n:
            dec_time += dt
            dec_tokens += n
    sync(device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "generated": gen, "decode_tok_s": dec_tokens / dec_time if dec_time else None,
            "e2e_tok_s": gen / wall, "ttft_s_mean": sum(first_token.values()) / max(1, len(first_token)),
            "decode_steps_s": dec_time, "token_ids": ids}


def first_token_lps(got: dict[int, float], want: dict[int, float]) -> tuple[int, float]:
    """(top-20 overlap, max |logprob difference| over the overlap) of two first-token dicts."""
    both = set(want) & set(got)
    return len(both), max((abs(got[t] - want[t]) for t in both), default=float("inf"))


def check_correctness(eng, model, device, vocab: int) -> dict:
    """Six identical greedy runs (bit for bit), then the engine's first-token distribution against
    the contiguous reference loop, held to the model's own bf16 noise floor: the same reference
    with its embedding output perturbed by 2^-9 relative (two seeds). A random-weight model has
    nearly flat logits (top-1 / top-2 gaps of a few hundredths), so paged vs contiguous rounding
    flips argmaxes without anything being wrong; the check compares the top-20 logprobs where
    both sides have them. Agreement within 2x the floor (+0.05) is "ok"; identical argmaxes and
    8-token continuations are reported as information. Under a quantized KV cache the reference
    holds the format's values (ReferenceLoop's kv_format): the check is of the engine's cache and
    kernels against the format's definition; what the format costs is `moet probe`'s to measure."""
    from moet.sampling_params import SamplingParams
    from moet.testing.reference_loop import ReferenceLoop

    longest = min(300, eng.max_model_len - 16)
    lengths = [min(n, longest) for n in (17, 64, 129, 300)]
    ps = [p[:n] for p, n in zip(prompts(4, longest, vocab, 1), lengths)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    runs = six_greedy_runs(eng, ps, sp)
    identical = all(r == runs[0] for r in runs[1:])
    ref = ReferenceLoop(model, None, eng.eos_token_ids, eng.max_model_len, kv_format=eng.runner.kv_format)
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


def correctness_first(t: Target, s: Settings, scenario: str) -> bool:
    """The check above, recorded; False when the engine is not even deterministic (time nothing).
    With the gate timed (--gate-fire) the check runs on bare W2 (the reference loop has no gate),
    then six greedy runs with the gate forced to fire on 30% of steps must be bit-identical too."""
    eng = t.engine
    gate, eng.gate = eng.gate, (None if s.gate_fire else eng.gate)
    drafter, eng.drafter = eng.drafter, None       # the reference loop decodes one token a step
    try:
        c = check_correctness(eng, t.model, t.device, t.vocab)
    finally:
        eng.gate, eng.drafter = gate, drafter
    if s.gate_fire and gate is not None:
        c["gate_six_runs_bit_identical"] = gate_determinism(eng, t.vocab, 0.3)
        c["ok"] = c["ok"] and c["gate_six_runs_bit_identical"]
    if drafter is not None:                        # speculative steps: deterministic too (drafts kept)
        c["spec_six_runs_bit_identical"] = spec_determinism(eng, t.vocab)
        c["ok"] = c["ok"] and c["spec_six_runs_bit_identical"]
    s.report.note(scenario, "correctness", c)
    print(f"[{scenario}] correctness: {'ok' if c['ok'] else 'FAILED'} (six runs identical: "
          f"{c['six_runs_bit_identical']}, reference within noise: {c['reference_agreement_within_noise']}"
          + (f", gated six runs identical: {c['gate_six_runs_bit_identical']}" if "gate_six_runs_bit_identical" in c
             else "")
          + (f", speculative six runs identical: {c['spec_six_runs_bit_identical']}"
             if "spec_six_runs_bit_identical" in c else "") + ")", flush=True)
    return (bool(c["six_runs_bit_identical"]) and c.get("gate_six_runs_bit_identical", True)
            and c.get("spec_six_runs_bit_identical", True))


def spec_determinism(eng, vocab: int) -> bool:
    """Six identical greedy runs with MTP drafts, every draft kept (--accept-all's path: random
    weights keep none otherwise): token ids and logprobs bit for bit."""
    from moet.sampling_params import SamplingParams

    longest = min(300, eng.max_model_len - 48)
    ps = [p[:n] for p, n in zip(prompts(4, longest, vocab, 3), (17, 64, 129, longest))]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    keep, eng.drafter.accept_all = eng.drafter.accept_all, True
    try:
        runs = six_greedy_runs(eng, ps, sp)
    finally:
        eng.drafter.accept_all = keep
    return all(r == runs[0] for r in runs[1:])


def gate_determinism(eng, vocab: int, rate: float) -> bool:
    """Six identical greedy runs with the gate forced to fire on `rate` of the steps: token ids and
    logprobs bit for bit (repairs in batches of mixed lengths, KV rewritten)."""
    from moet.sampling_params import SamplingParams

    longest = min(300, eng.max_model_len - 48)
    ps = [p[:n] for p, n in zip(prompts(4, longest, vocab, 2), (17, 64, 129, longest))]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    eng.gate.forced_fire_rate = rate
    try:
        runs = six_greedy_runs(eng, ps, sp)
    finally:
        eng.gate.forced_fire_rate = None
    return all(r == runs[0] for r in runs[1:])


def six_greedy_runs(eng, ps: list[list[int]], sp) -> list[list[tuple]]:
    """The same requests six times (prefix cache reset between runs): per run, each request's
    (token ids, logprob dicts)."""
    runs = []
    for _ in range(6):
        done = eng.generate_all([(f"c{i}", p, sp) for i, p in enumerate(ps)])
        eng.reset_prefix_cache()
        runs.append([(done[f"c{i}"].outputs[0].token_ids,
                      [{t: v.logprob for t, v in d.items()} for d in done[f"c{i}"].outputs[0].logprobs])
                     for i in range(len(ps))])
    return runs


# --structured's constraint: JSON-shaped and never complete (no closing bracket at the top), so a
# random-weight model with EOS ignored decodes every token under it without a dead end
BENCH_GRAMMAR = r"""root ::= "[" value ("," value)*
value ::= string | number | "{" string ":" value "}" | "[" value "]"
string ::= "\"" [a-zA-Z0-9 _-]* "\""
number ::= "-"? [0-9]+ ("." [0-9]+)?"""


def _accepts(grammar, ids: list[int]) -> bool:
    return all(grammar.accept(t) for t in ids)


def config_text(t: Target, s: Settings, **what) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in what.items())
    return f"moet {t.expert_format}" + (f", {extra}" if extra else "")


def run_decode(t: Target, s: Settings, roof: dict | None) -> None:
    eng, report = t.engine, s.report
    gate = eng.gate
    # (gate setting, forced fire rate): the engine as configured, or with --gate-fire bare W2 (no
    # gate) and the gate at each forced rate, in one run
    variants = [("bare", None)] + [("gate", r) for r in s.gate_fire] if s.gate_fire and gate is not None \
        else [("as configured", None)]
    drafter = eng.drafter
    if s.speculative and drafter is not None:     # (spec, drafts per step): 0 = no speculation
        variants = [("spec", k) for k in s.speculative]
        drafter.accept_all = s.accept_all
    if s.structured:                              # free decoding, then under BENCH_GRAMMAR
        variants = [("free", None), ("structured", None)]
        if eng.tokenizer is None:                 # a random-weight shape: a vocabulary of its size
            from moet.engine.structured_output import GrammarBackend
            eng.set_grammar_backend(GrammarBackend.synthetic(t.vocab, eng.eos_token_ids))
    for b in s.batches:
        if not s.budget.ok(30):
            report.note("decode", f"skipped batch {b}", "time budget (--budget-s) spent")
            print(f"[decode] budget: batch {b} skipped", flush=True)
            continue
        for kind, rate in variants:
            if kind == "spec":
                eng.drafter = drafter if rate else None
                if rate:
                    drafter.set_drafts(rate)
            elif kind in ("bare", "gate"):
                eng.gate = gate if kind == "gate" else None
                gate.forced_fire_rate = rate
            try:
                _decode_row(t, s, roof, b, kind, rate)
            finally:
                eng.gate, eng.drafter = gate, drafter
                if gate is not None:
                    gate.forced_fire_rate = None


def _decode_row(t: Target, s: Settings, roof: dict | None, b: int, kind: str, rate: float | None) -> None:
    from moet.bench.roofline import decode_step_bytes
    from moet.engine.confidence_gate import GateCounters
    from moet.sampling_params import SamplingParams

    eng, report = t.engine, s.report
    from moet.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(grammar=BENCH_GRAMMAR) if kind == "structured" else None
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, structured_outputs=so)
    timed_run(eng, [(f"w{b}-{i}", p, warm) for i, p in enumerate(prompts(b, s.prompt_len, t.vocab, 500 + b))],
              t.device)
    eng.reset_prefix_cache()
    if eng.gate is not None:
        eng.gate.counters = GateCounters()
    if eng.drafter is not None:
        eng.drafter.set_drafts(eng.drafter.k)
    sp = SamplingParams(temperature=0.0, max_tokens=s.decode_tokens, ignore_eos=True, structured_outputs=so)
    ps = prompts(b, s.prompt_len, t.vocab, 100 + b)
    primed = primes_prompts(eng, b, s.prompt_len)
    if primed:     # long prompts: prefilled into the prefix cache first (see primes_prompts)
        prime = timed_run(eng, [(f"p{b}-{i}", p, warm) for i, p in enumerate(ps)], t.device)
    res = timed_run(eng, [(f"d{b}-{i}", p, sp) for i, p in enumerate(ps)], t.device, min_running=b)
    eng.reset_prefix_cache()
    if primed:
        res["ttft_s_mean"] = prime["ttft_s_mean"]
    if b == 1 and kind != "gate" and not (eng.drafter is not None and s.accept_all):
        s.greedy = {"prompt": ps[0], "ids": res["token_ids"]["d1-0"]}
    tok_s = res["decode_tok_s"]
    need = decode_step_bytes(t.model, eng.runner.bytes_per_token, s.prompt_len + s.decode_tokens // 2, b)
    gb_s = need * tok_s / b / 1e9 if need and tok_s else None
    what = {"batch": b, "prompt": s.prompt_len, "new": s.decode_tokens}
    notes = f"TTFT {res['ttft_s_mean'] * 1e3:.0f} ms" + (" (prompts prefilled first)" if primed else "")
    details = {k: v for k, v in res.items() if k != "token_ids"} | {"bytes_per_step": need}
    if eng.gate is not None:
        c = eng.gate.counters
        fire = c.fires / c.rows_checked if c.rows_checked else 0.0
        rows = c.recomputed_rows / max(1, res["generated"])
        what = {"gate": f"fire {100 * fire:.0f}%" + (" (forced)" if kind == "gate" else ""), **what}
        notes += f"; FP4 rows/token {rows:.2f}, reach {eng.gate.reach}"
        details |= {"gate_fire_rate": fire, "gate_forced_fire_rate": rate if kind == "gate" else None,
                    "gate_rows_per_token": rows,
                    "gate_reach": eng.gate.reach}
    elif kind == "bare":
        what = {"gate": "off (bare W2)", **what}
    if kind in ("free", "structured"):
        what = {"output": "JSON-like grammar (xgrammar mask)" if so is not None else "free", **what}
        if so is not None:     # every output must be a prefix the grammar accepts
            backend = eng.grammar_backend()
            compiled = backend.compile(so, None)
            details["grammar_accepts_outputs"] = all(_accepts(backend.new_sequence(compiled, None), ids)
                                                     for ids in res["token_ids"].values())
    if kind == "spec":
        if eng.drafter is not None:
            st = eng.drafter.counters.stats()
            what = {"MTP drafts": rate, **what}
            notes += (f"; {st['spec_mean_tokens_per_step']:.2f} tokens/step, acceptance "
                      f"{100 * st['spec_acceptance_rate']:.0f}%" + (" (every draft kept: --accept-all)"
                                                                    if s.accept_all else ""))
            details |= {"spec_drafts": rate, "spec_accept_all": s.accept_all} | st
        else:
            what = {"MTP drafts": 0, **what}
    report.add({"scenario": "decode", "shape": t.label, "system": "moet", "batch": b,
                "config": config_text(t, s, **what),
                "tok_s": tok_s, "gb_s": gb_s,
                "pct_roofline": 100 * gb_s / roof["GBps"] if gb_s and roof else None,
                "notes": notes, "details": details})


def primes_prompts(eng, batch: int, prompt_len: int) -> bool:
    """Whether a decode row prefills its prompts into the prefix cache before the timed run: when
    one step cannot prefill the whole batch (long prompts), chunked prefill staggers the sequences,
    the first ones decode (in mixed steps) while the last still prefill and may finish before every
    sequence decodes, so no step would be a batch-B decode step. Primed, the timed run's prompts hit
    the cache and all B sequences decode together at the full context; TTFT is then the priming
    run's."""
    cfg = eng.config
    return cfg.cache.enable_prefix_caching and batch * prompt_len > cfg.scheduler.max_num_batched_tokens


def run_prefill(t: Target, s: Settings) -> None:
    from moet.sampling_params import SamplingParams

    eng = t.engine
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timed_run(eng, [("warm", prompts(1, min(512, eng.max_model_len - 2), t.vocab, 3)[0], sp)], t.device)
    for n in s.tokens:
        if not s.budget.ok(30):
            s.report.note("prefill", f"skipped {n}", "time budget (--budget-s) spent")
            continue
        eng.reset_prefix_cache()
        res = timed_run(eng, [("p", prompts(1, n, t.vocab, 4 + n)[0], sp)], t.device)
        s.report.add({"scenario": "prefill", "shape": t.label, "system": "moet", "tokens": n,
                      "config": config_text(t, s, prompt=n), "tok_s": n / res["ttft_s_mean"],
                      "notes": f"TTFT {res['ttft_s_mean'] * 1e3:.0f} ms",
                      "details": {k: v for k, v in res.items() if k != "token_ids"}})
    eng.reset_prefix_cache()
