"""Diagnostic run after full-v4 (2026-11-29, not part of the recipe): where does the tool-name copy
fail? 40 first-turn call prompts with v4 training-style random names (fresh seed) vs the first 40
call cases of the tools probe (held-out names); the think line is parsed into (description quoted,
name after ->) and each step is scored against the target tool."""
import json, random, re, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from moet.probe import chat_format, tools
from moet.probe.chat_format import Conversation
from moet.probe.loader import load
from moet.probe.run import greedy
from tools.train_tiny import tool_tasks_v4 as v4

# usage: PYTHONPATH=src:. python tools/train_tiny/runs/full-v4/tool_diag.py CKPT_DIR nvfp4 40
ckpt, fmt, n_in = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
rng = random.Random(777001)
indist = []
while len(indist) < n_in:
    c = v4.sample(rng)
    if not c.enable_thinking or c.meta.get("kind") != "call":
        continue
    first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
    if any(m["role"] == "user" for m in c.messages[:first_user]):
        continue
    msgs = c.messages[:first_user + 1]
    indist.append(Conversation(msgs, c.tools, True, c.meta))
probe = [c for c in tools.eval_cases(120) if c.meta["kind"] == "call"][:40]
torch.manual_seed(0)
m = load(ckpt, fmt, "cpu")
res = {}
for label, cases in (("in_distribution_v4_names", indist), ("probe_heldout_names", probe)):
    t = time.time()
    outs = greedy(m, cases, 96, 16)
    rows = []
    for c, o in zip(cases, outs):
        desc = {t_["function"]["name"]: t_["function"]["description"] for t_ in c.tools}
        target = c.meta["name"]
        mt = re.search(r"<think>(.*?)</think>", o, re.S)
        think = mt.group(1) if mt else ""
        mm = re.search(r'"(.*)" -> (\S+)', think)
        q_desc, t_name = (mm.group(1), mm.group(2)) if mm else (None, None)
        sc = tools.score(chat_format.parse_reply(o), c.meta)
        call = chat_format.parse_reply(o).tool_calls
        rows.append({"declined": think.endswith(": none"), "desc_right": q_desc == desc[target],
                     "desc_listed": q_desc in desc.values(), "think_name_right": t_name == target,
                     "think_name_listed": t_name in desc, "call_name_right": sc.get("name", False),
                     "call_eq_think": bool(call) and call[0][0] == t_name, "args_right": sc.get("args", False)})
    agg = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0]}
    agg["n"] = len(rows); agg["seconds"] = round(time.time() - t, 1)
    agg["examples"] = [(c.meta["name"], o[:160]) for c, o in list(zip(cases, outs))[:6]]
    res[label] = agg
    print(label, json.dumps(agg, indent=1), flush=True)
json.dump(res, open(f"tool_diag_{fmt}.json", "w"), indent=1)
