"""The HTTP server's own cost per streamed token, with an engine that costs (almost) nothing.

    python benchmarks/benchmark_serve_overhead.py --requests 64 --concurrency 16 --max-tokens 64 \
        [--step-ms 2 --busy-ms 0 --ops 0] [--endpoint completions|chat] [--logprobs K] [--profile F] [--out F]
        [--rows python,http,http_process]

The real AsyncEngine (rows python, http) or EngineProcess (rows python_process, http_process:
the stand-in built in the spawned child by make_instant_engine) drives InstantEngine, a
stand-in for LLMEngine whose step() lasts
`step-ms` and then hands every running request its next token, from a reply that was
tokenized and decoded once up front. The step first runs `ops` tiny torch ops (each releases
and retakes the GIL, as eager kernel launches do), then spins `busy-ms` in Python (holding the
GIL, as host work does), then sleeps the rest (the GPU). So what the server process spends
beyond that is the server's: the engine thread's dispatch, the event loop's delta / chunk /
SSE work, uvicorn; and how much longer the stand-in's steps get under load (engine_step_ms)
is what the server's Python costs the engine through the GIL.

`moet serve`'s app (build_app, no tool or reasoning parser, request logging off) runs in a
subprocess on a loopback port; this process streams the load with httpx (one untimed pass of
the same load first), checks every reply (text, usage, logprob count), and reads the server's
CPU time from /proc around the timed pass: the event-loop thread alone (the process's main
thread) and the whole process. Reports per streamed token: loop CPU us, process CPU us, and
SSE events per token (below 1 when the server coalesced several engine steps into one event).
A Python-API row (AsyncEngine in this process, same engine) gives the floor. With the engine in
a child process, engine_cpu_us_per_token is that child's CPU (process CPU stays the server's).

--profile F writes a cProfile of the server's event-loop thread (pstats format) to F.
Linux only (/proc); loopback only; bounded by --requests and --budget-s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

REPLY = ("def running_total(values):\n    total = 0\n    out = []\n    for v in values:\n"
         "        total += v\n        out.append(total)\n    return out\n\n"
         "The function walks the list once, keeping the sum so far — O(n) time, O(n) space. ")


class InstantEngine:
    """What AsyncEngine needs of LLMEngine, with a step that costs step_s (busy_s of it spent
    in Python) and outputs built like LLMEngine._output's: cumulative text, token ids and
    logprobs, fresh lists every step. ignore_eos semantics: each request runs to max_tokens."""

    def __init__(self, tokenizer, *, step_s: float = 0.002, busy_s: float = 0.0, ops: int = 0,
                 max_model_len: int = 4096):
        from moet.engine.stats import EngineStats

        self.tokenizer = tokenizer
        self.config = SimpleNamespace(model="moet-fake", served_model_name="moet-tiny")
        self.max_model_len = max_model_len
        self.eos_token_ids = {0}
        self.step_s, self.busy_s, self.ops = step_s, busy_s, ops
        if ops:
            import torch
            self._op_args = (torch.ones(8), torch.ones(8))
        self.step_wall_s = 0.0                 # time spent in step(), all steps
        self.requests: dict[str, dict] = {}
        self._ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self._texts: list[str] = [""]          # cumulative decoded text after k tokens
        self._lps: dict[int, list] = {}        # k -> per-position logprobs
        self._stats = EngineStats(num_kv_blocks=1024, block_size=16)
        self.num_steps = 0

    def _token(self, k: int) -> int:
        return self._ids[k % len(self._ids)]

    def _text(self, k: int) -> str:
        while len(self._texts) <= k:
            n = len(self._texts)
            self._texts.append(self.tokenizer.decode([self._token(j) for j in range(n)]))
        return self._texts[k]

    def _positions(self, k: int, n: int) -> list:
        from moet.outputs import Logprob

        lst = self._lps.setdefault(k, [])
        while len(lst) < n:
            j = len(lst)
            tid = self._token(j)
            pos = {tid: Logprob(-0.25, 1, self.tokenizer.decode([tid]))}
            for r in range(1, k):
                other = (tid + 17 * r) % len(self.tokenizer)
                pos.setdefault(other, Logprob(-1.0 - r, r + 1, self.tokenizer.decode([other])))
            lst.append(pos)
        return lst

    # -- LLMEngine's surface, as AsyncEngine uses it
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, (list, tuple)):
            return None, [int(t) for t in prompt]
        return prompt, list(self.tokenizer(prompt).input_ids)

    def add_request(self, request_id, prompt, params) -> None:
        from moet.errors import ConfigError

        ids = self.encode(prompt)[1]
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already running")
        max_new = params.max_tokens or 16
        self._text(max_new)
        if params.logprobs is not None:
            self._positions(params.logprobs, max_new)
        self.requests[request_id] = {"prompt": ids, "params": params, "max_new": max_new, "n": 0,
                                     "seqs": params.n}

    def abort_request(self, request_id) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        from moet.outputs import CompletionOutput, RequestOutput

        t0 = time.perf_counter()
        if self.ops:                # like eager kernel launches: each op lets go of the GIL and takes it back
            import torch
            a, b = self._op_args
            for _ in range(self.ops):
                torch.add(a, b)
        if self.busy_s:
            while time.perf_counter() - t0 < self.busy_s:
                pass
        rest = self.step_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        outs = []
        for rid, r in list(self.requests.items()):
            r["n"] += 1
            k = r["n"]
            done = k >= r["max_new"]
            ids = [self._token(j) for j in range(k)]
            lp = r["params"].logprobs
            lps = list(self._lps[lp][:k]) if lp is not None else None
            outs.append(RequestOutput(rid, None, r["prompt"], None, [
                CompletionOutput(i, self._texts[k], list(ids), -0.25 * k, list(lps) if lps is not None else None,
                                 "length" if done else None, None) for i in range(r["seqs"])], finished=done))
            if done:
                del self.requests[rid]
        self._stats.generation_tokens_total += len(outs)
        self._stats.num_steps += 1
        self.num_steps += 1
        self.step_wall_s += time.perf_counter() - t0
        self._stats.extra["fake_step_wall_s"] = self.step_wall_s
        self._stats.extra["fake_steps"] = float(self.num_steps)
        return outs

    def stats(self):
        from dataclasses import replace
        self._stats.num_running = len(self.requests)
        return replace(self._stats, extra=dict(self._stats.extra))

    def health(self) -> tuple[str, str]:
        return ("ok", "")

    def close(self) -> None:
        """Nothing to release: the stand-in holds no model, cache or device memory."""


def _tokenizer():
    from transformers import AutoTokenizer

    from moet.assets import default_model
    return AutoTokenizer.from_pretrained(default_model())


def make_instant_engine(step_s: float, busy_s: float, ops: int) -> InstantEngine:
    """EngineProcess's build for the stand-in (module level: the spawned child imports it by name)."""
    return InstantEngine(_tokenizer(), step_s=step_s, busy_s=busy_s, ops=ops)


