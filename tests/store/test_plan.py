"""`moet plan` (store/plan.py, store/plan_cli.py): tiers add up to the expert rows, the fit check
names the flag that fixes it, the prediction falls as the GPU budget shrinks, sizes parse; the
engine's periodic residency log line (ExpertResidency.log_stats)."""
import json
import logging

import pytest

from moet.checkpoint.inspect_cli import Summary
from moet.cli import main as moet_main
from moet.errors import ConfigError
from moet.store import plan as P
from moet.store.plan_cli import parse_size

GiB = 2**30


def _summary(name, moe_layers, experts, top_k, hidden, inter, active_params, vocab):
    per = 3 * hidden * inter
    exp = moe_layers * experts * per
    dense = active_params - moe_layers * top_k * per
    return Summary(path=name, architecture="by hand", family=name, weight_format="float", dtype="bfloat16",
                   layers=moe_layers + 1, dense_layers=1, moe_layers=moe_layers, mtp_layers=0, experts=experts,
                   top_k=top_k, dense_params=dense, expert_params=exp, mtp_params=0, active_params=active_params,
                   native_dense_bytes=2 * dense, native_expert_bytes=2 * exp, native_mtp_bytes=0,
                   dense_loaded_bytes=2 * dense, w2_expert_bytes=exp * 9 // 32, fp4_expert_bytes=exp * 9 // 16)


@pytest.fixture(scope="module")
def glm_air():
    """GLM-4.5-Air's published shape: 45 MoE layers x 128 experts (4096 x 1408), top-8, ~12B active;
    GQA 8 KV heads x 128 over 46 layers."""
    s = _summary("glm4_moe", 45, 128, 8, 4096, 1408, 12_000_000_000, 151552)
    return P.facts_from_summary(s, kv_bytes_per_token=46 * 8 * 256 * 2, embedding_bytes=151552 * 4096 * 2)


@pytest.fixture(scope="module")
def deepseek_v3():
    """DeepSeek-V3: 58 MoE layers x 256 experts (7168 x 2048), top-8, ~37B active; MLA 576 x 61 layers."""
    s = _summary("deepseek_v3", 58, 256, 8, 7168, 2048, 37_000_000_000, 129280)
    return P.facts_from_summary(s, kv_bytes_per_token=61 * 576 * 2, embedding_bytes=129280 * 7168 * 2)


def _plan(facts, gpu_gib, host_gib=64, **kw):
    return P.make_plan(facts, gpu_memory_bytes=int(gpu_gib * GiB), host_memory_bytes=int(host_gib * GiB), **kw)


@pytest.mark.parametrize("text,want", [("32GiB", 32 * GiB), ("96GB", 96 * 10**9), ("24g", 24 * GiB),
                                       ("24G", 24 * GiB), ("512MiB", 512 * 2**20), ("1.5TiB", int(1.5 * 2**40)),
                                       ("2", 2 * GiB), (" 8 gib ", 8 * GiB), ("100mb", 10**8)])
def test_sizes_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "32 GiBs", "-4GiB", "1e3GB", "lots"])
def test_bad_sizes_refused(text):
    with pytest.raises(ConfigError, match="is not a size"):
        parse_size(text, "--gpu-memory")


@pytest.mark.parametrize("gpu_gib,host_gib", [(16, 8), (24, 64), (32, 8), (40, 16), (96, 64), (200, 0)])
def test_tiers_add_up_to_the_expert_rows(glm_air, gpu_gib, host_gib):
    f = glm_air
    pl = _plan(f, gpu_gib, host_gib)
    rows = {t.name: t.rows for t in pl.tiers}
    assert sum(rows.values()) == f.rows == 45 * 128
    assert sum(r * f.row_bytes for r in rows.values()) == f.expert_bytes
    assert pl.tier("gpu").bytes == rows["gpu"] * f.row_bytes <= max(pl.gpu.expert_room_bytes, 0)
    assert pl.tier("host_arena").bytes <= pl.host_arena_bytes == host_gib * GiB // 2
    if rows["disk"]:
        assert rows["host_arena"] == pl.host_arena_bytes // f.stride       # the arena is full before disk
    assert f.stride % 4096 == 0 and f.stride >= f.row_bytes


