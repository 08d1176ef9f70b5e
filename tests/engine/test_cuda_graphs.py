"""The static inputs of captured CUDA graphs (engine/cuda_graphs.py), checked on the CPU by running
the model eagerly over them: a step of b sequences loaded into bucket B > b must give the real
rows' hidden states of the step run as built, and its padding sequences must write no KV.
q = 3 is an MTP verify step (a last token and two drafts per sequence), which the attention layers
send through the paged prefill kernels; q = 1 is plain decode. Capture itself needs CUDA
(tests/engine/test_cuda_graph_fallback.py, test_speculative.py)."""
import pytest
import torch

from moet.assets import MOET_TINY
from moet.config import EngineConfig
from moet.engine.cuda_graphs import GraphSet, graph_buckets
from moet.engine.llm_engine import LLMEngine
from moet.model.attention_batch import AttentionBatch
from moet.testing.tiny_checkpoint import cached_checkpoint

BLOCK = 16


def _model(which: str):
    path = str(MOET_TINY) if which == "moet-tiny (MLA)" else cached_checkpoint("qwen3_moe", "bf16")
    eng = LLMEngine.from_config(EngineConfig(model=path, expert_format="fp4", dtype="float32", device="cpu",
                                             max_model_len=128, num_kv_blocks=16))
    return eng.runner.model, eng.runner.kv_format


def _tensors(kv: list) -> list[torch.Tensor]:
    return [t for layer in kv for t in (getattr(layer, n) for n in layer.__slots__) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("which", ["moet-tiny (MLA)", "qwen3_moe (GQA)"])
@pytest.mark.parametrize("q,read_only", [(3, None), (1, None), (3, [2, 0, 1])])
def test_static_step_equals_the_built_step(which, q, read_only):
    """read_only: a widened repair pass (engine/confidence_gate.py), whose leading rows write no KV."""
    torch.manual_seed(0)
    model, fmt = _model(which)
    vocab = model.spec.vocab_size
    kv = model.new_kv_cache(12, BLOCK, fmt, "cpu")
    tables, lens = [[1, 2], [3, 4], [5, 6]], [10, 17, 5]
    prompt = torch.randint(0, vocab, (sum(lens),))
    model.forward_paged(prompt, AttentionBatch.build(block_tables=tables, context_lens=[0] * 3, query_lens=lens,
                                                     block_size=BLOCK, device="cpu"), kv)
    step = AttentionBatch.build(block_tables=tables, context_lens=lens, query_lens=[q] * 3, block_size=BLOCK,
                                device="cpu", read_only_rows=read_only)
    if read_only:
        assert step.slot_mapping.tolist().count(-1) == sum(read_only)
    ids = torch.randint(0, vocab, (3 * q,))
    before = [t.clone() for t in _tensors(kv)]

    gs = GraphSet(q, max_num_seqs=4, table_width=2, max_context=128, device="cpu", name="test")
    gs.block_tables[3] = torch.tensor([7, 8])         # the padding sequence's (stale) table row
    gs.slot_mapping.fill_(5)                           # stale slots of an earlier step: load must clear them
    gs.load(4, ids, step)
    static = model.forward_paged(gs.input_ids[:4 * q], gs.batch(4, seq_lens_host=step.seq_lens_host + [q]), kv)
    written = set(step.slot_mapping.tolist())
    for old, new in zip(before, _tensors(kv)):
        rows_changed = (old != new).reshape(old.shape[0] * old.shape[1], -1).any(-1).nonzero().flatten().tolist()
        assert set(rows_changed) <= written                   # the padding sequence wrote nowhere
    for old, t in zip(before, _tensors(kv)):
        t.copy_(old)
    built = model.forward_paged(ids, step, kv)
    assert static.shape[0] == 4 * q
    torch.testing.assert_close(static[:3 * q], built, rtol=1e-5, atol=1e-5)


def test_bucket_choice():
    gs = GraphSet(3, max_num_seqs=8, table_width=2, max_context=128, device="cpu", name="test")
    assert gs.buckets == graph_buckets(8) == [1, 2, 4, 8]

    def batch(qs):
        return AttentionBatch.build(block_tables=[[0, 1]] * len(qs), context_lens=[4] * len(qs), query_lens=qs,
                                    block_size=BLOCK, device="cpu")

    assert gs.bucket_for(batch([3, 3, 3])) is None                 # nothing captured
    gs.graphs = {b: object() for b in gs.buckets}
    assert gs.bucket_for(batch([3, 3, 3])) == 4
    assert gs.bucket_for(batch([3])) == 1
    assert gs.bucket_for(batch([3, 2, 3])) is None                 # a sequence with fewer drafts: eager
    assert gs.bucket_for(batch([1, 3, 3, 2])) is None              # a decode row leads: eager
    assert gs.bucket_for(batch([3] * 9)) is None                   # more sequences than the largest bucket
    dec = GraphSet(1, max_num_seqs=8, table_width=2, max_context=128, device="cpu", name="test")
    dec.graphs = {b: object() for b in dec.buckets}
    assert dec.bucket_for(batch([1, 1, 1, 1, 1])) == 8 and dec.bucket_for(batch([1, 2])) is None