def make_engine(step_s: float, busy_s: float, ops: int, process: bool):
    """The EngineClient over the stand-in: AsyncEngine (a thread) or EngineProcess (a child process)."""
    if process:
        from moet.engine.engine_process import EngineProcess
        return EngineProcess(make_instant_engine, (step_s, busy_s, ops), load_tokenizer=_tokenizer)
    from moet.engine.async_engine import AsyncEngine
    return AsyncEngine(make_instant_engine(step_s, busy_s, ops))


def _children_cpu_s(pid: int) -> float:
    """CPU seconds of pid's descendant processes (the engine process and its helpers), from /proc."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return 0.0
    for k in kids:
        try:
            total += _cpu_s(k) + _children_cpu_s(k)
        except OSError:
            pass
    return total


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or one of its threads) in seconds, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- the server side

def serve(port: int, step_s: float, busy_s: float, ops: int, profile: str | None, process: bool = False) -> None:
    import uvicorn

    from moet.serve.api_server import build_app
    from moet.serve.serve_config import ServeConfig

    engine = make_engine(step_s, busy_s, ops, process)
    app = build_app(engine, ServeConfig(port=port, log_requests=False, max_pending_requests=4096),
                    tool_parser=None, reasoning_parser=None)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        # SIGUSR1 starts the profile, SIGUSR2 stops it (the timed pass only)
        signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
        signal.signal(signal.SIGUSR2, lambda *_: prof.disable())
    print(f"ready pid={os.getpid()}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)


# ---------------------------------------------------------------------------- the client side

async def stream_load(url: str, requests: int, concurrency: int, max_tokens: int, endpoint: str = "completions",
                      logprobs: int | None = None, deadline: float = float("inf"), prefix: str = "") -> dict:
    """`requests` streamed requests, `concurrency` at a time; every reply is checked (usage says
    max_tokens, one logprob per token when asked) and its text returned for the caller to check."""
    import httpx

    from moet.bench.serve import sse_events

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    events = tokens = 0
    failures: list[str] = []
    texts: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(i: int) -> None:
            nonlocal events, tokens
            body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": f"{prefix}task {i}: write running_total"}]
                if logprobs is not None:
                    body.update(logprobs=True, top_logprobs=logprobs)
            else:
                body["prompt"] = f"{prefix}# task {i}\ndef running_total(values):\n"
                if logprobs is not None:
                    body["logprobs"] = logprobs
            text, n_lp, usage, n_ev = [], 0, None, 0
            async with client.stream("POST", f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                                     json=body) as resp:
                async for ev in sse_events(resp):
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for c in ev.get("choices", []):
                        if endpoint == "chat" and "role" in c["delta"]:
                            continue                  # the opening chunk: no token in it
                        n_ev += 1
                        if endpoint == "chat":
                            text.append(c["delta"].get("content") or "")
                            if c.get("logprobs"):
                                n_lp += len(c["logprobs"]["content"])
                        else:
                            text.append(c["text"])
                            if c.get("logprobs"):
                                n_lp += len(c["logprobs"]["tokens"])
            if usage is None or usage["completion_tokens"] != max_tokens:
                raise RuntimeError(f"usage {usage}, expected {max_tokens} completion tokens")
            if logprobs is not None and n_lp != max_tokens:
                raise RuntimeError(f"{n_lp} logprobs for {max_tokens} tokens")
            texts.append("".join(text))
            events += n_ev
            tokens += usage["completion_tokens"]

        counter = iter(range(requests))

        async def worker():
            for i in counter:
                if time.perf_counter() > deadline:
                    return
                try:
                    await one(i)
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests_done": len(texts), "failures": len(failures), "failure_examples": failures[:3],
            "tokens": tokens, "events": events, "wall_s": wall, "texts": texts}


def http_row(args, process: bool = False) -> dict:
    from moet.bench.serve import wait_until_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", str(port), "--step-ms", str(args.step_ms),
           "--busy-ms", str(args.busy_ms), "--ops", str(args.ops)] + (["--profile", args.profile] if args.profile else []) \
        + (["--engine-process"] if process else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until_healthy(url, proc, time.perf_counter() + 120, lambda: "".join(out), poll_s=0.2)
        deadline = time.perf_counter() + args.budget_s
        load = lambda prefix: asyncio.run(stream_load(url, args.requests, args.concurrency, args.max_tokens,
                                                      args.endpoint, args.logprobs, deadline, prefix))
        load("warm ")                                         # the same load, untimed
        if args.profile:
            os.kill(proc.pid, signal.SIGUSR1)
        steps0 = _fake_steps(url)
        cpu0, loop0, eng0 = _cpu_s(proc.pid), _cpu_s(proc.pid, proc.pid), _children_cpu_s(proc.pid)
        res = load("")
        cpu1, loop1, eng1 = _cpu_s(proc.pid), _cpu_s(proc.pid, proc.pid), _children_cpu_s(proc.pid)
        steps1 = _fake_steps(url)
        if args.profile:
            os.kill(proc.pid, signal.SIGUSR2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return _row(res, process_cpu=cpu1 - cpu0, loop_cpu=loop1 - loop0, args=args,
                steps=(steps1[0] - steps0[0], steps1[1] - steps0[1]), engine_cpu=eng1 - eng0 if process else None)


def _fake_steps(url: str) -> tuple[float, float]:
    """(steps, seconds in step()) of the server's InstantEngine, from /metrics."""
    import httpx

    vals = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for key in ("moet:fake_steps", "moet:fake_step_wall_s"):
            if line.startswith(key + "{"):
                vals[key] = float(line.rsplit(" ", 1)[1])
    return vals.get("moet:fake_steps", 0.0), vals.get("moet:fake_step_wall_s", 0.0)


