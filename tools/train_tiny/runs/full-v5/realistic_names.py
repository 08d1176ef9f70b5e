"""Check after full-v5 (2026-12-01, not part of the recipe): what does the model emit with
realistic tool names (the failure that kept v4 from shipping: unrelated names / namespace loops)?
The same prompts through moet's LLM (FP4 experts, CPU, greedy), thinking on as `moet serve` renders
them; the reply is read by the probe's GLM-4.5 parser.

    PYTHONPATH=src:. python tools/train_tiny/runs/full-v5/realistic_names.py CKPT_DIR OUT.json
"""
import json
import sys
import time

import torch

from moet import LLM, SamplingParams
from moet.probe.chat_format import parse_reply


def fn(name, desc, **props):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
        "required": list(props)}}}


POPULATION = fn("population_lookup", "Get the population of a country.", country="Country name")
WEATHER = fn("get_weather", "Get the current weather for a city.", city="City name")
FLIGHTS = fn("search_flights", "Search for flights between two cities on a date.",
             origin="Departure city", destination="Arrival city", date="Travel date")
PROFILE = fn("get_user_profile", "Get a user's profile by user name.", username="The user's login name")
CAMEL = fn("getCurrentWeather", "Get the current weather for a city.", city="City name")
ORDER = fn("lookup_order_status", "Look up the delivery status of an order.", order_id="Order number")
STOCK = fn("get_stock_price", "Get the latest price of a stock.", symbol="Ticker symbol")


def user(text):
    return [{"role": "user", "content": text}]


CASES = [  # (label, messages, tools, expected function name, or None for "no call")
    ("population_lookup alone", user("What is the population of Costa Rica?"), [POPULATION], "population_lookup"),
    ("get_weather alone", user("What's the weather like in Paris right now?"), [WEATHER], "get_weather"),
    ("search_flights alone", user("Find me a flight from Boston to Denver on May 3."), [FLIGHTS], "search_flights"),
    ("get_stock_price alone", user("What is the current price of AAPL stock?"), [STOCK], "get_stock_price"),
    ("weather among 3", user("What's the weather like in Tokyo?"), [POPULATION, WEATHER, FLIGHTS], "get_weather"),
    ("population among 3", user("How many people live in Brazil?"), [WEATHER, FLIGHTS, POPULATION],
     "population_lookup"),
    ("flights among 3", user("Search flights from London to Rome on June 10."), [FLIGHTS, POPULATION, WEATHER],
     "search_flights"),
    ("no fitting tool (capital) with get_weather", user("What is the capital of Poland?"), [WEATHER], None),
    ("no fitting tool (capital) with 3 tools", user("What is the capital of Japan?"),
     [POPULATION, WEATHER, FLIGHTS], None),
    ("no tools: capital", user("What is the capital of Poland?"), None, None),
    ("no tools: arithmetic", user("831 + 42 = ?"), None, None),
    # names of no trained family (copy, not recall)
    ("get_user_profile (no family)", user("Show me the profile of the user jsmith."), [PROFILE], "get_user_profile"),
    ("lookup_order_status (no family)", user("Where is my order 48213?"), [ORDER, WEATHER], "lookup_order_status"),
    ("getCurrentWeather (camelCase)", user("What's the weather like in Oslo?"), [CAMEL], "getCurrentWeather"),
    # the serve test's second turn: answer from the tool result, no new call
    ("answer from population result", user("What is the population of Costa Rica?") + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "population_lookup", "arguments": {"country": "Costa Rica"}}}]},
        {"role": "tool", "content": json.dumps({"population": 5150000})}], [POPULATION], None),
]

EXPECT_TEXT = {"answer from population result": ("Costa Rica", "5150000")}  # the answer must quote the result


def is_ok(case: str, want, calls, content: str) -> bool:
    if want:
        return bool(calls) and calls[0][0] == want
    return not calls and all(t in content for t in EXPECT_TEXT.get(case, ()))


if __name__ == "__main__":
    if sys.argv[1] == "--rescore":   # re-grade saved outputs (after a change to is_ok)
        for path in sys.argv[2:]:
            d = json.load(open(path))
            for r in d["rows"]:
                r["ok"] = is_ok(r["case"], r["want"], r["calls"], r["content"])
            d["ok"] = sum(r["ok"] for r in d["rows"])
            json.dump(d, open(path, "w"), indent=1)
            print(path, f"{d['ok']}/{d['n']}")
        sys.exit()
    ckpt, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    llm = LLM(ckpt, expert_format="fp4", device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=96)
    rows = []
    for label, msgs, tools, want in CASES:
        t = time.time()
        text = llm.chat(msgs, sp, tools=tools, use_tqdm=False)[0].outputs[0].text
        r = parse_reply(text)
        calls = [(n, a) for n, a in r.tool_calls]
        ok = is_ok(label, want, calls, r.content)
        rows.append({"case": label, "want": want, "calls": calls, "ok": bool(ok), "valid": r.valid,
                     "reasoning": r.reasoning, "content": r.content, "raw": text, "s": round(time.time() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    json.dump({"ckpt": ckpt, "rows": rows, "ok": sum(r["ok"] for r in rows), "n": len(rows)},
              open(out, "w"), indent=1)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} as expected")
