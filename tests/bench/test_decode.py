"""`moet bench decode / prefill` end to end on CPU, on the micro shape (random weights): the
correctness stage passes before anything is timed, every batch gets a row with positive tok/s,
GB/s and % of roofline in bench.json and in bench.md's table, the plots are PNGs, and with
--peer transformers each moet row carries moet tok/s / the peer's at the same batch."""
from __future__ import annotations

import json

import pytest

from moet.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
HEADER = "| device | date | commit | shape | config | tok/s | GB/s | % of roofline | peer ratio | notes |"


def bench(tmp_path, *args, shape="micro", prompt_len=16) -> dict:
    assert main(["bench", *args, "--shape", shape, "--device", "cpu", "--prompt-len", str(prompt_len),
                 "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_decode_with_the_transformers_peer(tmp_path):
    pytest.importorskip("matplotlib")
    res = bench(tmp_path, "decode", "--batch", "1,2", "--decode-tokens", "6", "--peer", "transformers")
    c = res["sections"]["decode"]["correctness"]
    assert c["ok"] and c["six_runs_bit_identical"] and c["reference_agreement_within_noise"]
    assert c["first_token_top20_min_overlap"] >= 15 and c["first_token_max_abs_dlogprob_on_overlap"] < 0.1
    assert res["roofline"]["GBps"] > 0 and "copy" in res["roofline"]["what"]
    moet = {r["batch"]: r for r in res["rows"] if r["system"] == "moet"}
    peer = {r["batch"]: r for r in res["rows"] if r["system"] == "transformers"}
    assert set(moet) == set(peer) == {1, 2}
    for b, r in moet.items():
        assert r["scenario"] == "decode" and r["shape"] == "micro (tests)"
        assert r["tok_s"] > 0 and r["gb_s"] > 0 and 0 < r["pct_roofline"]
        assert r["details"]["generated"] == 6 * b and r["details"]["bytes_per_step"] > 0
        assert peer[b]["tok_s"] > 0 and r["peer_ratio"] == pytest.approx(r["tok_s"] / peer[b]["tok_s"])
    # two sequences read more bytes per step than one (more experts, two KV caches)
    assert moet[2]["details"]["bytes_per_step"] > moet[1]["details"]["bytes_per_step"]
    md = (tmp_path / "bench.md").read_text()
    assert "## decode" in md and HEADER in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and line != HEADER]
    assert len(rows) == 4 and sum("moet w2, batch" in line for line in rows) == 2
    assert all(f"{res['info']['commit'] or 'n/a'}" in line and res["info"]["device"] in line for line in rows)
    for name in ("decode_tok_s.png", "decode_roofline.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_decode_with_the_gate_at_forced_fire_rates(tmp_path):
    """--gate-fire: bare W2 and the gate at each forced share of steps, per batch, in one run; the
    gated engine passes six bit-identical runs first; the rows carry the measured fire rate and
    FP4 rows per token (none at 0%, each W2 position recomputed at most once)."""
    res = bench(tmp_path, "decode", "--batch", "1,2", "--decode-tokens", "12", "--gate-fire", "0,0.5,1",
                "--gate-reach", "4")
    c = res["sections"]["decode"]["correctness"]
    assert c["ok"] and c["gate_six_runs_bit_identical"] and c["six_runs_bit_identical"]
    rows = [r for r in res["rows"] if r["scenario"] == "decode"]
    assert len(rows) == 2 * 4
    for b in (1, 2):
        mine = [r for r in rows if r["batch"] == b]
        assert "gate off (bare W2)" in mine[0]["config"] and "gate_fire_rate" not in mine[0]["details"]
        fires = [r["details"]["gate_fire_rate"] for r in mine[1:]]
        per_token = [r["details"]["gate_rows_per_token"] for r in mine[1:]]
        assert fires[0] == 0 and 0.2 < fires[1] < 0.8 and fires[2] == 1.0
        # a repair recomputes each W2 position once: firing on every step recomputes the 11
        # generated positions after the first token (the FP4 prompt gave it), once each
        assert per_token[0] == 0 < per_token[1] <= per_token[2] == pytest.approx(11 / 12)
        assert all(r["tok_s"] > 0 and r["details"]["gate_reach"] == 4 for r in mine[1:])
        assert all("(forced)" in r["config"] for r in mine[1:])


def test_decode_with_mtp_drafts(tmp_path):
    """--speculative 0,1,2 --accept-all on a shape with an MTP layer: one row per draft count and
    batch, every draft kept (k + 1 tokens per verifying step); the speculative engine passes six
    bit-identical runs first."""
    res = bench(tmp_path, "decode", "--batch", "1,2", "--decode-tokens", "12", "--speculative", "0,1,2",
                "--accept-all", shape="micro_mtp")
    c = res["sections"]["decode"]["correctness"]
    assert c["ok"] and c["spec_six_runs_bit_identical"]
    rows = [r for r in res["rows"] if r["scenario"] == "decode"]
    assert len(rows) == 2 * 3
    for r in rows:
        k = r["details"].get("spec_drafts", 0)
        assert f"MTP drafts {k}" in r["config"] and r["tok_s"] > 0
        if k:
            assert r["details"]["spec_mean_tokens_per_step"] == pytest.approx(k + 1, abs=0.35)
            assert r["details"]["spec_acceptance_rate"] == 1.0


def test_prefill(tmp_path):
    res = bench(tmp_path, "prefill", "--tokens", "64,128")
    assert res["sections"]["prefill"]["correctness"]["ok"]
    rows = {r["tokens"]: r for r in res["rows"]}
    assert set(rows) == {64, 128} and all(r["tok_s"] > 0 and r["scenario"] == "prefill" for r in rows.values())
    assert "## prefill" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("args,message", [
    (["decode", "--shape", "llama9000"], "--shape llama9000: unknown shape; choose from glm45air"),
    (["decode", "--shape", "micro", "--batch", "1,x"], "--batch '1,x': give comma-separated whole numbers"),
    (["decode", "--shape", "micro", "--batch", "0"], "--batch '0'"),
    (["residency"], "moet bench residency runs a named shape"),
    (["residency", "--shape", "micro", "--gpu-budget-gb", "32,big"], "--gpu-budget-gb '32,big'"),
    (["decode", "--shape", "micro", "--gate-fire", "0,1.5"], "--gate-fire '0,1.5': give comma-separated shares"),
    (["decode", "--shape", "micro", "--gate-fire", "0.3", "--expert-format", "fp4"],
     "--gate-fire times the FP4 gate over W2 experts"),
    (["decode", "--shape", "micro", "--speculative", "5"], "drafts per step are 0 to 4"),
    (["decode", "--shape", "micro", "--accept-all"], "--accept-all keeps MTP drafts"),
    (["decode", "--shape", "micro", "--speculative", "2"], "has no MTP layer"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    assert main(["bench", *args, "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moet: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "o" / "bench.json").exists()


def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "decode", "--shape", "micro", "--device", "cpu", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moet: error: --out ") and "not a writable directory" in err and "\n" not in err


def test_decode_under_a_grammar(tmp_path):
    """--structured: per batch a free row and one under the bench's JSON-like grammar (a random-
    weight shape gets a synthetic vocabulary of its size); every constrained output is accepted
    by the grammar, token by token."""
    res = bench(tmp_path, "decode", "--batch", "1,2", "--decode-tokens", "12", "--structured")
    rows = [r for r in res["rows"] if r["scenario"] == "decode"]
    assert len(rows) == 2 * 2 and all(r["tok_s"] > 0 for r in rows)
    constrained = [r for r in rows if "JSON-like grammar" in r["config"]]
    assert len(constrained) == 2 and all(r["details"]["grammar_accepts_outputs"] for r in constrained)
    assert sum("output free" in r["config"] for r in rows) == 2


def test_long_prompts_are_prefilled_first(tmp_path):
    """Prompts longer than one step prefills for the whole batch (2 x 300 > 512 tokens a step):
    unprimed, chunked prefill staggers the sequences and the first finishes before the last
    decodes (no batch-2 decode step: no rate). Primed into the prefix cache, both decode together."""
    pytest.importorskip("matplotlib")
    res = bench(tmp_path, "decode", "--batch", "2", "--decode-tokens", "2", prompt_len=300)
    (row,) = [r for r in res["rows"] if r["system"] == "moet"]
    assert row["tok_s"] > 0 and row["details"]["generated"] == 4
    assert "prompts prefilled first" in row["notes"]


def test_layers_cut_a_shape(tmp_path, capsys):
    """--layers N times a shape's first N layers (a shape too big for the card), and says so in
    the shape's label; N past the shape's depth, or --layers without --shape, is one line."""
    pytest.importorskip("matplotlib")
    res = bench(tmp_path, "decode", "--batch", "1", "--decode-tokens", "4", "--layers", "1")
    (row,) = [r for r in res["rows"] if r["system"] == "moet"]
    assert row["shape"] == "micro (tests) (1 of 2 layers)" and row["tok_s"] > 0
    assert main(["bench", "decode", "--shape", "micro", "--layers", "3", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2
    assert "--layers 3: --shape micro has 2 layers" in capsys.readouterr().err
    assert main(["bench", "decode", "--layers", "1", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "--layers cuts a --shape" in capsys.readouterr().err


def test_every_shape_is_a_valid_config():
    """Every --shape parses into a ModelSpec (the real shapes are only built on a GPU), and the
    W2 expert bytes of the ones documented as fitting one H200 do fit its 141 GB with room left."""
    from moet.bench.shapes import SHAPES
    from moet.checkpoint.spec import spec_from_config
    from moet.store.pack_builder import expert_row_bytes
    gib = {}
    for name, (_, cfg) in SHAPES.items():
        spec = spec_from_config(cfg, f"shape {name}")
        gib[name] = len(spec.moe_layers) * spec.router.num_experts * expert_row_bytes(spec, "w2") / 2 ** 30
    assert gib["dsv4"] < 100 and gib["minimax_m2"] < 100 and gib["gpt_oss_120b"] < 40 and gib["glm5"] > 141


def test_a_cut_shape_keeps_its_per_layer_fields_consistent():
    """--layers N and the peer's cut depths: per-layer config lists (gpt-oss's layer_types) are cut
    with the layers, so moet's spec and transformers' config of the cut both parse."""
    import pytest

    from moet.bench.peer import _hf_config
    from moet.bench.shapes import SHAPES, cut_shape
    from moet.checkpoint.spec import spec_from_config
    for name in SHAPES:
        _, cfg = cut_shape(name, 2)
        assert spec_from_config(cfg, name).num_layers == 2
    _, full = cut_shape("gpt_oss_120b", None)
    hf = _hf_config(full, 10)
    assert hf.num_hidden_layers == 10 and hf.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert len(hf.layer_types) == 10
    with pytest.raises(Exception):                      # what the uncut list did to the peer
        _hf_config(dict(full, num_hidden_layers=10), None)