def _row(res: dict, *, process_cpu: float, loop_cpu: float | None, args, steps: tuple[float, float],
         engine_cpu: float | None = None) -> dict:
    """The report row; a reply whose text is not the stand-in's counts as a failure."""
    tok = max(res["tokens"], 1)
    texts = res.pop("texts")
    want = InstantEngine(_tokenizer())._text(args.max_tokens)
    wrong = sum(t != want for t in texts)
    row = {k: v for k, v in res.items()}
    row["failures"] += wrong
    if wrong:
        row.setdefault("failure_examples", []).append(f"{wrong} replies differ from the engine's text")
    row.update(wall_s=round(res["wall_s"], 3), tok_per_s=round(res["tokens"] / res["wall_s"], 1),
               ideal_tok_per_s=round(args.concurrency / (args.step_ms / 1e3), 1) if args.step_ms else None,
               process_cpu_us_per_token=round(process_cpu / tok * 1e6, 1),
               loop_cpu_us_per_token=round(loop_cpu / tok * 1e6, 1) if loop_cpu is not None else None,
               engine_cpu_us_per_token=round(engine_cpu / tok * 1e6, 1) if engine_cpu is not None else None,
               events_per_token=round(res["events"] / tok, 3), distinct_texts=len(set(texts)),
               engine_steps=int(steps[0]), engine_step_ms=round(steps[1] / max(steps[0], 1) * 1e3, 3))
    return row