def test_prediction_falls_as_the_gpu_budget_shrinks(glm_air):
    preds = [_plan(glm_air, g, max_num_seqs=1).prediction for g in (96, 48, 40, 32, 28, 24, 20)]
    tok_s = [p.tok_s for p in preds]
    assert all(a >= b for a, b in zip(tok_s, tok_s[1:])), tok_s
    assert tok_s[0] > 5 * tok_s[-1]
    assert preds[0].hit_rate == 1.0 and preds[0].passes_per_step == 1.0 and preds[0].pcie_bound_tok_s is None
    p = preds[3]                                                              # 32 GiB: over half resident
    assert 0.4 < p.hit_rate < 0.8 and p.passes_per_step > 1.9                 # 360 pairs: some always miss
    assert p.tok_s < p.resident_tok_s and p.tok_s < p.pcie_bound_tok_s
    # a step with every expert on the GPU reads dense - embedding + 360 rows + KV at HBM bandwidth
    want = (glm_air.dense_bytes - glm_air.embedding_bytes + 360 * glm_air.row_bytes + 4096 * glm_air.kv_bytes_per_token)
    assert preds[0].hbm_bytes_per_step == want
    assert preds[0].tok_s == pytest.approx(3670e9 / want)


def test_prefill_chunk_fetch_floor(glm_air):
    """A long prompt's chunk routes to every expert: with demand fetch it copies every row the GPU
    does not hold once (the arena's from host memory, the rest from disk too); none when all fit."""
    full = _plan(glm_air, 96, max_num_seqs=1).prediction
    assert full.prefill_chunk_fetch_bytes == 0 and full.prefill_chunk_fetch_s == 0
    plan = _plan(glm_air, 32, host_gib=16, max_num_seqs=1)
    p, f = plan.prediction, glm_air
    gpu, host = plan.tier("gpu").rows, plan.tier("host_arena").rows
    assert p.prefill_chunk_fetch_bytes == (f.rows - gpu) * f.row_bytes > 0
    assert p.prefill_chunk_disk_bytes == max(0, f.rows - gpu - host) * f.stride > 0      # 8 GiB arena < the rest
    bw = plan.bandwidths
    assert p.prefill_chunk_fetch_s == pytest.approx(p.prefill_chunk_fetch_bytes / (bw.h2d_gbps * 1e9)
                                                    + p.prefill_chunk_disk_bytes / (bw.disk_gbps * 1e9))


def test_kernel_calibration_scales_the_hbm_time(glm_air):
    """kernel_efficiency divides the bandwidth and pass_overhead_ms adds to every pass."""
    roof = _plan(glm_air, 96, max_num_seqs=1).prediction
    cal = P.make_plan(glm_air, gpu_memory_bytes=96 * P.GiB, host_memory_bytes=64 * P.GiB, max_num_seqs=1,
                      bandwidths=P.Bandwidths(kernel_efficiency=0.4, pass_overhead_ms=2.5)).prediction
    assert cal.hbm_s == pytest.approx(roof.hbm_s / 0.4 + 2.5e-3)
    assert cal.tok_s == pytest.approx(1 / (roof.hbm_s / 0.4 + 2.5e-3))
    with pytest.raises(ValueError, match="efficiency"):
        P.make_plan(glm_air, gpu_memory_bytes=96 * P.GiB, host_memory_bytes=64 * P.GiB, max_num_seqs=1,
                    bandwidths=P.Bandwidths(kernel_efficiency=1.5))


def test_hit_models_and_tolerance(glm_air):
    uniform = _plan(glm_air, 32).prediction
    skewed = _plan(glm_air, 32, zipf=1.0).prediction
    assert skewed.hit_rate > uniform.hit_rate and skewed.tok_s > uniform.tok_s
    given = _plan(glm_air, 32, hit_rate=0.99).prediction
    assert given.hit_rate == 0.99 and given.misses_per_step == pytest.approx(360 * 0.01)
    strict = _plan(glm_air, 32, hit_rate=0.99).prediction.passes_per_step
    tolerant = _plan(glm_air, 32, hit_rate=0.99, miss_tolerance=8).prediction.passes_per_step
    assert strict > 1.9 and 1.0 < tolerant < 1.02           # P(more than 8 of 360 miss at 1%) ~ 1%
    small_arena = _plan(glm_air, 32, host_arena_bytes=GiB).prediction
    assert small_arena.disk_share > 0 and small_arena.tok_s < uniform.tok_s     # disk misses cost more
    pageable = _plan(glm_air, 32, bandwidths=P.Bandwidths(pinned=False)).prediction
    assert pageable.tok_s < uniform.tok_s


