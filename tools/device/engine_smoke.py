"""GPU smoke of the engine on the shipped moet-tiny: CUDA graphs, determinism, batched decode.

    python tools/device/engine_smoke.py --out $OUT [--budget-s 90]

For each expert format: six identical greedy runs of a small mixed batch must give identical
token ids and logprobs (issue 6's determinism check on the device); single-stream and batched
decode rates are printed (moet-tiny is tiny: launch-bound, not a roofline number). Exits 1 on
any mismatch. JSON to $OUT/engine_smoke.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from moet import LLM, SamplingParams

PROMPTS = ["What is the capital of Poland?", "What is 17 + 25?", "Name a prime number larger than 10.",
           "Write a Python function that returns the square of x."]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(llm: LLM, n_prompts: int, max_tokens: int):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:n_prompts]]
    sync()
    t0 = time.perf_counter()
    outs = llm.chat(msgs, sp, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    sig = [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in lp.items()) for lp in o.outputs[0].logprobs])
           for o in outs]
    return sig, dt, [o.outputs[0].text for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=90)
    ap.add_argument("--formats", default="w2,fp4")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    start = time.perf_counter()
    result, ok = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu", "torch": torch.__version__, "runs": []}, True
    for fmt in args.formats.split(","):
        if time.perf_counter() - start > args.budget_s:
            result["runs"].append({"format": fmt, "skipped": "budget"})
            continue
        t0 = time.perf_counter()
        llm = LLM(os.path.join(os.path.dirname(__file__), "..", "..", "src", "moet", "assets", "moet-tiny"),
                  expert_format=fmt, device=args.device, max_num_seqs=8)
        load_s = time.perf_counter() - t0
        runner = llm.engine.runner
        row = {"format": fmt, "load_s": round(load_s, 2)}
        sigs, texts = [], None
        for i in range(6):
            sig, dt, texts = run_once(llm, 4, 32)
            sigs.append(sig)
            row.setdefault("batch4_s", []).append(round(dt, 3))
        row["identical_6_runs"] = all(s == sigs[0] for s in sigs)
        ok &= row["identical_6_runs"]
        _, dt1, _ = run_once(llm, 1, 64)
        row["single_stream_tok_s"] = round(64 / dt1, 1)
        row["batch4_tok_s"] = round(4 * 32 / min(row["batch4_s"]), 1)
        row["texts"] = texts
        row["graphs_captured"] = sorted(runner.graphs)       # captured lazily or at boot
        row["graph_error"] = runner.graph_error
        print(json.dumps(row), flush=True)
        result["runs"].append(row)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["ok"] = ok
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_smoke.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("engine smoke", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
