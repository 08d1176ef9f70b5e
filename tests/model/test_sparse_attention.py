"""DeepSeek Sparse Attention (GLM-5): the indexer's top-k selection against an independent float64
computation; the paged forward while sequences grow past top-k (dense steps that only write index
keys, then sparse ones; a short sequence beside a long one) against the contiguous forward;
shared layers reading their full layer's selection; CUDA graphs never serving a sequence past
top-k; the index keys counted in the KV sizing; config errors."""
from __future__ import annotations

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.checkpoint.spec import spec_from_config
from moet.errors import CheckpointError
from moet.kernels import sparse_attention as dsa
from moet.kernels.kv_cache import KVFormat
from moet.model import load_model
from moet.model.attention_batch import AttentionBatch
from moet.testing.tiny_checkpoint import FAMILIES, VOCAB, cached_checkpoint

pytestmark = pytest.mark.skipif("glm_moe_dsa" not in FAMILIES,
                                reason="transformers < 5.23 has no GlmMoeDsaConfig (the reference)")

BS = 4
F32 = KVFormat("auto", dtype=torch.float32)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def test_select_top_k_equals_float64_brute_force():
    g = _gen()
    t, n, heads, d, top_k = 5, 19, 16, 24, 7      # 16 heads: no two positions tie at an all-zero score
    q, keys = torch.randn(t, heads, d, generator=g), torch.randn(n, d, generator=g)
    w = torch.randn(t, heads, generator=g)
    keep = dsa.select_top_k(q, w, keys, top_k, d ** -0.5)
    for i in range(t):
        p = n - t + i                                              # the query's position
        score = [sum(float(w[i, h]) * max(0.0, float(q[i, h].double() @ keys[j].double()) * d ** -0.5)
                     for h in range(heads)) for j in range(p + 1)]
        best = sorted(range(p + 1), key=lambda j: -score[j])[:top_k]
        assert set(keep[i].nonzero().flatten().tolist()) == set(best), i
    assert keep.sum(1).tolist() == [top_k] * t                  # every query past top_k keeps exactly top_k
    short = dsa.select_top_k(q[:, :, :], w, keys[:4], top_k, d ** -0.5)[-1]   # 4 positions <= top_k: all causal
    assert short.tolist() == [True] * 4


def test_positions_form_and_row_groups_equal_the_mask_form(monkeypatch):
    """The paged path's selection as positions (top_k_positions) names the mask form's set for
    every query, rows before top-k with their future positions invalid; split into row groups
    (a tiny ROW_CHUNK_BYTES) it gives the same positions, and attention over the selected rows
    equals the masked dense attention."""
    from moet.kernels.attention_reference import attend_latent
    g = _gen()
    t, n, heads, d, top_k = 9, 21, 16, 24, 12
    q, keys = torch.randn(t, heads, d, generator=g), torch.randn(n, d, generator=g)
    w = torch.randn(t, heads, generator=g)
    keep = dsa.select_top_k(q, w, keys, top_k, d ** -0.5)
    index, valid = dsa.top_k_positions(q, w, keys, top_k, d ** -0.5)
    assert torch.equal(torch.zeros(t, n, dtype=torch.bool).scatter_(1, index, valid), keep)
    # the first 3 queries (positions 12..14) are past top-k; a query at 11 or before keeps all it has
    monkeypatch.setattr(dsa, "ROW_CHUNK_BYTES", 4 * heads * n * 2)          # two rows a group
    index2, valid2 = dsa.top_k_positions(q, w, keys, top_k, d ** -0.5)
    assert torch.equal(index2, index) and torch.equal(valid2, valid)
    r, p, h = 16, 8, 4
    lat, rope = torch.randn(n, r, generator=g), torch.randn(n, p, generator=g)
    ql = torch.randn(t, h, r + p, generator=g)
    want = attend_latent(ql, lat, rope, 0.3, keep)
    got = dsa.attend_selected(ql, lat, rope, 0.3, index, valid)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    early = dsa.top_k_positions(q[:2], w[:2], keys[:5], top_k, d ** -0.5)     # 5 positions < top-k
    assert early[0].shape == (2, 5) and early[1].sum(1).tolist() == [4, 5]    # causal: the rest invalid


