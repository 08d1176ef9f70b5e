"""A CUDA-graph capture that fails (here: a MoE path made to read a value on the host, which is
legal eagerly and fatal inside a capture) falls back to eager decode with one warning and leaves
the process as it found it: the caller's stream, no capture open, the graph pool released, and the
default CUDA generator out of capture mode, so that graphs captured earlier still replay and
later models load, capture and sample. Before ModelRunner undid the failure, the next random op on
the device (the KV profiler's random ids, any graph replay) failed with "Offset increment outside
graph capture encountered unexpectedly"."""
import gc
import logging

import pytest
import torch

PROMPT = list(range(40, 40 + 13))


def test_capture_error_text_names_the_first_error_and_where():
    """torch.cuda.graph's exit raises again from capture_end while the capture's own error is being
    handled; the text must name the first one (the cause) and the moet frame it was raised in."""
    from moet.engine.cuda_graphs import capture_error_text

    def in_capture():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")

    try:
        try:
            in_capture()
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        text = capture_error_text(exc)
    assert text.startswith("RuntimeError: CUDA error: operation not permitted when stream is capturing")
    assert "more lines" not in text
    assert text.endswith("; then RuntimeError: CUDA error: operation failed due to a previous error during capture")
    # raised in this file: its path names no moet package directory unless the checkout does
    assert "test_cuda_graph_fallback.py" in text or "(at " not in text


def test_capture_error_text_single_exception():
    from moet.engine.cuda_graphs import capture_error_text

    assert capture_error_text(ValueError("bad")) == "ValueError: bad"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")


def _llm(family: str, expert_format: str):
    from moet.llm import LLM
    from moet.testing.tiny_checkpoint import cached_checkpoint

    # a small explicit KV cache: tests share the GPU (xdist workers), and three engines live at once
    return LLM(cached_checkpoint(family, "bf16"), expert_format=expert_format, dtype="float32", max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_gb=0.02)


def _tokens(llm, sp):
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": PROMPT}] * 2, sp)]


@needs_cuda
def test_failed_capture_falls_back_and_leaves_the_process_working(monkeypatch, caplog):
    from moet.model.layers import moe as moe_layer
    from moet.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = _llm("qwen3_moe", "w2")           # the Triton MoE: captures
    assert sorted(first.engine.runner.graphs) == [1, 2, 4] and first.engine.runner.graph_error is None
    first_tokens = _tokens(first, greedy)
    stream = torch.cuda.current_stream()

    real = moe_layer.moe_experts

    def syncing(hidden, *args, **kwargs):         # a host read: fine eagerly, invalidates a capture
        float(hidden.sum())
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(moe_layer, "moe_experts", syncing)
    with caplog.at_level(logging.WARNING, logger="moet.engine"):
        broken = _llm("deepseek_v3", "bf16")
    monkeypatch.undo()
    runner = broken.engine.runner
    assert runner.graphs == {}
    torch.randint(0, 100, (16,), device="cuda")   # the default generator (the KV profiler draws from it)
    torch.rand(4, device="cuda").exponential_()
    # graphs captured before the failure still replay (a replay advances the default generator)
    assert _tokens(first, greedy) == first_tokens
    # the model whose capture failed decodes eagerly
    assert all(len(t) == 8 for t in _tokens(broken, greedy))
    # a later model in the same process captures and samples
    later = _llm("glm4_moe", "w2")
    assert sorted(later.engine.runner.graphs) == [1, 2, 4] and later.engine.runner.graph_error is None
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True, seed=7)
    a, b = _tokens(later, sampled), _tokens(later, sampled)
    assert a == b and all(len(t) == 8 for t in a)
    # the caller's stream, no capture open
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    # one warning, naming the cause and where it was raised
    warned = [r.getMessage() for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert len(warned) == 1 and "not undone" not in warned[0], warned
    assert "moet/model/layers/moe.py" in runner.graph_error, runner.graph_error
    # the failed capture's pool was handed back: none of its segments is left once freed blocks are
    gc.collect()
    torch.cuda.empty_cache()
    segments = torch.cuda.memory._snapshot()["segments"]
    assert segments and all("segment_pool_id" in s for s in segments)
    assert tuple(runner.decode_graphs.pool) not in {tuple(s["segment_pool_id"]) for s in segments}


@needs_cuda
def test_dense_experts_decode_is_captured():
    """expert_format bf16 (a DensePool) on CUDA: the MoE runs without a host sync at decode sizes,
    so the fp32 tiny DeepSeek-V3 captures its decode graphs (its reference MoE synced the host at
    every layer, and its capture always failed); graphs and eager decode give the same tokens."""
    from moet.llm import LLM
    from moet.sampling_params import SamplingParams
    from moet.testing.tiny_checkpoint import cached_checkpoint

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(expert_format="bf16", dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory_gb=0.02)
    path = cached_checkpoint("deepseek_v3", "bf16")
    graphs = LLM(path, **kw)
    assert sorted(graphs.engine.runner.graphs) == [1, 2, 4], graphs.engine.runner.graph_error
    eager = LLM(path, enforce_eager=True, **kw)
    assert eager.engine.runner.graphs == {}
    assert _tokens(graphs, greedy) == _tokens(eager, greedy)