def test_fit_failures_name_the_flag(glm_air, deepseek_v3):
    small = _plan(glm_air, 16)           # dense 10.7 GiB + reserves leave fewer than 45 x 8 x 4 slots
    assert not small.fit.ok and small.prediction is None
    assert "--gpu-memory" in small.fit.message and "--max-num-seqs" in small.fit.message
    assert "1440 slots" in small.fit.message
    assert _plan(glm_air, 16, max_num_seqs=1).fit.ok                          # 360 slots fit
    dense = _plan(deepseek_v3, 24)       # ~16.6B dense params in bf16 do not fit a 24 GiB card
    assert not dense.fit.ok and "dense stack" in dense.fit.message and "--gpu-memory" in dense.fit.message
    ok = _plan(deepseek_v3, 80, 512)
    assert ok.fit.ok and not ok.fit.all_resident and ok.tier("disk").rows == 0


def test_compare_reports_the_ratio(glm_air):
    pl = _plan(glm_air, 32)
    c = P.compare(pl, pl.prediction.tok_s / 2, measured_hit_rate=0.9)
    assert c["measured_over_predicted"] == pytest.approx(0.5)
    assert c["predicted_tok_s_at_measured_hit_rate"] > c["predicted_tok_s"]
    rows = P.plan_for_rows(glm_air, pl.tier("gpu").rows, pl.host_arena_bytes)
    assert rows.prediction.hit_rate == pytest.approx(pl.prediction.hit_rate)
    assert P.compare(_plan(glm_air, 8), 10.0)["measured_over_predicted"] is None      # no fit: no prediction


def test_cli_on_the_shipped_moet_tiny(capsys):
    from moet.checkpoint.inspect_cli import summarize
    from moet.assets import default_model

    assert moet_main(["plan", "--gpu-memory", "1GiB", "--host-memory", "8g"]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v3" in out and "all resident" in out and "predicted" in out and "3670 GB/s" in out
    assert moet_main(["plan", "--gpu-memory", "40MiB", "--host-memory", "1GiB", "--json"]) == 1   # too small
    d = json.loads(capsys.readouterr().out)
    s = summarize(default_model())
    f = d["plan"]["facts"]
    assert f["rows"] == s.moe_layers * s.experts and f["row_bytes"] * f["rows"] == s.w2_expert_bytes
    assert sum(t["rows"] for t in d["plan"]["tiers"]) == f["rows"]
    assert not d["plan"]["fit"]["ok"] and "--gpu-memory" in d["plan"]["fit"]["message"]
    assert d["plan"]["bandwidths"]["sources"]["disk_gbps"]


def test_cli_kv_cache_dtype_sizes_the_reserve(capsys):
    """--kv-cache-dtype counts the KV reserve in that layout (kernels/kv_cache.py's bytes per
    token): moet-tiny's 6 MLA layers at R 128, P 16 are 288 B a layer in bf16, 88 in nvfp4
    (64 code bytes, 8 e4m3 scales, 16 e4m3 rope); an explicit reserve says how many tokens fit."""
    per = {}
    for dtype in ("bf16", "fp8", "nvfp4"):
        assert moet_main(["plan", "--gpu-memory", "1GiB", "--host-memory", "8g", "--kv-cache-dtype", dtype,
                          "--json"]) == 0
        per[dtype] = json.loads(capsys.readouterr().out)["plan"]["facts"]["kv_bytes_per_token"]
    assert per == {"bf16": 6 * 288, "fp8": 6 * (128 + 4 + 32), "nvfp4": 6 * 88}
    assert moet_main(["plan", "--gpu-memory", "1GiB", "--host-memory", "8g", "--kv-cache-dtype", "nvfp4",
                      "--kv-reserve", "66MiB"]) == 0
    assert f"{66 * 2**20 // (6 * 88):,} tokens of nvfp4 KV" in capsys.readouterr().out


def test_cli_errors(capsys, tmp_path):
    assert moet_main(["plan", str(tmp_path / "nope")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    assert moet_main(["plan", str(tmp_path)]) == 2
    assert "moet: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        moet_main(["plan", "--gpu-memory", "lots"])
    assert "is not a size" in capsys.readouterr().err


def test_engine_logs_residency_stats(caplog, tmp_path):
    from moet.llm import LLM
    from moet.sampling_params import SamplingParams
    from moet.testing.tiny_checkpoint import cached_checkpoint

    path = cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=40)
    kw = dict(expert_format="w2", dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=2,
              num_kv_blocks=64, block_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="moet.engine"):
        with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=8, expert_stats_interval_s=1e-6, **kw) as llm:
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], sp, use_tqdm=False)
            st = llm.engine.stats().extra
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("expert store, last")]
    assert lines, [r.getMessage() for r in caplog.records]
    assert all(k in lines[-1] for k in ("hit rate GPU cache", "host arena", "MiB/token", "passes/step", "fetch",
                                        "prefetch precision"))
    assert st["expert_step_fetches_total"] >= 1 and st["expert_step_fetch_latency_ms"] > 0
    assert "pack_bytes_read_per_token" in st
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moet.engine"):
        with LLM(path, pack_dir=str(tmp_path), expert_cache_slots=8, expert_stats_interval_s=0, **kw) as llm:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    assert not [r for r in caplog.records if r.getMessage().startswith("expert store, last")]


