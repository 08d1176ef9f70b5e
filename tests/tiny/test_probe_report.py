"""moet probe's quality table and trade-off plot (probe/report.py) from a results dict, and the
probe's per-probe gate rates (probe/run.py gate_rates)."""
import pytest

from moet.probe.report import markdown_table, plot_tradeoff
from moet.probe.run import gate_rates

RESULTS = {"formats": {
    "bf16": {"facts": {"accuracy": 0.84}, "arithmetic": {"accuracy": 0.945},
             "code": {"top1": 0.5}},
    "nvfp4": {"facts": {"accuracy": 0.84}, "arithmetic": {"accuracy": 0.945},
              "code": {"top1_vs_bf16": 1.0, "kl_vs_bf16": 0.0}},
    "w2": {"facts": {"accuracy": 0.64}, "arithmetic": {"accuracy": 0.03},
           "code": {"top1_vs_bf16": 0.81, "kl_vs_bf16": 0.123}},
    "w2+gate@0.9": {"facts": {"accuracy": 0.77, "gate_fire_rate": 0.19, "gate_rows_per_token": 1.8},
                    "arithmetic": {"accuracy": 0.615, "gate_fire_rate": 0.058, "gate_rows_per_token": 1.54}},
    "w2+gate@0.99": {"facts": {"accuracy": 0.78, "gate_fire_rate": 0.41, "gate_rows_per_token": 4.3},
                     "arithmetic": {"accuracy": 0.91, "gate_fire_rate": 0.136, "gate_rows_per_token": 3.54}},
}}


def test_markdown_table_has_a_row_per_variant_and_the_fire_rates():
    md = markdown_table(RESULTS)
    lines = md.strip().splitlines()
    assert lines[0] == ("| experts | facts | arithmetic | code top-1 vs bf16 | code KL vs bf16 | fire, facts | "
                        "fire, arithmetic | FP4 rows / token, arithmetic |")
    assert len(lines) == 2 + 5
    assert lines[4] == "| W2 | 64.0% | 3.0% | 81.0% | 0.123 |  |  |  |"
    assert lines[6] == "| W2 + gate, tau 0.99 | 78.0% | 91.0% |  |  | 41.0% | 13.6% | 3.54 |"


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "q.png"
    plot_tradeoff(RESULTS, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_gate_rates_over_one_probe():
    before = {"rows_checked": 10, "fires": 2, "recomputed_rows": 20, "generated_tokens": 10}
    after = {"rows_checked": 110, "fires": 27, "recomputed_rows": 120, "generated_tokens": 60}
    assert gate_rates(before, after) == {"gate_fire_rate": 0.25, "gate_rows_per_token": 2.0}
    assert gate_rates(after, after) == {"gate_fire_rate": 0.0, "gate_rows_per_token": 0.0}


def test_mtp_columns_and_rates():
    from moet.probe.run import spec_rates
    before = {"seq_steps": 10, "emitted": 15, "drafts": 20, "accepted": 5}
    after = {"seq_steps": 30, "emitted": 59, "drafts": 60, "accepted": 29}
    assert spec_rates(before, after) == {"mtp_tokens_per_step": 2.2, "mtp_acceptance": 0.6}
    assert spec_rates(after, after) == {}                 # no verifying step in that probe
    res = {"formats": {"w2": {"arithmetic": {"accuracy": 0.03, "mtp_tokens_per_step": 2.18}},
                       "nvfp4": {"arithmetic": {"accuracy": 0.945, "mtp_tokens_per_step": 2.15}}}}
    lines = markdown_table(res).strip().splitlines()
    assert lines[0] == "| experts | arithmetic | MTP tokens / step, arithmetic |"
    assert lines[2] == "| W2 | 3.0% | 2.18 |"