@pytest.mark.parametrize("fmt", [F32, KVFormat("fp8_e4m3", "block", dtype=torch.float32)], ids=["auto", "fp8"])
def test_index_keys_write_skips_slot_minus_one_and_reads_by_page(fmt):
    g = _gen()
    keys = dsa.new_index_keys(3, BS, 8, fmt, "cpu")
    k = torch.randn(4, 8, generator=g) * 3
    dsa.write_index_keys(keys, k, torch.tensor([5, -1, 0, 11]))
    assert keys.data[:-1].float().abs().sum(1).nonzero().flatten().tolist() == [0, 5, 11]   # -1: the sink only
    # a sequence on pages [1, 0, 2]: its positions 0..5 are slots 4..7, 0, 1
    got = dsa.read_index_keys(keys, BS, torch.tensor([1, 0, 2]), 6)
    assert got.shape == (6, 8) and got[[0, 2, 3, 5]].abs().sum() == 0
    if keys.scale is None:
        assert torch.equal(got[1], k[0]) and torch.equal(got[4], k[2]) and torch.equal(dsa.read_index_keys(keys, BS, torch.tensor([1, 2, 0]), 12)[7], k[3])
    else:                       # e4m3 with one scale per token: within half an e4m3 step of its amax
        assert keys.data.dtype == torch.float8_e4m3fn
        err = (got[4] - k[2]).abs().max() / k[2].abs().max()
        assert 0 < err <= 2 ** -4, err


def _model(**kw):
    return load_model(open_checkpoint(cached_checkpoint("glm_moe_dsa", **kw)), expert_format="bf16",
                      dtype=torch.float32)


def test_shared_layers_read_the_full_layers_selection():
    model = _model()
    a0, a1, a2 = (layer.self_attn for layer in model.model.layers)
    assert a0.indexer is not None and a1.indexer is None and a2.indexer is not None
    assert a1.selection is a0.selection and a2.selection is not a0.selection
    assert model.mtp[0].layer.self_attn.indexer is not None
    with torch.no_grad():
        model(torch.arange(30, 42), 0, model.new_cache(16, "cpu"))
    assert a0.selection.keep is not None and a0.selection.keep.shape == (12, 12)
    assert a0.selection.keep.sum(1).tolist() == [min(i + 1, 4) for i in range(12)]


def test_paged_forward_as_sequences_outgrow_top_k():
    """top-k 8: sequence 0's prompt (6) and first decodes run dense and only write index keys; from
    its 9th token on its rows attend sparsely, while sequence 1 stays within top-k in the same
    steps (no selection for it). Every row's logits equal the contiguous forward's."""
    g = _gen()
    model = _model(index_topk=8)
    totals = [13, 6]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in totals]
    schedule = [[(0, 6)], [(0, 1), (1, 3)], [(0, 1), (1, 3)], [(0, 1)], [(0, 1)], [(0, 1)], [(0, 1)], [(0, 1)]]
    tables = [[7, 2, 9, 5], [4, 0]]
    want = []
    with torch.no_grad():
        for s in seqs:
            want.append(model.forward(s, 0, model.new_cache(s.shape[0], "cpu")))
    kv = model.new_kv_cache(10, BS, F32, "cpu")
    done, sparse_steps = [0, 0], 0
    for step in schedule:
        order = [b for b, _ in step]
        batch = AttentionBatch.build(block_tables=[tables[b] for b in order], context_lens=[done[b] for b in order],
                                     query_lens=[n for _, n in step], block_size=BS, device="cpu")
        ids = torch.cat([seqs[b][done[b]:done[b] + n] for b, n in step])
        with torch.no_grad():
            logits = model.logits(model.forward_paged(ids, batch, kv))
        keep = model.model.layers[0].self_attn.selection.keep
        if max(batch.seq_lens_host) > 8:
            sparse_steps += 1
            if len(step) > 1:                                     # (index, valid) per sequence
                assert keep[0] is not None and keep[0][1].sum(1).tolist() == [8] * step[0][1]
                assert keep[1] is None                            # sequence 1 is within top-k
            else:                                                 # an all-decode step: on the device
                assert isinstance(keep, dsa.DecodeSelection) and keep.valid.sum(1).tolist() == [8]
        ref = torch.cat([want[b][done[b]:done[b] + n] for b, n in step])
        assert float((logits - ref).norm() / ref.norm()) < 1e-5, step
        for b, n in step:
            done[b] += n
    assert sparse_steps == 5


