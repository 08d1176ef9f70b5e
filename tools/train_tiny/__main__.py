"""Train moet-tiny end to end:

    python -m tools.train_tiny --recipe full --out OUT [--device cuda]

OUT/moet-tiny/   the checkpoint (NVFP4 experts) + tokenizer + MODEL_CARD.md
OUT/run_log.jsonl  one JSON record per event (corpus, tokenizer, data, steps, probes, timings)
OUT/summary.json   everything the model card is written from

Stages: corpus -> tokenizer -> rows -> self-check against transformers -> train ->
calibrate -> export -> probes (BF16 / NVFP4 / W2 experts) -> card.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

# Repository root on sys.path so that `python tools/train_tiny/__main__.py` works too.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
if str(_ROOT / "src") not in sys.path:
    sys.path.insert(1, str(_ROOT / "src"))


class RunLog:
    def __init__(self, path: Path):
        self.path, self.t0 = path, time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("w")

    def __call__(self, rec) -> None:
        if isinstance(rec, str):
            rec = {"msg": rec}
        rec = {"t": round(time.time() - self.t0, 1), **rec}
        line = json.dumps(rec, default=str)
        self.f.write(line + "\n")
        self.f.flush()
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="full", choices=["full", "full-v2", "full-v3", "full-v4", "full-v5", "smoke",
                                                         "micro", "micro-v3", "micro-v4", "micro-v5"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default=None, help="default: cuda if available else cpu")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    ap.add_argument("--compile", default=None, choices=["none", "layers"], help="override the recipe")
    ap.add_argument("--bench", action="store_true",
                    help="smoke only: time eager vs compiled steps before the short training run")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--pack", type=Path, default=None,
                    help="also write the checkpoint as tar parts of <= 15 MiB into this folder, right after export")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which remaining probes are skipped")
    args = ap.parse_args(argv)

    from tools.train_tiny import recipe as R
    over = {k: v for k, v in (("steps", args.steps), ("compile", args.compile)) if v is not None}
    rec = R.get(args.recipe, **over)
    from tools.train_tiny.pipeline import run
    return run(rec, args.out, device=args.device, workers=args.workers or os.cpu_count() or 2,
               bench=args.bench, log=RunLog(args.out / "run_log.jsonl"), pack=args.pack, deadline_s=args.deadline,
               env={"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "python": platform.python_version(), "host_cpus": os.cpu_count(),
                    "seed_check": random.Random(0).random()})


if __name__ == "__main__":
    raise SystemExit(main())
