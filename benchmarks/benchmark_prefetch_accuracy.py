"""Expert prefetch accuracy on a real checkpoint (default: the shipped moet-tiny), any device:
greedy generation of a few prompts with the device expert cache capped, prefetch on and off.

    python benchmarks/benchmark_prefetch_accuracy.py [CHECKPOINT] [--fractions 0.25,0.5] [--max-tokens 24] [--out FILE]

Per cache fraction: precision / recall of the guesses (layer L+1's experts predicted from layer
L's post-attention residual, as sets per layer and step), rows prefetched and how many the step
then used (misses saved), first-pass misses and replays with prefetch on vs off, and whether the
two runs' token ids and logprobs are identical (they must be: exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\nx = np.",
           "Once upon a time, in a small village,"]
KEYS = ("expert_prefetch_precision", "expert_prefetch_recall", "expert_prefetch_predicted_total",
        "expert_prefetch_rows_total", "expert_prefetch_misses_saved_total", "expert_first_pass_misses_total",
        "expert_replays_total", "expert_cache_hit_rate", "expert_rows_fetched_total")


def main(argv=None) -> int:
    from moet.assets import default_model
    from moet.checkpoint import open_checkpoint
    from moet.store import pack_layers
    from moet.llm import LLM
    from moet.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=default_model())
    ap.add_argument("--fractions", default="0.25,0.5", help="device cache sizes as shares of all expert rows")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=2, ignore_eos=True)
    spec = open_checkpoint(a.model).spec
    rows = len(pack_layers(spec)) * spec.router.num_experts
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as packs:
        for frac in (float(f) for f in a.fractions.split(",")):
            runs = {}
            for on in (True, False):
                kw = dict(pack_dir=packs, expert_prefetch=on, device=a.device, max_num_seqs=1, dtype="float32")
                with LLM(a.model, expert_cache_slots=max(1, int(rows * frac)), **kw) as llm:
                    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
                    st = llm.engine.stats().extra
                runs[on] = ([(o.outputs[0].token_ids, [{t: v.logprob for t, v in d.items()}
                                                       for d in o.outputs[0].logprobs]) for o in outs], st)
            same = runs[True][0] == runs[False][0]
            ok &= same
            r = {"slots": int(rows * frac), "rows": rows, "identical_on_off": same,
                 "on": {k: runs[True][1][k] for k in KEYS}, "off": {k: runs[False][1][k] for k in KEYS}}
            results[f"{frac:g}"] = r
            print(json.dumps({f"{frac:g}": r}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
