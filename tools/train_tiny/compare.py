"""Does a re-run reproduce a run? Compares two summaries (summary.json from a run, or
summary_shipped.json after tools.train_tiny.ingest) of the same recipe and seed:

    python -m tools.train_tiny.compare A/summary.json B/summary.json [--markdown]

- training curve: loss and MTP loss at every logged step both have (largest and final gap);
- every probe number both measured for the same expert format and device kind. A pass rate
  is "within noise" when the gap is at most two standard errors of a difference of two
  binomial rates over the probe's n cases (the probes are greedy and deterministic, so the
  spread is between trained models, not between evaluations); code loss within 1% relative.
Exit status 0 when everything compared is within noise, 1 otherwise, 2 on unusable input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# (probe, key, share of the probe's n cases the rate is over): tools cases are 3/5 calls,
# 1/5 declines, 1/5 answers from a result; needle <= 2K is 4 of the 6 full-budget lengths.
RATES = (("facts", "accuracy", 1.0), ("arithmetic", "accuracy", 1.0), ("needle", "pass_rate", 1.0),
         ("needle", "pass_rate_upto_2048", 4 / 6), ("tools", "call_valid", 0.6), ("tools", "call_right_function", 0.6),
         ("tools", "call_right_arguments", 0.6), ("tools", "declines_when_no_tool_fits", 0.2),
         ("tools", "answers_from_result", 0.2), ("tools", "overall", 1.0))
CODE_LOSS_REL = 0.01


def _device_kind(p: dict) -> str:
    return "cuda" if str(p.get("device", "")).startswith("cuda") else "cpu"


def curve_gap(a: dict, b: dict) -> dict:
    ha, hb = {h["step"]: h for h in a.get("history", [])}, {h["step"]: h for h in b.get("history", [])}
    steps = sorted(set(ha) & set(hb))
    if not steps:
        return {}
    gaps = [abs(ha[s]["loss"] - hb[s]["loss"]) for s in steps]
    last = steps[-1]
    return {"steps": len(steps), "max_loss_gap": round(max(gaps), 4), "at_step": steps[gaps.index(max(gaps))],
            "final_step": last, "final_loss": (ha[last]["loss"], hb[last]["loss"]),
            "final_mtp_loss": (ha[last]["mtp_loss"], hb[last]["mtp_loss"])}


def rate_noise(pa: float, pb: float, n: int) -> float:
    """Two standard errors of pa - pb for two independent n-case binomial rates (pooled p; at
    least one case's worth, so a 100% vs 100% comparison is not a zero-width test)."""
    p = (pa + pb) / 2
    return max(2 * math.sqrt(2 * p * (1 - p) / n), 1 / n)


def compare(a: dict, b: dict) -> list[dict]:
    rows = []
    for fmt in a.get("probes", {}):
        pa, pb = a["probes"][fmt], b.get("probes", {}).get(fmt)
        if not pb or _device_kind(pa) != _device_kind(pb):
            continue
        ca, cb = pa.get("code", {}), pb.get("code", {})
        if "loss" in ca and "loss" in cb:
            gap = cb["loss"] - ca["loss"]
            tol = CODE_LOSS_REL * ca["loss"]
            rows.append({"format": fmt, "metric": "code.loss", "a": ca["loss"], "b": cb["loss"], "gap": round(gap, 4),
                         "tolerance": round(tol, 4), "within": abs(gap) <= tol})
        for probe, key, share in RATES:
            va, vb = pa.get(probe, {}).get(key), pb.get(probe, {}).get(key)
            if not (isinstance(va, (int, float)) and isinstance(vb, (int, float))) or math.isnan(va) or math.isnan(vb):
                continue
            n = max(1, round(min(pa[probe]["n"], pb[probe]["n"]) * share))
            tol = rate_noise(va, vb, n)
            rows.append({"format": fmt, "metric": f"{probe}.{key}", "a": va, "b": vb, "gap": round(vb - va, 4),
                         "tolerance": round(tol, 4), "n": n, "within": abs(vb - va) <= tol})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table (for the card's notes)")
    args = ap.parse_args(argv)
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    ra, rb = a.get("recipe", {}), b.get("recipe", {})
    if (ra.get("name"), ra.get("seed")) != (rb.get("name"), rb.get("seed")):
        print(f"different recipe/seed: {ra.get('name')}/{ra.get('seed')} vs {rb.get('name')}/{rb.get('seed')}",
              file=sys.stderr)
        return 2
    curve = curve_gap(a, b)
    rows = compare(a, b)
    if not rows and not curve:
        print("nothing in common to compare", file=sys.stderr)
        return 2
    print(f"recipe {ra['name']} seed {ra['seed']}: {args.a} vs {args.b}")
    if curve:
        print(f"training curve over {curve['steps']} logged steps: largest loss gap {curve['max_loss_gap']} "
              f"(step {curve['at_step']}); final loss {curve['final_loss'][0]} vs {curve['final_loss'][1]}, "
              f"MTP {curve['final_mtp_loss'][0]} vs {curve['final_mtp_loss'][1]}")
    if args.markdown:
        print("\n| experts | metric | run A | run B | gap | noise (2 s.e.) | within |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if args.markdown:
            print(f"| {r['format']} | {r['metric']} | {r['a']} | {r['b']} | {r['gap']:+} | {r['tolerance']} | "
                  f"{'yes' if r['within'] else '**no**'} |")
        else:
            print(f"{r['format']:6s} {r['metric']:36s} {r['a']:>8} {r['b']:>8} gap {r['gap']:+.4f} "
                  f"(noise {r['tolerance']:.4f}{', n ' + str(r['n']) if 'n' in r else ''}) "
                  f"{'ok' if r['within'] else 'OUTSIDE NOISE'}")
    outside = [r for r in rows if not r["within"]]
    print(f"{len(rows) - len(outside)}/{len(rows)} numbers within noise")
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(main())
