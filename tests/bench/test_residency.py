"""`moet bench residency` end to end on CPU (micro shape): the tiny checkpoint's store outputs
equal all resident before anything is timed; all resident, then a 50% card through the expert
store (outputs equal to resident, hit rate below 1, bytes fetched, the plan's prediction) at
each batch; a 100% card is all resident (no store)."""
import json

from moet.bench import residency
from moet.cli import main


def test_residency_on_the_micro_shape(tmp_path):
    assert main(["bench", "residency", "--shape", "micro", "--device", "cpu", "--gpu-budget-gb", "50%,100%",
                 "--residency-batch", "1,2", "--decode-tokens", "4", "--prompt-len", "6",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench.json").read_text())
    sec = r["sections"]["residency"]
    assert sec["correctness_tiny"]["ok"] and sec["correctness_tiny"]["25pct"]["bit_identical"]
    assert "every expert fits" in sec["100% of the experts"]
    rows = r["rows"]
    resident = {x["batch"]: x for x in rows if x["series"] == "all resident"}
    cached = {x["batch"]: x for x in rows if x["series"] == "50% of the experts"}
    assert set(resident) == set(cached) == {1, 2}
    for b in (1, 2):
        assert resident[b]["tok_s"] > 0 and cached[b]["tok_s"] > 0
        d = cached[b]["details"]
        assert d["correctness"]["bit_identical"] and d["slots"] == sec["model"]["rows"] // 2
        assert 0 <= d["hit_rate"] < 1 and d["bytes_fetched_per_generated_token"] > 0
        assert d["plan"][str(b)]["predicted_tok_s"] > 0 and d["plan"][str(b)]["predicted_hit_rate"] == 0.5
    assert resident[1]["details"]["plan"]["predicted_hit_rate"] == 1.0
    md = (tmp_path / "bench.md").read_text()
    assert "## residency" in md and md.count("50% of the experts") == 2


def test_prefill_done_steps_follows_the_scheduler():
    """Hand-worked schedule, 4 prompts of 3 tokens, 4 tokens a step: step 1 prefills p0 (3) and
    starts p1 (1); step 2: p0 decodes, p1 ends (2), p2 starts (1); step 3: 2 decodes + p2's last 2;
    step 4: 3 decodes + p3's first token; step 5: 3 decodes + 1; step 6: p3's last token."""
    assert residency.prefill_done_steps(3, 4, 4) == [1, 2, 3, 6]
    assert residency.prefill_done_steps(64, 4, 4) == [16, 38, 69, 133]   # 64/4, then 3, 2, 1 a step
    assert residency.prefill_done_steps(64, 4, 256) == [1, 1, 1, 1]
