"""Diagnostic (device): why does the engine's first token differ from the contiguous reference on
a random-weight Qwen3-30B-shaped model? Measures the model's own sensitivity to bf16-level noise
(the reference with the embedding output perturbed by 2^-9 relative) next to engine vs reference,
so "differs" can be read as chaos of the random model or as a bug.

    PYTHONPATH=src python tools/kernel_lab/engine_diag.py --out $OUT [--model qwen3_30b]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch

from moet.bench import engine_bench as eb
from moet.sampling_params import SamplingParams


def top(lp: torch.Tensor, k: int = 20) -> dict[int, float]:
    v, i = torch.topk(lp, k)
    return dict(zip(i.tolist(), v.tolist()))


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    both = set(a) & set(b)
    return {"top1_same": max(a, key=a.get) == max(b, key=b.get), "top20_overlap": len(both),
            "max_abs_dlogprob_on_overlap": max((abs(a[t] - b[t]) for t in both), default=None)}


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--model", default="qwen3_30b")
    ap.add_argument("--lengths", default="17,64,300")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, cfg = eb.MODELS[args.model] if dev.type == "cuda" else ("smoke", eb.SMOKE)
    model = eb.random_model(cfg, dev)
    res = {"model": name, "prompts": []}
    lens = [int(x) for x in args.lengths.split(",")]
    ps = [p[:n] for p, n in zip(eb.prompts(len(lens), max(lens), cfg["vocab_size"], 1), lens)]

    def ref_lp(p, noise: float = 0.0, seed: int = 0):
        hook = None
        if noise:
            g = torch.Generator(device=dev).manual_seed(seed)
            hook = model.model.embed_tokens.register_forward_hook(
                lambda m, i, o: o * (1 + noise * torch.randn(o.shape, device=dev, generator=g)).to(o.dtype))
        cache = model.new_cache(len(p) + 1, dev)
        h = model.hidden_states(torch.tensor(p, device=dev), 0, cache)
        if hook:
            hook.remove()
        lg = model.logits(h[-1:]).float()[0]
        return lg.log_softmax(-1), h[-1].float(), lg

    for p in ps:
        lp, h, lg = ref_lp(p)
        s = torch.sort(lg, descending=True).values
        row = {"len": len(p), "final_hidden_rms": float(h.pow(2).mean().sqrt()), "logit_std": float(lg.std()),
               "top1_top2_gap": float(s[0] - s[1])}
        ref = top(lp)
        for i, nz in enumerate((2 ** -9, 2 ** -9, 2 ** -12)):
            lp2, h2, _ = ref_lp(p, nz, seed=i + 1)
            row[f"noise_{nz:.1e}_seed{i}"] = {**compare(ref, top(lp2)),
                                               "hidden_relerr": float((h2 - h).norm() / h.norm())}
        lp3, h3, _ = ref_lp(p)
        row["ref_rerun_identical"] = bool(torch.equal(lp3, lp))
        res["prompts"].append(row)
        print(row, flush=True)

    ns = SimpleNamespace(streams="1,4", prefill=512, gpu_memory_utilization=0.85, kv_cache_memory_gb=8.0,
                         enforce_eager=False)
    eng = eb.make_engine(model, cfg, dev, ns, 1024)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20)
    for mode in ("one_at_a_time", "batched"):
        groups = [[(i, p)] for i, p in enumerate(ps)] if mode == "one_at_a_time" else [list(enumerate(ps))]
        for grp in groups:
            done = eng.generate_all([(f"{mode}{i}", p, sp) for i, p in grp])
            eng.reset_prefix_cache()
            for i, p in grp:
                got = {t: v.logprob for t, v in done[f"{mode}{i}"].outputs[0].logprobs[0].items()}
                lp, _, _ = ref_lp(p)
                c = compare(top(lp), got)
                res["prompts"][i][f"engine_{mode}"] = c
                print(mode, len(p), c, flush=True)
    with open(os.path.join(args.out, f"engine_diag_{args.model}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    t = time.time()
    main()
    print(f"done in {time.time() - t:.0f} s")
