"""`moet bench {decode,prefill,residency,serve,all} [MODEL | --shape NAME] [--out DIR] ...`:
benchmarks as users run them, one table per scenario (printed, DIR/bench.json, DIR/bench.md)
and plots (DIR/*.png, with the `bench` extra's matplotlib)."""
from __future__ import annotations

import argparse
import sys

from moet.errors import ConfigError

SCENARIO_CHOICES = ("decode", "prefill", "residency", "serve", "all")
# this command's own flags: every other dest of its parser is an EngineConfig field
OWN = {"scenario", "model_flag", "shape", "layers", "batch", "tokens", "decode_tokens", "prompt_len", "gpu_budget_gb",
       "residency_batch", "requests", "concurrency", "peer", "budget_s", "out", "func", "command", "bench_engine", "gate_fire", "speculative", "accept_all", "structured"}


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    from moet.bench.shapes import SHAPES
    from moet.config import HelpFormatter, add_cli_arguments, add_help_all, argument_group

    p = subparsers.add_parser(
        "bench", help="benchmarks: decode, prefill, residency, serve (tables, JSON, markdown, plots)",
        formatter_class=HelpFormatter,
        usage="moet bench {decode,prefill,residency,serve,all} [MODEL | --shape NAME] [options]",
        description="Time moet's engine as users run it and write what it measured to --out: bench.json "
                    "(rewritten after every measurement), bench.md (one table per scenario: device, date, "
                    "commit, shape, config, tok/s, GB/s, % of roofline, peer ratio) and PNG plots "
                    "(matplotlib: pip install 'moet[bench]'). decode: single-stream and aggregate tok/s per "
                    "--batch, TTFT, GB/s = bytes a decode step must read / step time, % of the roofline "
                    "measured in the same run (bf16 GEMV on a GPU, a memory copy on a CPU). prefill: one "
                    "prompt per --tokens. residency: experts through the expert store on smaller cards "
                    "(--gpu-budget-gb) against all resident. serve: the HTTP server against the Python API. "
                    "Correctness is checked before anything is timed. Engine flags are those of moet serve.")
    p.add_argument("scenario", choices=SCENARIO_CHOICES, metavar="SCENARIO",
                   help="decode, prefill, residency, serve or all")
    g = argument_group(p, "benchmark")
    g.add_argument("--shape", default=None, metavar="NAME",
                   help=f"random weights of a named real shape, built on the device: {', '.join(SHAPES)} "
                        "(default: the checkpoint MODEL; serve always runs the checkpoint)")
    g.add_argument("--layers", type=int, default=None, metavar="N",
                   help="with --shape: only its first N decoder layers")
    g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the checkpoint, as MODEL")
    g.add_argument("--batch", default="1,8,32", metavar="B,B", help="decode batch sizes (default: 1,8,32)")
    g.add_argument("--tokens", default="2048,8192", metavar="T,T", help="prefill prompt lengths (default: 2048,8192)")
    g.add_argument("--decode-tokens", type=int, default=128, metavar="N",
                   help="new tokens per request (default: 128)")
    g.add_argument("--prompt-len", type=int, default=128, metavar="N",
                   help="prompt tokens of each decode request (default: 128)")
    g.add_argument("--gpu-budget-gb", default="32,96", metavar="GB,GB",
                   help="residency: cards of this many GB (or N%% of the experts) (default: 32,96)")
    g.add_argument("--residency-batch", default="1,4", metavar="B,B",
                   help="residency: decode batch sizes (default: 1,4)")
    g.add_argument("--requests", type=int, default=64, metavar="N", help="serve: requests per phase (default: 64)")
    g.add_argument("--concurrency", type=int, default=16, metavar="N",
                   help="serve: concurrent streams (default: 16)")
    g.add_argument("--gate-fire", default=None, metavar="R,R",
                   help="decode: time the FP4 confidence gate forced to fire on these shares of steps (e.g. "
                        "0,0.1,0.3,1), beside bare W2 in the same run; with W2 experts. Without it a --shape "
                        "runs bare W2 (random weights' confidence means nothing) and a checkpoint runs as "
                        "configured")
    g.add_argument("--speculative", default=None, metavar="K,K",
                   help="decode: time MTP speculative decoding with these drafts per step (0: off), in one run")
    g.add_argument("--accept-all", action="store_true",
                   help="decode, with --speculative: keep every draft (random weights accept none): the verify step's cost")
    g.add_argument("--structured", action="store_true",
                   help="decode: also under a JSON-like grammar (structured outputs): the mask's cost")
    g.add_argument("--peer", choices=("transformers",), default=None,
                   help="also time transformers' generate() on the same shape / weights in this run: the "
                        "peer ratio (moet tok/s / peer tok/s) for decode and prefill")
    g.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                   help="start no new measurement after this many seconds (default: 540)")
    g.add_argument("--out", default="bench_out", metavar="DIR", help="where results go (default: bench_out)")
    before = {a.dest for a in p._actions}
    add_cli_arguments(p)
    p.set_defaults(bench_engine=sorted({a.dest for a in p._actions} - before - {"model"}), func=run)
    add_help_all(p, "bench")
    p.set_defaults(bench_parser_defaults={d: p.get_default(d) for d in {a.dest for a in p._actions}})
    return p


