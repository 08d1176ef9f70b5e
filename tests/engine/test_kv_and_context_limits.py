"""Impossible KV sizes and a max_model_len past the trained context (issue 34): one ConfigError
line naming the flag to change and what fits, found before the weights are loaded where the
flags alone decide it; vLLM's rule for max_model_len (refused past max_position_embeddings unless
allow_long_max_model_len)."""
import pytest

import moet.model
from moet.engine import model_runner
from moet.errors import ConfigError
from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

KW = dict(expert_format="bf16", dtype="float32", device="cpu", block_size=16, max_num_seqs=2)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False)   # max_position_embeddings 256


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model is loaded: these errors must come before any weight is read."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(moet.model, "load_model", refuse)


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_max_model_len_past_the_trained_context_refused(path, no_load):
    with pytest.raises(ConfigError) as e:
        LLM(path, max_model_len=257, **KW)
    msg = _one_line(e)
    assert "max_position_embeddings=256" in msg and "--max-model-len" in msg and "--allow-long-max-model-len" in msg
    assert path in msg


def test_max_model_len_past_the_trained_context_allowed_when_asked(path):
    with LLM(path, max_model_len=300, allow_long_max_model_len=True, **KW) as llm:
        assert llm.max_model_len == 300
        out = llm.generate([{"prompt_token_ids": [1] * 260}], SamplingParams(max_tokens=2, temperature=0.0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    with LLM(path, max_model_len=256, **KW) as llm:              # the trained context itself is fine
        assert llm.max_model_len == 256


@pytest.mark.parametrize("kw,needles", [
    (dict(num_kv_blocks=1, max_model_len=200), ["--num-kv-blocks 1", "at least 13", "--max-model-len to at most 16"]),
    (dict(kv_cache_memory_gb=0.000001), ["--kv-cache-memory-gb 1e-06", "max_model_len=256", "at least"]),
    (dict(num_kv_blocks=10**9), ["--num-kv-blocks", "free", "lower --num-kv-blocks to at most"]),
    (dict(kv_cache_memory_gb=100000.0), ["--kv-cache-memory-gb 100000", "free", "lower --kv-cache-memory-gb to at most"]),
])
def test_impossible_kv_size_refused_before_load(path, no_load, kw, needles):
    with pytest.raises(ConfigError) as e:
        LLM(path, **KW, **kw)
    msg = _one_line(e)
    for n in needles:
        assert n in msg, msg


def test_kv_size_that_fits_what_the_weights_left(path, monkeypatch):
    """The runner checks again after loading, against the memory free then."""
    real = model_runner.available_kv_bytes
    calls = []

    def shrinking(device):
        calls.append(device)
        return real(device) if len(calls) == 1 else 64 * 1024     # the weights took the rest

    monkeypatch.setattr(model_runner, "available_kv_bytes", shrinking)
    with pytest.raises(ConfigError) as e:
        LLM(path, num_kv_blocks=64, **KW)
    msg = _one_line(e)
    assert len(calls) == 2 and "--num-kv-blocks 64" in msg and "lower --num-kv-blocks to at most" in msg


def test_cpu_default_kv_too_small_names_the_flag(path):
    """No KV flag: the CPU default (at most 4 GiB) cannot hold one sequence of a very long
    max_model_len; the message says which flag sets it."""
    with pytest.raises(ConfigError) as e:
        LLM(path, max_model_len=10**8, allow_long_max_model_len=True, **KW)
    msg = _one_line(e)
    assert "CPU default" in msg and "--kv-cache-memory-gb" in msg and "--max-model-len to at most" in msg


def test_spec_kv_bytes_equal_the_model(path):
    """The pre-load check's bytes per token (from the spec) are the model's, MTP layers included."""
    ds = cached_checkpoint("deepseek_v3", "bf16", tokenizer=False)
    for p, mtp in ((path, True), (ds, True), (ds, False)):
        with LLM(p, load_mtp=mtp, num_kv_blocks=32, **KW) as llm:
            r = llm.engine.runner
            assert model_runner.kv_bytes_per_token_of(llm.spec, r.kv_format, mtp) == r.bytes_per_token
