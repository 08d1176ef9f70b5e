"""Check after full-v5 (2026-12-01, not part of the recipe): the facts probe (every country x the
4 held-out phrasings, greedy, NVFP4 experts on CPU) split by phrasing, with the most frequent wrong
answers: are v5's misses spread out or clustered?

    PYTHONPATH=src:. python tools/train_tiny/runs/full-v5/facts_by_phrasing.py CKPT_DIR OUT.json
"""
import collections
import json
import sys

import torch

from moet.probe import chat_format, facts
from moet.probe.loader import load
from moet.probe.run import greedy

ckpt, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = load(ckpt, "nvfp4", "cpu")
cases = facts.eval_cases()
outs = greedy(m, cases, 24, 16)
res = {"ckpt": ckpt, "n": len(cases), "by_phrasing": {}}
for p in facts.HELDOUT_PHRASINGS:
    rows = [(c, chat_format.parse_reply(o).content) for c, o in zip(cases, outs)
            if c.messages[0]["content"] == facts._fill(p, c.meta["country"], c.meta["expected"])]
    ok = [facts.is_correct(a, c.meta["expected"], c.meta["country"]) for c, a in rows]
    wrong = collections.Counter(a for (c, a), k in zip(rows, ok) if not k)
    res["by_phrasing"][p] = {"n": len(rows), "accuracy": round(sum(ok) / len(rows), 4),
                             "top_wrong_answers": wrong.most_common(4)}
res["accuracy"] = round(sum(v["accuracy"] * v["n"] for v in res["by_phrasing"].values()) / len(cases), 4)
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