def int_list(text: str, flag: str, lo: int = 1) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < lo for v in vals):
        raise ConfigError(f"{flag} {text!r}: give comma-separated whole numbers >= {lo}, e.g. 1,8,32")
    return sorted(dict.fromkeys(vals))


def fire_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
        raise ConfigError(f"--gate-fire {text!r}: give comma-separated shares in [0, 1], e.g. 0,0.1,0.3,1")
    return sorted(dict.fromkeys(vals))


def budget_list(text: str) -> list[str]:
    out = []
    for x in (x.strip() for x in text.split(",")):
        try:
            ok = x and float(x[:-1] if x.endswith("%") else x) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--gpu-budget-gb {text!r}: give GB or N% entries, e.g. 32,96")
        out.append(x)
    return out


def settings(args):
    from moet.bench.report import Report, out_dir
    from moet.bench.shapes import cut_shape, shape
    from moet.bench.target import Settings
    from moet.bench.timing import Budget
    from moet.engine.llm_engine import resolve_device

    scenarios = ["decode", "prefill", "residency", "serve"] if args.scenario == "all" else [args.scenario]
    if args.shape is not None:
        cut_shape(args.shape, args.layers)
    elif args.layers is not None:
        raise ConfigError("--layers cuts a --shape: give --shape NAME too")
    if args.scenario == "residency" and args.shape is None:
        raise ConfigError("moet bench residency runs a named shape: give --shape (e.g. --shape glm45air)")
    for flag, v in (("--decode-tokens", args.decode_tokens), ("--prompt-len", args.prompt_len),
                    ("--requests", args.requests), ("--concurrency", args.concurrency)):
        if v < (2 if flag == "--decode-tokens" else 1):
            raise ConfigError(f"{flag} {v}: must be at least {2 if flag == '--decode-tokens' else 1}")
    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s {args.budget_s}: must be positive")
    defaults = args.bench_parser_defaults
    engine_kw = {d: getattr(args, d) for d in args.bench_engine
                 if d != "device" and getattr(args, d) != defaults.get(d)}
    gate_fire = fire_list(args.gate_fire) if args.gate_fire is not None else []
    if gate_fire and (getattr(args, "expert_format", "w2") != "w2" or getattr(args, "fp4_gate", True) is False):
        raise ConfigError("--gate-fire times the FP4 gate over W2 experts: drop --expert-format / --no-fp4-gate")
    speculative = int_list(args.speculative, "--speculative", 0) if args.speculative is not None else []
    if any(k > 4 for k in speculative):
        raise ConfigError(f"--speculative {args.speculative}: drafts per step are 0 to 4")
    if args.accept_all and not any(speculative):
        raise ConfigError("--accept-all keeps MTP drafts: give --speculative K,K too")
    if any(speculative) and args.shape is not None:
        from moet.checkpoint.spec import spec_from_config
        _, cfg = shape(args.shape)
        if not spec_from_config(dict(cfg, num_nextn_predict_layers=1), "bench shape").num_mtp_layers:
            raise ConfigError(f"--speculative: --shape {args.shape} ({cfg['model_type']}) has no MTP layer; use a "
                              "DeepSeek-V3 or GLM-4.5 shape")
    if sum(map(bool, (speculative, gate_fire, args.structured))) > 1:
        raise ConfigError("--speculative, --gate-fire and --structured time different things: run them apart")
    s = Settings(scenarios=scenarios, device=resolve_device(args.device), shape=args.shape, layers=args.layers,
                 model=args.model_flag or args.model, engine_kw=engine_kw,
                 batches=int_list(args.batch, "--batch"), tokens=int_list(args.tokens, "--tokens", 16),
                 decode_tokens=args.decode_tokens, prompt_len=args.prompt_len, peer=args.peer,
                 budget=Budget(args.budget_s), gpu_budgets=budget_list(args.gpu_budget_gb),
                 residency_batches=int_list(args.residency_batch, "--residency-batch"),
                 requests=args.requests, concurrency=args.concurrency, gate_fire=gate_fire,
                 speculative=speculative, accept_all=args.accept_all, structured=args.structured)
    out = out_dir(args.out)
    s.report = Report(out, s.device, {k: v for k, v in vars(args).items()
                                      if k not in ("func", "bench_engine", "bench_parser_defaults")})
    return s