def python_row(args, process: bool = False) -> dict:
    from moet.sampling_params import SamplingParams

    engine = make_engine(args.step_ms / 1e3, args.busy_ms / 1e3, args.ops, process)

    def steps_now() -> tuple[float, float]:       # the stand-in's counters, as the last step left them
        extra = engine.stats().extra
        return extra.get("fake_steps", 0.0), extra.get("fake_step_wall_s", 0.0)

    async def run(prefix: str) -> tuple[dict, float]:
        tokens = events = 0
        texts = []
        counter = iter(range(args.requests))

        async def worker():
            nonlocal tokens, events
            for i in counter:
                sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=args.logprobs)
                last = None
                async for last in engine.generate(f"{prefix}{i}", f"# task {i}\n", sp):
                    events += 1
                tokens += len(last.outputs[0].token_ids)
                texts.append(last.outputs[0].text)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return {"requests_done": len(texts), "failures": 0, "tokens": tokens, "events": events,
                "wall_s": time.perf_counter() - t0, "texts": texts}

    async def main():
        await run("warm-")
        s0, w0 = steps_now()
        c0, l0, e0 = time.process_time(), time.thread_time(), _children_cpu_s(os.getpid())
        res = await run("load-")
        c1, l1, e1 = time.process_time(), time.thread_time(), _children_cpu_s(os.getpid())
        s1, w1 = steps_now()
        await engine.shutdown()
        return res, c1 - c0, l1 - l0, e1 - e0, (s1 - s0, w1 - w0)

    res, cpu, loop, eng, steps = asyncio.run(main())
    return _row(res, process_cpu=cpu, loop_cpu=loop, args=args, steps=steps, engine_cpu=eng if process else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's step time (ms)")
    p.add_argument("--busy-ms", type=float, default=0.0, help="of which spent in Python holding the GIL (ms)")
    p.add_argument("--ops", type=int, default=0,
                   help="tiny torch ops per step first (each releases and retakes the GIL, as eager launches do)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--logprobs", type=int, default=None, help="ask for logprobs (top K) on every token")
    p.add_argument("--rows", default="python,http", help="comma list of python, http, python_process, http_process "
                                                         "(_process: the engine in its own process)")
    p.add_argument("--profile", default=None, help="cProfile of the server's event loop during the timed pass")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", default=None)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)   # the server subprocess
    p.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)   # ... with EngineProcess
    args = p.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.step_ms / 1e3, args.busy_ms / 1e3, args.ops, args.profile, args.engine_process)
        return 0
    report = {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "step_ms", "busy_ms",
                                            "endpoint", "logprobs")}
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        fn = {"python": python_row, "http": http_row, "python_process": python_row, "http_process": http_row}[row]
        report[row] = fn(args, process=row.endswith("_process"))
        print(f"[{row}] {json.dumps(report[row])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(report.get(r, {}).get("failures") for r in ("python", "http", "python_process", "http_process")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
