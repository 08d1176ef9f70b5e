"""`moet bench serve`'s fairness plumbing (no engine): every timed pass follows a warm-up of the
same load, the comparisons name what they compare, several client processes merge into one wall.
(The HTTP load itself runs against the server's test double in tests/serve/test_api_server.py.)"""
from __future__ import annotations

import asyncio
import time

import pytest

from moet.bench.serve import Tally, _prompt, _shares, _warm_then_time, compare


def test_compare_every_http_phase_with_every_python_phase():
    report = {"python": {"decode_tok_per_s": 1000.0}, "http": {"decode_tok_per_s": 500.0},
              "python_2": {"decode_tok_per_s": 2000.0}}
    assert compare(report, ["python", "http", "python_2"]) == {"http/python": 0.5, "http/python_2": 0.25}
    assert compare({"python": {"decode_tok_per_s": 1.0}}, ["python"]) == {}


@pytest.mark.parametrize("warmup,warm_calls", [("full", 10), ("round", 4), ("none", 0)])
def test_the_timed_pass_follows_a_warm_up_of_the_same_load(warmup, warm_calls):
    calls = []
    running, peak = [0], {"warm": 0, "task": 0}

    async def one(i, tag):
        calls.append((tag, i))
        running[0] += 1
        peak[tag] = max(peak[tag], running[0])
        await asyncio.sleep(0.001)
        running[0] -= 1
        return 8, None

    res = asyncio.run(_warm_then_time(one, requests=10, concurrency=4, deadline=time.perf_counter() + 60,
                                      warmup=warmup))
    warm = [c for c in calls if c[0] == "warm"]
    timed = [c for c in calls if c[0] == "task"]
    assert len(warm) == warm_calls and sorted(i for _, i in timed) == list(range(10))
    assert calls[:len(warm)] == warm                     # every warm-up request before any timed one
    assert res["requests_done"] == 10 and res["complete"] and res["generated_tokens"] == 80
    if warmup == "full":                                 # the same concurrency as the timed pass
        assert peak["warm"] == peak["task"] == 4 and res["warmup"]["requests_done"] == 10
    assert ("warmup" in res) == (warmup != "none")


def test_warm_up_prompts_differ_in_text_not_in_length():
    """Same token counts (the same prefill shapes as the timed pass), different first block (the
    prefix cache cannot serve the timed pass from the warm-up)."""
    from tests.serve.fake_engine import _tokenizer

    tok = _tokenizer()
    for i in range(0, 200, 7):
        warm, task = tok(_prompt(i, "warm")).input_ids, tok(_prompt(i)).input_ids
        assert len(warm) == len(task) and warm[:4] != task[:4]


def test_tallies_of_several_clients_merge_into_one_wall_time():
    a = Tally(3, lat=[0.1, 0.2, 0.3], ttft=[0.01], tokens=30, t0=10.0, t1=11.0, cpu_s=0.5)
    b = Tally(2, lat=[0.4], tokens=10, failures=["RuntimeError: x"], t0=10.5, t1=12.0, cpu_s=0.25)
    m = Tally.merge([a, b])
    s = m.summary()
    assert (m.requests, m.tokens, m.clients, m.t0, m.t1) == (5, 40, 2, 10.0, 12.0)
    assert s["wall_s"] == 2.0 and s["decode_tok_per_s"] == 20.0 and s["requests_done"] == 4
    assert not s["complete"] and s["failures"] == 1 and s["latency_p99_s"] == 0.4
    assert s["client_cpu_per_wall"] == round(0.75 / 2.0 / 2, 3)
    assert _shares(10, 3) == [4, 3, 3] and _shares(16, 4) == [4, 4, 4, 4] and sum(_shares(7, 5)) == 7


def test_stalls_while_serving_reads_the_watches_warnings():
    from moet.bench.serve import stalls_while_serving
    log = "\n".join([
        "2026-12-01 13:57:15,610 INFO moet.serve: engine up",
        "2026-12-01 13:57:16,000 WARNING moet.jit: Triton JIT while serving: 1.52 s for _moe_gemm_kernel[num_warps=4](P: i32)"
        " (a kernel variant the start-up warm-up did not reach; the step waited)",
        "2026-12-01 13:57:17,000 WARNING moet.jit: Triton JIT while serving: 0.03 s for _rmsnorm_kernel[num_warps=1]()",
        "2026-12-01 13:57:18,000 WARNING moet.gc[engine]: GC pause while serving: 0.210 s (generation 2, 5 objects collected)",
    ])
    got = stalls_while_serving(log)
    assert got["jit"]["count"] == 2 and got["jit"]["seconds"] == 1.55
    assert got["jit"]["slowest"][0][0] == 1.52 and got["jit"]["slowest"][0][1].startswith("_moe_gemm_kernel")
    assert got["gc"] == {"count": 1, "seconds": 0.21, "slowest": [(0.21, "(generation 2, 5 objects collected)")]}
    empty = {"count": 0, "seconds": 0.0, "slowest": []}
    assert stalls_while_serving("nothing here") == {"jit": empty, "gc": empty}


def test_the_http_phase_passes_the_same_engine_settings_to_moet_serve():
    """The server subprocess gets the engine keyword arguments the Python API phase ran with, as
    `moet serve` flags: parsed by serve's own parser they give the same EngineConfig."""
    from moet.bench.serve import _engine_flags
    from moet.cli import _build
    from moet.config import EngineConfig, from_cli_args

    kw = {"model": "ckpt", "max_num_seqs": 4, "max_model_len": 320, "enforce_eager": True,
          "enable_prefix_caching": False, "kv_cache_memory_gb": None, "expert_format": "fp4", "device": "cpu",
          "compile_warmup": True}
    flags = _engine_flags(kw)
    assert "ckpt" not in flags and "--enforce-eager" in flags and "--no-enable-prefix-caching" in flags
    _, serve = _build("serve")
    args = serve.parse_args(["ckpt", *flags])
    assert from_cli_args(args) == EngineConfig(**{k: v for k, v in kw.items() if v is not None})