def test_fp4_repair_tier_in_the_plan(glm_air, capsys):
    """The FP4 tier fits beside all-resident W2 experts on a 141 GiB card, not on 80 GiB; a repair
    pass reads more than the dense stack and less than every FP4 row; tok/s falls as the gate fires
    more; `moet plan` prints it."""
    big, small = _plan(glm_air, 141), _plan(glm_air, 80)
    rt, rs = P.repair_tier_plan(big), P.repair_tier_plan(small)
    assert rt.fits and not rs.fits and big.fit.all_resident
    assert rt.slots == glm_air.experts and not rt.from_pack
    # on 80 GiB: a partial pool of what the W2 experts leave, or with the store a share of the room
    assert (rs.slots < glm_air.experts) and rs.from_pack == (not small.fit.all_resident)
    tiny = _plan(glm_air, 32)                 # 32 GiB: the expert store, FP4 rows from their pack
    rp = P.repair_tier_plan(tiny)
    assert not tiny.fit.all_resident and rp.from_pack and not rp.fits
    assert rp.slots == (0 if rp.room_bytes // (glm_air.moe_layers * glm_air.fp4_row_bytes) < glm_air.top_k else
                        min(glm_air.experts, rp.room_bytes // (glm_air.moe_layers * glm_air.fp4_row_bytes)))
    assert rt.fp4_bytes == glm_air.rows * glm_air.fp4_row_bytes and glm_air.fp4_row_bytes == 2 * glm_air.row_bytes
    dense = glm_air.dense_bytes - glm_air.embedding_bytes
    assert dense < rt.repair_bytes < dense + rt.fp4_bytes + 4096 * glm_air.kv_bytes_per_token
    tok = rt.tok_s_at_fire
    assert tok[0.0] == pytest.approx(big.prediction.tok_s) and tok[0.0] > tok[0.1] > tok[0.3]
    # a repair recomputes ~1 / fire rate positions, not the full reach each time: cheaper than that
    step = big.prediction.step_s
    assert tok[0.3] > 1 / (step + 0.3 * rt.repair_s)
    # reach 0 reads the top-k rows of one token: cheaper than reach 32
    assert P.repair_tier_plan(big, reach=0).repair_bytes < rt.repair_bytes
    assert moet_main(["plan"]) == 0
    assert "FP4 tier" in capsys.readouterr().out
