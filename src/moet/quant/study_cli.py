"""`moet quant-study CHECKPOINT`: run the codebook study over every routed-expert tensor."""
from __future__ import annotations

import argparse
import json
import sys


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quant-study", help="which 4-level codebook each routed-expert tensor of a checkpoint wants",
                       description="For every routed-expert tensor: the best 4-level e2m1 subset (1365 candidates) "
                                   "and the best mirror set {-b,-a,a,b} (21), with bias and relRMS; then a summary. "
                                   "docs/formats.md explains the study.")
    p.add_argument("checkpoint", help="checkpoint directory or Hugging Face repo id (BF16, FP8 block-128, NVFP4 "
                                      "or MXFP4 weights)")
    p.add_argument("--json", action="store_true", help="print per-tensor rows and the summary as JSON on stdout")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="study only the first N expert matrices")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from moet.quant.codebook_study import as_dict, study_histogram, summarize, unit_space_histogram
    from moet.quant.expert_tensors import ExpertTensorReader

    from moet.checkpoint.resolve import resolve_checkpoint

    if args.limit is not None and args.limit < 1:
        from moet.errors import ConfigError
        raise ConfigError(f"--limit {args.limit}: must be >= 1")
    reader = ExpertTensorReader(resolve_checkpoint(args.checkpoint))
    rows = []
    bar = tqdm(total=reader.total_native_bytes(), unit="B", unit_scale=True, unit_divisor=1024,
               desc="quant-study", file=sys.stderr, disable=args.no_progress)
    for i, m in enumerate(reader):
        if args.limit is not None and i >= args.limit:
            break
        rows.append(study_histogram(unit_space_histogram(m), m.name, m.layer, m.expert))
        bar.update(m.native_bytes)
    bar.close()
    summary = summarize(rows)
    if args.json:
        json.dump({"checkpoint": str(args.checkpoint), "summary": as_dict(summary),
                   "tensors": [as_dict(r) for r in rows]}, sys.stdout, indent=1)
        print()
        return 0
    s = summary
    fmt = lambda t: "{" + ", ".join(f"{v:g}" for v in t) + "}"  # noqa: E731
    print(f"{'tensor':<52} {'best 4-subset':<22} {'bias':>8} {'relRMS':>7}   {'best mirror':<18} {'bias':>8} {'relRMS':>7}")
    for r in rows[:20]:
        print(f"{r.name[-52:]:<52} {fmt(r.best_set):<22} {r.best_bias:>+8.4f} {r.best_rel_rms:>7.4f}   "
              f"{fmt(r.sym_set):<18} {r.sym_bias:>+8.4f} {r.sym_rel_rms:>7.4f}")
    if len(rows) > 20:
        print(f"... {len(rows) - 20} more (use --json for all)")
    print(f"\n{s.tensors} expert tensors")
    print(f"  mirror sets: {{-4,-1,1,4}} chosen by {s.share_sym_choosing_w2_set:.1%} of tensors; "
          f"overall best is a mirror set for {s.share_best_is_mirror:.1%}")
    print(f"  mean |bias|: asymmetric {s.mean_abs_bias_asym:.4f}, symmetric {s.mean_abs_bias_sym:.4f} "
          f"(ratio {s.bias_ratio_asym_over_sym:.1f}x); asymmetric mean signed bias {s.mean_signed_bias_asym:+.4f}, "
          f"negative on {s.share_asym_bias_negative:.1%}")
    print(f"  mean relRMS: asymmetric {s.mean_rel_rms_asym:.4f}, symmetric {s.mean_rel_rms_sym:.4f} "
          f"(penalty {s.rel_rms_penalty_pct:+.2f}%)")
    return 0