def run(args) -> int:
    import torch

    from moet.errors import MoetError

    s = settings(args)
    report, failed = s.report, False
    report.save()
    engine_scenarios = [x for x in ("decode", "prefill") if x in s.scenarios]
    if engine_scenarios:
        from moet.bench.decode import correctness_first, run_decode, run_prefill
        from moet.bench.roofline import reference_bandwidth
        from moet.bench.target import open_target

        if "decode" in s.scenarios:
            report.roofline = reference_bandwidth(s.device)
            print(f"roofline: {report.roofline['what']}: {report.roofline['GBps']:.0f} GB/s", flush=True)
        longest = max([s.prompt_len + s.decode_tokens + 16, 336]
                      + ([max(s.tokens) + 16] if "prefill" in s.scenarios else []))
        # long decode prompts prefill in steps of up to 8K tokens (priming takes a step per prompt)
        batched = max(512, max(s.tokens) if "prefill" in s.scenarios else 0,
                      min(s.prompt_len, 8192) if "decode" in s.scenarios else 0)
        t = open_target(s, longest, max(s.batches) if "decode" in s.scenarios else 1, batched)
        report.note(engine_scenarios[0], "engine", t.facts)
        peer_args = (t.cfg, t.expert_format, t.checkpoint, next(t.model.parameters()).dtype, t.label)
        try:
            if correctness_first(t, s, engine_scenarios[0]):
                if "decode" in s.scenarios:
                    run_decode(t, s, report.roofline)
                if "prefill" in s.scenarios:
                    run_prefill(t, s)
            else:
                failed = True
        finally:
            t.close()
        if s.peer == "transformers":
            from moet.bench.peer import run_peer
            run_peer(s, *peer_args)
    for scenario in ("residency", "serve"):
        if scenario not in s.scenarios:
            continue
        if not s.budget.ok(60):
            report.note(scenario, "skipped", "time budget (--budget-s) spent")
            continue
        try:
            if scenario == "residency":
                from moet.bench.residency import run_residency
                run_residency(s)
            else:
                from moet.bench.serve import run_serve
                run_serve(s)
        except MoetError:
            raise
        except Exception as exc:        # the other scenarios' numbers stand; the report says why
            failed = True
            report.note(scenario, "error", f"{type(exc).__name__}: {exc}")
            print(f"[{scenario}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
    report.save()
    plots = report.plots()
    print(f"wrote {report.out / 'bench.json'}, {report.out / 'bench.md'}"
          + "".join(f", {p.name}" for p in plots) + f" ({s.budget.elapsed():.0f} s)", flush=True)
    return 1 if failed else 0
