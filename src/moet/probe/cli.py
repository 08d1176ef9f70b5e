"""`moet probe [CKPT] [--experts bf16|nvfp4|w2|all ...] [--expert-activations bf16|e4m3] [--device D]
[--budget B] [--json OUT]`"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="quality probes (code loss, MTP, facts, arithmetic, needle, tools) per expert format",
        description="Run moet-tiny's probes through transformers' DeepseekV3ForCausalLM with the routed "
                    "experts decoded from the checkpoint in each requested format.")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint directory (default: the shipped moet-tiny)")
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
    p.add_argument("--json", dest="json_out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import torch

    from moet.probe.loader import default_checkpoint, load, read_tensors
    from moet.probe.run import run_all

    ckpt = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    fmts = args.experts or ["nvfp4"]
    if "all" in fmts:
        fmts = ["bf16", "nvfp4", "w2"]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tensors = read_tensors(ckpt)
    results = {"checkpoint": str(ckpt), "expert_activations": args.expert_activations, "formats": {}}
    for fmt in dict.fromkeys(fmts):
        m = load(ckpt, fmt, device, tensors=tensors, activations=args.expert_activations)
        res = run_all(m, args.budget, tuple(args.only) if args.only else None,
                      log=lambda rec: print(json.dumps(rec), flush=True))
        results["formats"][fmt] = res
        del m
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    return 0
