"""Bad numbers in config.json (issue 34): negative, zero, fractional, string, boolean, infinite or
inconsistent values become one CheckpointError line naming the field and the file, from both
`moet inspect` (exit 2, `moet: error: ...`) and `LLM(...)` (before any weight is read), never a
ValueError / ZeroDivisionError / allocation traceback."""
import json
import os
import shutil

import pytest

from moet import cli
from moet.errors import CheckpointError
from moet.testing.tiny_checkpoint import cached_checkpoint

# (family, field, value, text the message must contain besides the file); None value = delete
CASES = [
    ("qwen3_moe", "hidden_size", -64, "hidden_size=-64"),
    ("qwen3_moe", "hidden_size", 0, "hidden_size=0"),
    ("qwen3_moe", "hidden_size", "64", "hidden_size='64'"),
    ("qwen3_moe", "hidden_size", 64.5, "hidden_size=64.5"),
    ("qwen3_moe", "hidden_size", True, "hidden_size=True"),
    ("qwen3_moe", "hidden_size", 128, "hidden_size"),                # disagrees with the weights
    ("qwen3_moe", "hidden_size", None, "hidden_size"),               # missing
    ("qwen3_moe", "num_hidden_layers", 0, "num_hidden_layers=0"),
    ("qwen3_moe", "num_hidden_layers", -3, "num_hidden_layers=-3"),
    ("qwen3_moe", "num_hidden_layers", "3", "num_hidden_layers='3'"),
    ("qwen3_moe", "num_attention_heads", 0, "num_attention_heads=0"),
    ("qwen3_moe", "num_attention_heads", -4, "num_attention_heads=-4"),
    ("qwen3_moe", "num_attention_heads", 3, "num_attention_heads=3"),   # not a multiple of kv heads
    ("qwen3_moe", "num_key_value_heads", 0, "num_key_value_heads=0"),
    ("qwen3_moe", "num_key_value_heads", 8, "num_key_value_heads=8"),   # more kv heads than heads
    ("qwen3_moe", "head_dim", 0, "head_dim=0"),
    ("qwen3_moe", "head_dim", 15, "head_dim=15"),                   # odd: rotary needs pairs
    ("qwen3_moe", "vocab_size", 0, "vocab_size=0"),
    ("qwen3_moe", "vocab_size", "260", "vocab_size='260'"),
    ("qwen3_moe", "vocab_size", 10**12, "vocab_size"),               # would allocate terabytes
    ("qwen3_moe", "num_experts", 0, "num_experts=0"),
    ("qwen3_moe", "num_experts", 10**6, "num_experts"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok=9"),  # more than the 8 experts
    ("qwen3_moe", "num_experts_per_tok", 0, "num_experts_per_tok=0"),
    ("qwen3_moe", "moe_intermediate_size", -1, "moe_intermediate_size=-1"),
    ("qwen3_moe", "intermediate_size", 10**9, "intermediate_size"),
    ("qwen3_moe", "decoder_sparse_step", 0, "decoder_sparse_step=0"),
    ("qwen3_moe", "max_position_embeddings", 0, "max_position_embeddings=0"),
    ("qwen3_moe", "rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "default", "rope_theta": 0}, "rope_theta=0"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "default", "rope_theta": -5.0}, "rope_theta=-5.0"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "default", "rope_theta": "1e6"}, "rope_theta='1e6'"),
    ("qwen3_moe", "rope_parameters", [1, 2], "rope_parameters=[1, 2]"),
    ("qwen3_moe", "eos_token_id", "</s>", "eos_token_id='</s>'"),
    ("qwen3_moe", "mlp_only_layers", ["a"], "mlp_only_layers='a'"),
    ("deepseek_v3", "n_routed_experts", 0, "n_routed_experts=0"),
    ("deepseek_v3", "n_group", 0, "n_group=0"),
    ("deepseek_v3", "n_group", 3, "n_group=3"),                      # does not divide 8 experts
    ("deepseek_v3", "kv_lora_rank", 0, "kv_lora_rank=0"),
    ("deepseek_v3", "qk_rope_head_dim", 15, "qk_rope_head_dim=15"),
    ("deepseek_v3", "v_head_dim", -16, "v_head_dim=-16"),
    ("deepseek_v3", "q_lora_rank", 0, "q_lora_rank=0"),
    ("deepseek_v3", "moe_layer_freq", 0, "moe_layer_freq=0"),
    ("deepseek_v3", "first_k_dense_replace", -1, "first_k_dense_replace=-1"),
    ("deepseek_v3", "routed_scaling_factor", 0, "routed_scaling_factor=0"),
    ("deepseek_v3", "num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1"),
    ("glm4_moe", "partial_rotary_factor", 2.0, "partial_rotary_factor=2.0"),
    ("mixtral", "num_local_experts", -4, "num_local_experts=-4"),
    ("mixtral", "sliding_window", 0, "sliding_window=0"),
    ("mixtral", "hidden_size", 60, "hidden_size=60"),                 # 60 / 4 heads: head_dim 15 is odd
]


@pytest.fixture(scope="module")
def sources():
    return {fam: cached_checkpoint(fam, "bf16") for fam in {c[0] for c in CASES}}


def _corrupt(sources, tmp_path, family, field, value) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(sources[family], dst)
    p = os.path.join(dst, "config.json")
    cfg = json.load(open(p))
    params = cfg.get("rope_parameters")
    if field == "partial_rotary_factor" and isinstance(params, dict) and field in params:
        params[field] = value                         # where this family keeps it
    elif value is None:
        cfg.pop(field, None)
    else:
        cfg[field] = value
    json.dump(cfg, open(p, "w"))
    return dst


@pytest.mark.parametrize("family,field,value,needle", CASES, ids=[f"{c[0]}-{c[1]}={c[2]!r}"[:60] for c in CASES])
def test_bad_config_value_is_one_line_naming_field_and_file(sources, tmp_path, capsys, monkeypatch, family, field,
                                                           value, needle):
    path = _corrupt(sources, tmp_path, family, field, value)
    cfg_file = os.path.join(path, "config.json")
    # moet inspect: exit 2 and one stderr line
    assert cli.main(["inspect", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moet: error: ") and "\n" not in err, err
    assert cfg_file in err and needle in err, err
    # LLM(...): the same one line, raised before any model is built or weight read
    import moet.model

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before config.json was checked")

    monkeypatch.setattr(moet.model, "load_model", no_load)
    from moet.llm import LLM

    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu", dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and cfg_file in msg and needle in msg


def test_sane_configs_still_load(sources):
    from moet.checkpoint import open_checkpoint

    for path in sources.values():
        spec = open_checkpoint(path).spec
        assert spec.hidden_size == 64 and spec.num_layers > 0
