"""`moet probe [CKPT] [--experts bf16|nvfp4|w2|all ...] [--expert-activations bf16|e4m3] [--device D]
[--budget B] [--json OUT]`: each probe's result as one JSON line on stdout, a progress bar (tasks
done / total, rate, time left) on stderr."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="quality probes (code loss, MTP, facts, arithmetic, needle, tools) per expert format",
        description="Run moet-tiny's probes through transformers' DeepseekV3ForCausalLM with the routed "
                    "experts decoded from the checkpoint in each requested format.")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face repo id (default: the shipped moet-tiny)")
    p.add_argument("--experts", action="append", choices=["bf16", "nvfp4", "w2", "all"],
                   help="expert format; repeat for several, 'all' for every one (default: nvfp4)")
    p.add_argument("--expert-activations", default="bf16", choices=["bf16", "e4m3"],
                   help="what the routed experts' matmuls read: bf16 = the model's dtype, unquantized "
                        "(default); e4m3 = the PTX W2 kernel's float8 activations (hidden state per "
                        "token and SwiGLU output per token-expert pair, scale amax/448, RNE, saturating)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--budget", default="quick", choices=["tiny", "quick", "full"],
                   help="probe sizes: tiny (seconds on CPU), quick, full (the model card's)")
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


def run(args) -> int:
    from tqdm import tqdm

    from moet.checkpoint.resolve import resolve_checkpoint
    from moet.probe.loader import default_checkpoint, load, read_tensors
    from moet.probe.run import count_tasks, run_all

    ckpt = Path(resolve_checkpoint(args.checkpoint)) if args.checkpoint else default_checkpoint()
    fmts = list(dict.fromkeys(args.experts or ["nvfp4"]))
    if "all" in fmts:
        fmts = ["bf16", "nvfp4", "w2"]
    device = _device(args.device)
    if args.json_out and not Path(args.json_out).parent.is_dir():
        from moet.errors import ConfigError
        raise ConfigError(f"--json {args.json_out}: its directory does not exist")
    only = tuple(args.only) if args.only else None
    tensors = read_tensors(ckpt)
    results = {"checkpoint": str(ckpt), "expert_activations": args.expert_activations, "formats": {}}
    bar = None
    try:
        for fmt in fmts:
            m = load(ckpt, fmt, device, tensors=tensors, activations=args.expert_activations)
            if bar is None:                         # every format runs the same tasks
                bar = tqdm(total=count_tasks(m.tokenizer, args.budget, only) * len(fmts), unit="task", desc=fmt,
                           file=sys.stderr, dynamic_ncols=True, disable=args.no_progress)
            bar.set_description_str(fmt)
            res = run_all(m, args.budget, only, progress=bar, log=lambda rec: _print_line(bar, json.dumps(rec)))
            results["formats"][fmt] = res
            del m
    finally:
        if bar is not None:
            bar.close()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _print_line(bar, line: str) -> None:
    """A result line on stdout that does not tear the progress bar on stderr."""
    bar.write(line, file=sys.stdout)
    sys.stdout.flush()