def test_decode_rows_past_top_k_run_as_one_batch(monkeypatch):
    """Three sequences past top-k 8 (lengths 11, 14, 17 at their first decode) decode together
    beside one that prefills: the decode rows are selected and attended as one batch
    (batched_top_k_positions, called once per full layer a step); in an all-decode step every
    row is in it, the short sequence too. Then a step as a graph replay sees it: the host lengths
    are the capture's worst case (the table's width), only the device lengths are true. Every
    row's logits equal the contiguous forward's."""
    import dataclasses
    g = _gen()
    model = _model(index_topk=8)
    prompts = [10, 13, 16, 5]
    seqs = [torch.randint(0, VOCAB, (n + 4,), generator=g) for n in prompts]
    perm = torch.randperm(40, generator=g).tolist()          # pages in no order, none shared
    tables, at = [], 0
    for s in seqs:
        need = -(-s.shape[0] // BS)
        tables.append(perm[at:at + need])
        at += need
    want = []
    with torch.no_grad():
        for s in seqs:
            want.append(model.forward(s, 0, model.new_cache(s.shape[0], "cpu")))
    kv = model.new_kv_cache(40, BS, F32, "cpu")
    calls = []
    real = dsa.batched_top_k_positions
    monkeypatch.setattr(dsa, "batched_top_k_positions", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    done = [0, 0, 0, 0]
    schedule = [[(0, 10), (1, 13), (2, 16)], [(0, 1), (1, 1), (2, 1), (3, 5)], [(0, 1), (1, 1), (2, 1), (3, 1)],
                [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1), (3, 1)]]
    width = max(len(t) for t in tables)
    for i, step in enumerate(schedule):
        order = [b for b, _ in step]
        batch = AttentionBatch.build(block_tables=[tables[b] for b in order], context_lens=[done[b] for b in order],
                                     query_lens=[n for _, n in step], block_size=BS, device="cpu",
                                     pad_blocks_to=width)
        if i == len(schedule) - 1:                   # as captured: worst-case host lengths
            batch = dataclasses.replace(batch, seq_lens_host=[width * BS] * len(step))
        ids = torch.cat([seqs[b][done[b]:done[b] + n] for b, n in step])
        with torch.no_grad():
            logits = model.logits(model.forward_paged(ids, batch, kv))
        ref = torch.cat([want[b][done[b]:done[b] + n] for b, n in step])
        assert float((logits - ref).norm() / ref.norm()) < 1e-5, step
        for b, n in step:
            done[b] += n
    full = sum(t == "full" for t in model.spec.sparse_attention.layer_types)
    assert calls == [3] * full + [4] * full + [3] * full + [4] * full     # each full layer once a step


def test_quantized_cache_keeps_the_selection_close():
    """With an fp8 cache the index keys are e4m3 with a per-token scale. Layer 0's indexer sees the
    same input either way (the embeddings), so its selection differs only through the keys'
    rounding: nearly every selected position stays (seen: 96-100% per prompt, a row at worst 3 of
    4; keys read from wrong slots pick unrelated positions). The keys' own round trip, scale
    included, is checked above. The logits stay O(0.1) from the float32 cache's (seen up to 0.54
    over random prompts: MLA rows in fp8 too, and tiny random models flip expert choices), not O(1)."""
    g = _gen()
    model = _model()
    seq = torch.randint(0, VOCAB, (14,), generator=g)
    keeps, logits = [], []
    for fmt in (F32, KVFormat("fp8_e4m3", "block", group=16, dtype=torch.float32)):
        kv = model.new_kv_cache(6, BS, fmt, "cpu")
        batch = AttentionBatch.build(block_tables=[[3, 1, 5, 0]], context_lens=[0], query_lens=[14], block_size=BS,
                                     device="cpu")
        with torch.no_grad():
            logits.append(model.logits(model.forward_paged(seq, batch, kv)))
        index, valid = model.model.layers[0].self_attn.selection.keep[0]
        keeps.append(torch.zeros(14, 14, dtype=torch.bool).scatter_(1, index, valid))
    assert kv[0].index_keys.data.dtype == torch.float8_e4m3fn
    overlap = ((keeps[0] & keeps[1]).sum(1).float() / keeps[0].sum(1)).mean()
    assert overlap >= 0.9, overlap
    rel = float((logits[1] - logits[0]).norm() / logits[0].norm())
    assert 1e-6 < rel < 1.0, rel


def test_graphs_do_not_serve_sequences_past_top_k():
    """A DSA model's verify / repair / drafting graphs hold the dense path (max_context = top-k):
    a step with a longer sequence runs eager. (Its decode graphs serve every length: the
    all-decode selection is graph-safe, test_decode_rows_past_top_k_run_as_one_batch.)"""
    from moet.engine.cuda_graphs import GraphSet
    gs = GraphSet(3, 4, 8, 8, "cpu", "MTP verify")               # max_context 8: a DSA model's top-k
    gs.graphs[4] = object()                                      # as if bucket 4 were captured

    def batch(lens):
        return AttentionBatch.build(block_tables=[[0, 1, 2]] * len(lens), context_lens=[n - 3 for n in lens],
                                    query_lens=[3] * len(lens), block_size=BS, device="cpu")
    assert gs.bucket_for(batch([3, 8])) == 4
    assert gs.bucket_for(batch([3, 9])) is None
    assert gs.batch(2).seq_lens_host == [8, 8]                  # the capture stays on the dense path


def test_decode_steps_pick_the_dense_graphs_then_the_long_ones():
    """A DSA model's decode graphs come in two sets (ModelRunner): the dense one serves steps whose
    sequences are all within top-k (no index keys read past them), the set captured at
    max_model_len the steps past it; longer than that: eager."""
    from types import SimpleNamespace

    from moet.engine.cuda_graphs import GraphSet
    from moet.engine.model_runner import ModelRunner
    dense, long = GraphSet(1, 4, 12, 8, "cpu", "decode"), GraphSet(1, 4, 12, 40, "cpu", "decode past top-k")
    dense.graphs[4] = long.graphs[4] = object()
    runner = SimpleNamespace(decode_graphs=dense, long_decode_graphs=long, spec_graphs={})

    def pick(lens):
        b = AttentionBatch.build(block_tables=[list(range(12))] * len(lens), context_lens=[n - 1 for n in lens],
                                 query_lens=[1] * len(lens), block_size=BS, device="cpu")
        found = ModelRunner._graph_for(runner, b)
        return None if found is None else found[0]
    assert pick([3, 8]) is dense and pick([3, 9]) is long and pick([40]) is long and pick([41]) is None


def test_kv_sizing_counts_index_keys():
    from moet.engine.model_runner import kv_bytes_per_token_of
    model = _model()
    spec = model.spec
    from moet.kernels.kv_cache import kv_layer_bytes_per_token
    # index keys of the two full layers and the MTP layer: 32 float32 values, or 32 e4m3 + a scale
    for fmt, index_bytes in ((F32, 32 * 4), (KVFormat("fp8_e4m3", "block", group=16, dtype=torch.float32), 36),
                             (KVFormat("nvfp4", dtype=torch.float32), 36)):
        with_index = model.kv_bytes_per_token(fmt)
        assert kv_bytes_per_token_of(spec, fmt, load_mtp=True) == with_index
        assert with_index == 4 * kv_layer_bytes_per_token(spec.attention, fmt) + 3 * index_bytes


def _config(**kw):
    import json
    with open(cached_checkpoint("glm_moe_dsa") + "/config.json") as f:
        cfg = json.load(f)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("change,message", [
    ({"indexer_types": ["shared", "full", "full"]}, "must start with 'full'"),
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
    ({"indexer_types": ["full"]}, "indexer_types"),
    ({"q_lora_rank": None}, "q_lora_rank is required"),
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(CheckpointError, match=message):
        spec_from_config(_config(**change))


def test_pattern_and_default_schedules():
    assert spec_from_config(_config(indexer_types=None, index_topk_pattern="FSF")).sparse_attention.layer_types == \
        ("full", "shared", "full")
    # transformers' default: freq 2, offset 2 -> layers 0 full, 1 full, 2 shared (max(i - 1, 0) % 2)
    spec = spec_from_config(_config(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=2))
    assert spec.sparse_attention.layer_types == ("full", "full", "shared")


@pytest.mark.parametrize("fmt", ["bf16", "w2"])
def test_engine_greedy_with_mtp_drafts_and_chunked_prefill(fmt):
    """Through the engine (paged KV, continuous batching, chunked prefill of 5 tokens, W2 experts
    with the FP4 gate): MTP drafts (the MTP layer's own indexer) change no greedy token, and two
    runs give the same tokens; every sequence outgrows top-k (4) within its prompt."""
    from moet.engine.llm_engine import LLMEngine
    from moet.config import EngineConfig
    from moet.sampling_params import SamplingParams

    path = cached_checkpoint("glm_moe_dsa")
    prompts = [list(range(30, 30 + n)) for n in (3, 9, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(k, budget=8192):
        kw = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
        eng = LLMEngine.from_config(EngineConfig(model=path, expert_format=fmt, dtype="float32", device="cpu",
                                                 max_num_batched_tokens=budget, max_num_seqs=4, **kw))
        done = eng.generate_all([(str(i), {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts)])
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], eng

    want, _ = run(0)
    got, eng = run(2, budget=5)
    assert got == want
    assert eng.stats().extra["spec_draft_tokens_total"] > 0
    assert run(2)[0] == want


def test_expert_store_with_a_capped_cache_is_the_resident_engine(tmp_path, monkeypatch):
    """W2 experts paged from their pack through a device cache too small for a step's experts
    (misses fetched from the pack mid-step, or replayed): token ids and
    logprobs equal the all-resident engine's, bit for bit."""
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    from moet.sampling_params import SamplingParams

    monkeypatch.setenv("HOME", str(tmp_path))
    path = cached_checkpoint("glm_moe_dsa", "bf16", tokenizer=False, n_routed_experts=16)
    prompts = [list(range(40, 40 + n)) for n in (5, 9, 3)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(**kw):
        eng = LLMEngine.from_config(EngineConfig(model=path, expert_format="w2", fp4_gate=False, dtype="float32",
                                                 device="cpu", max_num_seqs=4, max_num_batched_tokens=16, **kw))
        try:
            done = eng.generate_all([(str(i), {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts)])
            return [(done[str(i)].outputs[0].token_ids,
                     [{t: lp.logprob for t, lp in d.items()} for d in done[str(i)].outputs[0].logprobs])
                    for i in range(len(prompts))], eng.stats().extra
        finally:
            eng.close()

    want, _ = run()
    got, st = run(pack_dir=str(tmp_path / "packs"), expert_cache_slots=20)
    assert got == want
    assert st["expert_cache_slots"] == 20 and st["expert_rows_fetched_total"] > 0 and st["expert_cache_hit_rate"] < 1


@pytest.mark.parametrize("fmt", [F32, KVFormat("fp8_e4m3", "block", dtype=torch.float32), KVFormat("nvfp4", dtype=torch.float32)],
                         ids=["auto", "fp8", "nvfp4"])
def test_reading_selected_positions_equals_reading_the_sequence(fmt):
    """The decode path reads only the selected rows (kv_cache.read_mla_positions): for every cache
    format they equal the whole sequence read and indexed, for positions on any page."""
    from moet.kernels import kv_cache
    g = _gen()
    cache = kv_cache.new_mla_layer(6, BS, 32, 16, fmt, "cpu")
    if cache.scale_2 is not None:
        cache.scale_2.copy_(torch.tensor([0.5, 0.25]))
    blocks, n = torch.tensor([4, 1, 5, 2]), 3 * BS + 2
    slots = blocks.repeat_interleave(BS)[:n] * BS + torch.arange(n) % BS
    kv_cache.write_mla_kv(cache, torch.randn(n, 32, generator=g), torch.randn(n, 16, generator=g), slots)
    lat, rope = kv_cache.read_mla_kv(cache, blocks, n)
    pos = torch.randint(0, n, (3, 5), generator=g)
    got_lat, got_rope = kv_cache.read_mla_positions(cache, blocks, pos)
    assert torch.equal(got_lat, lat[pos]) and torch.equal(got_rope, rope[pos])
