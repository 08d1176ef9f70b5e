"""`moet probe [CKPT] [--experts bf16|nvfp4|w2|all ...] [--expert-activations bf16|e4m3] [--device D]
[--budget B] [--json OUT]`: each probe's result as one JSON line on stdout, a progress bar (tasks
done / total, rate, time left) on stderr. The probes run through moet's engine (moet.LLM,
moet.probe.engine); only --expert-activations e4m3 runs transformers' forward (moet.probe.loader)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The gate thresholds `--experts w2+gate` runs by default: the measured curve's range
DEFAULT_TAUS = (0.95, 0.96, 0.97, 0.99)


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="quality probes (code loss, MTP, facts, arithmetic, needle, tools) per expert format",
        description="Run moet-tiny's probes through moet's engine (moet.LLM) with the routed experts in each "
                    "requested format: greedy generation and prompt logprobs on the engine, the MTP head on "
                    "the engine's model (the scheduler has no MTP step). With bf16 among the formats, bf16 "
                    "runs first and every other format's code probe adds its top-1 agreement with bf16 and "
                    "a KL estimate from both formats' top-K logprobs (docs/architecture.md, probes). Activations are "
                    "float32 on CPU, bfloat16 on CUDA.")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face repo id (default: the shipped moet-tiny)")
    p.add_argument("--experts", action="append", choices=["bf16", "nvfp4", "fp4", "w2", "w2+gate", "all"],
                   help="expert format (fp4 = nvfp4, the engine's name); w2+gate: W2 experts with the FP4 repair "
                        "tier and the confidence gate, once per --gate-tau; repeat for several, 'all' for every "
                        "one (default: nvfp4)")
    p.add_argument("--gate-tau", action="append", type=float, metavar="P",
                   help=f"the gate's thresholds for w2+gate, repeatable (default: {' '.join(map(str, DEFAULT_TAUS))})")
    p.add_argument("--gate-reach", type=int, default=None, metavar="N",
                   help="positions a repair recomputes before the fired one (default: the engine's)")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="decode with K MTP drafts per step (--speculative-config); adds tokens per step and "
                        "draft acceptance to each generation probe")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "nvfp4"],
                   help="the engine's KV cache format (default auto: the model dtype)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="also write the quality table (one row per format / tau) as markdown")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also plot arithmetic and facts accuracy against the gate's fire rate (needs matplotlib)")
    p.add_argument("--expert-activations", default="bf16", choices=["bf16", "e4m3"],
                   help="what the routed experts' matmuls read: bf16 = the model's dtype, unquantized "
                        "(default); e4m3 = the PTX W2 kernel's float8 activations (hidden state per "
                        "token and SwiGLU output per token-expert pair, scale amax/448, RNE, saturating), "
                        "emulated in transformers' forward: the engine has no such kernel")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--budget", default="quick", choices=["tiny", "quick", "full"],
                   help="probe sizes: tiny (seconds on CPU), quick, full (the model card's)")
    p.add_argument("--needle-lengths", default=None, metavar="N,N",
                   help="needle prompt lengths in tokens (default: the budget's)")
    p.add_argument("--needle-depths", default=None, metavar="D,D",
                   help="needle depths in [0, 1] (default: the budget's)")
    p.add_argument("--needle-trials", type=int, default=None, metavar="N",
                   help="needle prompts per length and depth")
    p.add_argument("--needle-map", default=None, metavar="FILE.png",
                   help="also draw needle pass rate, depth x length")
    p.add_argument("--only", action="append", choices=["code", "facts", "arithmetic", "needle", "tools"],
                   help="run only these probes (repeatable)")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                   help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
    return p


def _device(text: str | None) -> str:
    """--device checked before anything loads."""
    import torch

    from moet.errors import ConfigError

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"--device {text}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {text}: not supported; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device {text}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    return text


def formats(requested: list[str] | None, taus: list[float] | None = None) -> list[str]:
    """--experts values -> the variants to run, in order, bf16 first when present (the others'
    code probes compare with it); w2+gate becomes one w2+gate@TAU per tau."""
    from moet.errors import ConfigError
    from moet.probe.engine import gate_variant

    taus = taus or list(DEFAULT_TAUS)
    bad = [t for t in taus if not 0.0 <= t <= 1.0]
    if bad:
        raise ConfigError(f"--gate-tau {bad[0]}: a threshold is a probability in [0, 1]")
    fmts = list(dict.fromkeys("nvfp4" if f == "fp4" else f for f in (requested or ["nvfp4"])))
    if "all" in fmts:
        fmts = ["bf16", "nvfp4", "w2", "w2+gate"]
    out = []
    for f in fmts:
        out += [gate_variant(t) for t in taus] if f == "w2+gate" else [f]
    return sorted(dict.fromkeys(out), key=lambda f: f != "bf16")


def budget_of(args):
    """--budget with the --needle-* overrides: a run_all Budget (or the budget's name when none is
    given); bad values are one ConfigError naming the flag."""
    import dataclasses

    from moet.errors import ConfigError
    from moet.probe.run import BUDGETS

    if args.needle_lengths is None and args.needle_depths is None and args.needle_trials is None:
        return args.budget
    b = BUDGETS[args.budget]

    def values(flag, text, kind):
        try:
            out = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"{flag} {text}: a comma-separated list of numbers") from None
        if not out:
            raise ConfigError(f"{flag} {text}: empty")
        return tuple(dict.fromkeys(out))

    lengths = b.needle_lengths if args.needle_lengths is None else values("--needle-lengths", args.needle_lengths, int)
    depths = b.needle_depths if args.needle_depths is None else values("--needle-depths", args.needle_depths, float)
    trials = b.needle_trials if args.needle_trials is None else args.needle_trials
    if min(lengths) < 64:
        raise ConfigError(f"--needle-lengths {args.needle_lengths}: a length is at least 64 tokens (the question "
                          "and the needle need room)")
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"--needle-depths {args.needle_depths}: a depth is in [0, 1] (0 = the start)")
    if trials < 1:
        raise ConfigError(f"--needle-trials {trials}: at least 1")
    return dataclasses.replace(b, needle_lengths=tuple(sorted(lengths)), needle_depths=tuple(sorted(depths)),
                               needle_trials=trials)


def run(args) -> int:
    from tqdm import tqdm

    from moet.checkpoint.resolve import resolve_checkpoint
    from moet.probe.distributions import FormatComparison
    from moet.probe.loader import default_checkpoint
    from moet.probe.run import check_needle_lengths, count_tasks, run_all

    ckpt = Path(resolve_checkpoint(args.checkpoint)) if args.checkpoint else default_checkpoint()
    fmts = formats(args.experts, args.gate_tau)
    device = _device(args.device)
    budget = budget_of(args)
    for flag, path in (("--json", args.json_out), ("--markdown", args.markdown), ("--plot", args.plot),
                       ("--needle-map", args.needle_map)):
        if path and not Path(path).absolute().parent.is_dir():
            from moet.errors import ConfigError
            raise ConfigError(f"{flag} {path}: its directory does not exist")
    if args.gate_reach is not None and args.gate_reach < 0:
        from moet.errors import ConfigError
        raise ConfigError(f"--gate-reach {args.gate_reach}: must be >= 0")
    if args.speculative is not None and args.expert_activations != "bf16":
        from moet.errors import ConfigError
        raise ConfigError("--speculative runs moet's engine; --expert-activations e4m3 runs transformers' forward")
    if args.kv_cache_dtype != "auto" and args.expert_activations != "bf16":
        from moet.errors import ConfigError
        raise ConfigError("--kv-cache-dtype sets moet's engine; --expert-activations e4m3 runs transformers' forward")
    if args.expert_activations != "bf16" and any(f.startswith("w2+gate") for f in fmts):
        from moet.errors import ConfigError
        raise ConfigError("--expert-activations e4m3 runs transformers' forward, which has no confidence gate; "
                          "drop w2+gate or --expert-activations")
    only = tuple(args.only) if args.only else None
    open_model = _transformers_opener(ckpt, device, args.expert_activations) \
        if args.expert_activations != "bf16" else _engine_opener(ckpt, device, args.gate_reach, args.speculative,
                                                                 args.kv_cache_dtype)
    comparison = FormatComparison("bf16")
    results = {"checkpoint": str(ckpt), "expert_activations": args.expert_activations,
               "kv_cache_dtype": args.kv_cache_dtype, "formats": {}}
    bar = None
    try:
        for fmt in fmts:
            m = open_model(fmt)
            try:
                if not only or "needle" in only:
                    check_needle_lengths(m, budget)
                if bar is None:                         # every format runs the same tasks
                    bar = tqdm(total=count_tasks(m.tokenizer, budget, only) * len(fmts), unit="task",
                               desc=fmt, file=sys.stderr, dynamic_ncols=True, disable=args.no_progress)
                bar.set_description_str(fmt)
                results["formats"][fmt] = run_all(m, budget, only, progress=bar, comparison=comparison,
                                                  log=lambda rec: _print_line(bar, json.dumps(rec)))
            finally:
                m.close()
            del m
    finally:
        if bar is not None:
            bar.close()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown or args.plot or args.needle_map:
        from moet.probe.report import markdown_table, plot_needle_map, plot_tradeoff
        if args.markdown:
            Path(args.markdown).write_text(markdown_table(results))
        if args.plot:
            plot_tradeoff(results, args.plot)
        if args.needle_map:
            plot_needle_map(results, args.needle_map)
    return 0


def _engine_opener(ckpt: Path, device: str, gate_reach: int | None, speculative: int | None = None,
                   kv_cache_dtype: str = "auto"):
    from moet.probe.engine import open_engine
    extra = {} if gate_reach is None else {"gate_reach": gate_reach}
    spec_kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    spec = {} if speculative is None else {"speculative_config": {"method": "mtp",
                                                                  "num_speculative_tokens": speculative}}
    return lambda fmt: open_engine(ckpt, fmt, device, **spec, **spec_kv,
                                   **(extra if fmt.startswith("w2+gate") else {}))


def _transformers_opener(ckpt: Path, device: str, activations: str):
    """The e4m3 activation study: transformers' forward with the experts' matmuls patched
    (moet.probe.activations); the checkpoint's tensors read once for every format."""
    from moet.probe.loader import load, read_tensors
    tensors = read_tensors(ckpt)
    return lambda fmt: load(ckpt, fmt, device, tensors=tensors, activations=activations)


def _print_line(bar, line: str) -> None:
    """A result line on stdout that does not tear the progress bar on stderr."""
    bar.write(line, file=sys.stdout)
    sys.stdout.flush()
