"""Load test of the HTTP server against the Python API, same engine config, same run.

    python -m moet.bench.serve_bench [MODEL] --requests 64 --concurrency 16 --max-tokens 128 \
        --out serve_bench.json [--budget-s 500] [--phases python,http,python] [--warmup full] \
        [engine flags: --device, --expert-format, ...]

Phase "python" (Python API): AsyncEngine in this process; `concurrency` clients each send
requests back to back until `requests` are done (ignore_eos, fixed max_tokens, distinct prompts).
Phase "http": `moet serve` with the same engine flags in a subprocess on a free loopback port;
the same load through /v1/completions (streamed, so time to first token is seen). Phase
"http_process": the same with `--engine-process true` (the engine in its own process).
Phases run in the order given, each on a fresh engine; a phase named again gets its own key
(python, http, python_2, ...), so "python,http,python" shows what running first costs.

Warm-up (--warmup): before its timed pass every phase runs, untimed, one full pass of the same
load (`full`, the default: the same number of requests, concurrency and max_tokens, prompts of
the same token lengths but different text so the prefix cache cannot serve the timed pass).
That exercises every batch size and prompt shape the timed pass will: Triton JIT compiles
and whatever else the first steps of a shape pay land in it, not in the number. `round` is the
old warm-up (one request per client), `none` none. The warm-up pass is reported too (its
tok/s next to the timed one is the cold-start cost, visible per phase).
Before timing, a greedy chat answer through each path must agree (correctness first).
Reports per phase: requests, failures, aggregate decode tokens/s, request latency p50 / p99,
TTFT p50 (HTTP), and the warm-up pass; http_over_python_decode compares the first http and
python phases, ratios every http phase with every python phase. Loopback only, bounded by
--requests and --budget-s. Prints as it goes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of Poland?"}]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _check_ids(cfg) -> list[int]:
    """The chat prompt both paths answer greedily before timing (raw token ids: no template or
    parser can make the paths differ)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    text = tok.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _prompt(i: int, tag: str = "task") -> str:
    """Request i's prompt; the warm-up's tag ("warm") tokenizes to as many tokens as "task"."""
    return f"# {tag} {i}\ndef solve_{i}(values):\n    \"\"\"Return the running total of values.\"\"\"\n"


WARMUPS = ("full", "round", "none")
PHASES = ("python", "http", "http_process")


async def _warm_then_time(one, requests: int, concurrency: int, deadline: float, warmup: str) -> dict:
    """The warm-up pass (see the module doc), then the timed one; one(i, tag) runs request i."""
    warm = None
    if warmup != "none":
        n = requests if warmup == "full" else min(concurrency, requests)
        warm = await _drive(lambda i: one(i, "warm"), n, concurrency, deadline)
    res = await _drive(lambda i: one(i, "task"), requests, concurrency, deadline)
    if warm is not None:
        res["warmup"] = {"pass": warmup, **{k: warm[k] for k in ("requests_done", "failures", "wall_s",
                                                                "decode_tok_per_s", "latency_p50_s")}}
    return res


async def _drive(one, requests: int, concurrency: int, deadline: float) -> dict:
    """`concurrency` workers pull request numbers until `requests` are taken or time is up."""
    lat, ttft, tokens, failures = [], [], 0, []
    counter = iter(range(requests))

    async def worker():
        nonlocal tokens
        for i in counter:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            try:
                n, first = await one(i)
            except Exception as exc:  # counted, reported, never hidden
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            lat.append(time.perf_counter() - t0)
            if first is not None:
                ttft.append(first - t0)
            tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests_done": len(lat), "complete": len(lat) == requests, "failures": len(failures),
            "failure_examples": failures[:3],
            "wall_s": round(wall, 3), "generated_tokens": tokens, "decode_tok_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(lat) / wall, 3), "latency_p50_s": round(_pct(lat, 0.5), 3),
            "latency_p99_s": round(_pct(lat, 0.99), 3),
            "ttft_p50_s": round(_pct(ttft, 0.5), 3) if ttft else None}


def python_api_phase(cfg, args, deadline: float) -> tuple[dict, str]:
    from moet.engine.async_engine import AsyncEngine
    from moet.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = AsyncEngine.from_config(cfg)
    print(f"[python] engine up in {time.perf_counter() - t0:.1f}s", flush=True)

    async def run():
        check = None
        async for out in engine.generate("check", _check_ids(cfg), SamplingParams(temperature=0, max_tokens=16)):
            check = out.outputs[0].text

        async def one(i, tag):
            n = 0
            async for out in engine.generate(f"{tag}-{i}", _prompt(i, tag),
                                             SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)):
                n = len(out.outputs[0].token_ids)
            if n != args.max_tokens:
                raise RuntimeError(f"got {n} tokens, expected {args.max_tokens}")
            return n, None

        res = await _warm_then_time(one, args.requests, args.concurrency, deadline, args.warmup)
        await engine.shutdown()
        return res, check

    res, check = asyncio.run(run())
    del engine
    import torch
    if torch.cuda.is_available():          # the HTTP phase's server process needs the memory back
        torch.cuda.empty_cache()
    return res, check


def _engine_flags(cfg) -> list[str]:
    from dataclasses import fields

    from moet.config import EngineConfig
    out = []
    for f in fields(EngineConfig):
        v = getattr(cfg, f.name)
        if f.name == "model" or v is None or v == f.default:
            continue
        out += ["--" + f.name.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v)]
    return out


async def http_load(url: str, requests: int, concurrency: int, max_tokens: int, deadline: float,
                    check_ids: list[int] | None = None, warmup: str = "full") -> tuple[dict, str | None]:
    """The load through a running server: streamed /v1/completions, ignore_eos, `max_tokens` each;
    a request fails unless it streams exactly max_tokens tokens with status 200. The warm-up
    pass (`warmup`, see the module doc) runs first, untimed."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        check = None
        if check_ids is not None:
            r = await client.post("/v1/completions", json={"prompt": check_ids, "max_tokens": 16, "temperature": 0})
            r.raise_for_status()
            check = r.json()["choices"][0]["text"]

        async def one(i, tag):
            first, n = None, 0
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": _prompt(i, tag), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}) as resp:
                async for ev in sse_events(resp):
                    if first is None and ev["choices"] and ev["choices"][0]["text"]:
                        first = time.perf_counter()
                    if ev.get("usage"):
                        n = ev["usage"]["completion_tokens"]
            if n != max_tokens:
                raise RuntimeError(f"got {n} tokens, expected {max_tokens}")
            return n, first

        return await _warm_then_time(one, requests, concurrency, deadline, warmup), check


async def sse_events(resp):
    """The JSON events of a streamed OpenAI response (httpx), `data: [DONE]` excluded; a non-200
    status or an in-band error event raises RuntimeError."""
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(ev["error"]["message"])
        yield ev


def wait_until_healthy(url: str, proc: subprocess.Popen, deadline: float, log_tail, poll_s: float = 0.5) -> None:
    """Poll url/health until it answers 200; raise with the server's last output (log_tail())
    if the process exits or the deadline (perf_counter) passes first."""
    import httpx

    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.perf_counter() > deadline:
            raise RuntimeError(f"moet serve did not come up: {log_tail()[-2000:]}")
        time.sleep(poll_s)


def http_phase(cfg, args, deadline: float, engine_process: bool = False) -> tuple[dict, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moet.cli", "serve", cfg.model, "--port", str(port), "--log-requests", "false",
           "--max-pending-requests", str(max(256, args.concurrency * 2))] + _engine_flags(cfg) \
        + (["--engine-process", "true"] if engine_process else [])
    print("[http] " + " ".join(cmd), flush=True)
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: an unread pipe would block the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_until_healthy(url, proc, deadline, lambda: (log.seek(0), log.read())[1])
        print(f"[http] server up in {time.perf_counter() - t0:.1f}s", flush=True)

        return asyncio.run(http_load(url, args.requests, args.concurrency, args.max_tokens, deadline,
                                     check_ids=_check_ids(cfg), warmup=args.warmup))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def phase_keys(names: list[str]) -> list[tuple[str, str]]:
    """(report key, phase) per phase in order: the first of a kind is its name, repeats get _2, _3."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        if name not in PHASES:
            raise SystemExit(f"serve_bench: unknown phase {name!r} ({', '.join(PHASES)})")
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}_{seen[name]}", name))
    return out


def compare(report: dict, keys: list[str]) -> dict:
    """http_over_python_decode (the first http over the first python phase, as before) and
    every http phase over every python phase."""
    tps = {k: report[k]["decode_tok_per_s"] for k in keys}
    pys = [k for k in keys if k.startswith("python")]
    https = [k for k in keys if k.startswith("http")]
    out: dict = {}
    if pys and https:
        out["http_over_python_decode"] = round(tps[https[0]] / max(tps[pys[0]], 1e-9), 3)
        out["ratios"] = {f"{h}/{p}": round(tps[h] / max(tps[p], 1e-9), 3) for h in https for p in pys}
    return out


def main(argv: list[str] | None = None) -> int:
    from moet.config import add_cli_arguments, from_cli_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_arguments(p)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--phases", default="python,http",
                   help="comma list of python, http, http_process, run in this order; repeats allowed "
                        "(python,http,python)")
    p.add_argument("--warmup", choices=WARMUPS, default="full",
                   help="untimed pass before each timed one: full (the same load), round (one request per "
                        "client, the old warm-up), none")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting requests after this many seconds")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    cfg = from_cli_args(args)
    deadline = time.perf_counter() + args.budget_s
    report = {"model": cfg.model, "device": cfg.device, "expert_format": cfg.expert_format,
              "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    import torch

    from moet.bench.timing import device_info
    report["env"] = device_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    checks = {}
    phases = phase_keys([x.strip() for x in args.phases.split(",") if x.strip()])
    report["warmup"] = args.warmup
    report["order"] = [key for key, _ in phases]
    for key, phase in phases:
        if phase == "python":
            res, checks[key] = python_api_phase(cfg, args, deadline)
        else:
            res, checks[key] = http_phase(cfg, args, deadline, engine_process=phase == "http_process")
        report[key] = res
        print(f"[{key}] {json.dumps(res)}", flush=True)
    if len(set(checks.values())) > 1:
        report["correctness"] = f"MISMATCH: greedy answers differ between paths: {checks}"
    else:
        report["correctness"] = f"ok: greedy answer identical on every path ({next(iter(checks.values()), None)!r})"
    report.update(compare(report, [key for key, _ in phases]))
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    failed = any(report[key].get("failures") or not report[key].get("complete") for key, _ in phases) or report["correctness"].startswith("MISMATCH")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
