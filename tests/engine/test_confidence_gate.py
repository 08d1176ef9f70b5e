"""The FP4 repair tier and the confidence gate (engine/confidence_gate.py).

  * the repair tier's forward equals, bit for bit, a model whose routed experts are FP4, on the
    same paged batch and KV (and differs from the W2 forward: the switch reaches the experts);
  * on moet-tiny, an engine whose gate fires on a fixed share of steps gives, token for token
    (logprobs within float32 noise), what a hand-written contiguous-cache loop of the same
    algorithm gives (W2 forward; on a fired step the last reach + 1 positions again with FP4
    experts, their KV overwritten, the token from the repaired logits), for several reaches,
    block sizes (repairs across committed blocks), prefix caching on / off and chunked prefill;
    the default engine answers moet-tiny's 345 + 278 where bare W2 does not;
  * tau 0 never fires and equals bare W2; several gated sequences in one batch give what each
    gives alone;
  * shared KV blocks are never written; rewritten blocks leave the prefix cache index;
  * bad settings are one ConfigError naming the flag, before any weight is read.
"""
import contextlib
import dataclasses

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.engine.block_manager import BlockManager
from moet.engine.confidence_gate import ConfidenceGate, forced_draw
from moet.engine.llm_engine import LLMEngine
from moet.engine.sequence import Sequence
from moet.errors import ConfigError
from moet.kernels.kv_cache import KVFormat
from moet.model import load_model
from moet.model.attention_batch import AttentionBatch
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

BASE = [(11 * i + 5) % 250 for i in range(40)]
PROMPTS = [BASE[:6], BASE[:19], [9, 8, 7], BASE[:33] + [1, 2]]
MAX_NEW = 12


def engine(path, **kw):
    kw = {"expert_format": "w2", "dtype": "float32", "device": "cpu", **kw}
    return LLMEngine.from_config(EngineConfig(model=path, **kw))


def run(eng, prompts, sp):
    done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def path(request):
    return cached_checkpoint(request.param)


def tensors(layer):
    return [(f.name, getattr(layer, f.name)) for f in dataclasses.fields(layer)
            if isinstance(getattr(layer, f.name), torch.Tensor)]


def test_repair_forward_is_the_fp4_model(path):
    ckpt = open_checkpoint(path)
    gated = load_model(ckpt, expert_format="w2", dtype=torch.float32, repair_tier=True)
    fp4 = load_model(open_checkpoint(path), expert_format="fp4", dtype=torch.float32)
    assert gated.has_repair_tier() and not fp4.has_repair_tier()
    bs, g = 4, torch.Generator().manual_seed(3)
    fmt = KVFormat("auto", dtype=torch.float32)
    kv_a = gated.new_kv_cache(12, bs, fmt, "cpu")
    for layer in kv_a:                       # the same random context in both caches
        for _, t in tensors(layer):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    kv_b = fp4.new_kv_cache(12, bs, fmt, "cpu")
    for a, b in zip(kv_a, kv_b):
        for name, t in tensors(a):
            getattr(b, name).copy_(t)
    # two sequences with context (9 and 5 tokens) adding 3 and 1 positions, in mixed order
    batch = AttentionBatch.build(block_tables=[[0, 1, 2], [3, 4]], context_lens=[9, 5], query_lens=[3, 1],
                                 block_size=bs, device="cpu")
    ids = torch.randint(0, 250, (4,), generator=g)
    with torch.inference_mode():
        w2 = gated.forward_paged(ids, batch, [x for x in kv_a])
        with gated.repair_tier():
            got = gated.forward_paged(ids, batch, kv_a)
        want = fp4.forward_paged(ids, batch, kv_b)
    assert torch.equal(got, want)
    assert not torch.equal(w2, want)
    for a, b in zip(kv_a, kv_b):             # the KV the repair wrote, too
        for name, t in tensors(a):
            assert torch.equal(t, getattr(b, name)), name
    # outside the context the layers compute with W2 again
    assert all(not m.experts.repairing for m in gated.moe_blocks().values())


class _Req:
    """What forced_draw reads of a sequence."""
    def __init__(self, request_id: str):
        self.request_id, self.index = request_id, 0


def reference_gate(model, prompt, reach, max_new, fires, fp4_prefill):
    """The gate on a contiguous cache: the prompt with FP4 experts (fp4_prefill) or W2, then at each
    step whose position q fires (fires(q); never the prompt's last position when it ran FP4)
    positions max(P or P - 1, q - reach) .. q again with FP4 experts (KV overwritten) and the token
    from the repaired logits; the other steps keep their W2 logits. -> (tokens, logprobs of the
    chosen tokens, every step's logprob vector)."""
    cache = model.new_cache(len(prompt) + max_new + 1, "cpu")
    toks, p = list(prompt), len(prompt)
    ids, lps, dists = [], [], []
    with torch.inference_mode():
        with model.repair_tier() if fp4_prefill else contextlib.nullcontext():
            logits = model.forward(torch.tensor(toks), 0, cache)[-1]
        for _ in range(max_new):
            q = len(toks) - 1
            if fires(q) and not (fp4_prefill and q == p - 1):
                first = max(p if fp4_prefill else p - 1, q - reach)
                with model.repair_tier():
                    logits = model.forward(torch.tensor(toks[first:q + 1]), first, cache)[-1]
            lp = logits.float().log_softmax(-1)
            nxt = int(lp.argmax())
            ids.append(nxt)
            lps.append(float(lp[nxt]))
            dists.append(lp)
            toks.append(nxt)
            logits = model.forward(torch.tensor([nxt]), len(toks) - 1, cache)[-1]   # the next step's W2 pass
    return ids, lps, torch.stack(dists)


@pytest.fixture(scope="module")
def tiny():
    """moet-tiny (trained: its W2 and FP4 experts disagree, unlike the random test checkpoints')
    and chat prompts of its own."""
    from moet.probe.loader import default_checkpoint
    from transformers import AutoTokenizer

    path = str(default_checkpoint())
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 345 + 278?", "What is 907 - 458?", "What is the capital of Poland?")]
    return path, [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]


GATED = {
    "reach0": dict(gate_reach=0),
    "reach3-blocks4": dict(gate_reach=3, block_size=4),
    "reach32": dict(gate_reach=32),
    "reach5-no-prefix-cache": dict(gate_reach=5, block_size=4, enable_prefix_caching=False),
    "reach5-chunked": dict(gate_reach=5, block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
    "w2-prompt-reach3": dict(gate_reach=3, block_size=4, fp4_prefill=False),
    "w2-prompt-chunked": dict(gate_reach=5, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                              fp4_prefill=False),
}
RATE, TINY_NEW = 0.3, 20


@pytest.mark.parametrize("case", list(GATED))
def test_gate_equals_reference(tiny, case):
    """The gate fires on a fixed 30% of steps (forced_draw, as `moet bench --gate-fire`), so the
    steps that do not fire read KV that earlier repairs rewrote or left W2: the reach shows."""
    path, prompts = tiny
    eng = engine(path, **GATED[case])
    eng.gate.forced_fire_rate = RATE
    reach = eng.gate.reach
    sp = SamplingParams(temperature=0.0, max_tokens=TINY_NEW, ignore_eos=True, logprobs=0)
    for attempt in range(2):     # the second time the prefix cache (when on) serves the prompts
        done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            def fires(q, rid=str(i)):
                return forced_draw(_Req(rid), q + 1) < RATE
            want_ids, want_lps, want_dists = reference_gate(eng.model, p, reach, TINY_NEW, fires, eng.gate.fp4_prefill)
            out = done[str(i)].outputs[0]
            assert out.token_ids == want_ids, (case, i, attempt)
            got = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]
            assert max(abs(a - b) for a, b in zip(got, want_lps)) < 2e-5
            if attempt == 0 and i == 0:      # the reference can tell a wrong reach apart
                other = reference_gate(eng.model, p, 0 if reach else 8, TINY_NEW, fires, eng.gate.fp4_prefill)
                assert other[0] != want_ids or float((other[2] - want_dists).abs().max()) > 1e-2
    c = eng.gate.counters
    assert 0 < c.fires < c.rows_checked and c.repaired == c.fires
    eng.block_manager.check([])
    extra = eng.stats().extra
    assert extra["fp4_gate_fires"] == c.fires and extra["fp4_gate_recomputed_rows"] == c.recomputed_rows > 0


@pytest.mark.parametrize("case", ["reach32", "reach5-chunked", "w2-prompt-reach3"])
def test_widened_repairs_equal_reference(tiny, case, monkeypatch):
    """Repair passes widened to fixed rows per sequence (as a captured repair graph takes them,
    ModelRunner.repair_graph_width; here run eagerly on the CPU): the added leading rows write no
    KV and the tokens and logprobs are the reference's, as unwidened."""
    from moet.engine.model_runner import repair_widths

    path, prompts = tiny
    eng = engine(path, **GATED[case])
    eng.gate.forced_fire_rate = RATE
    widths = repair_widths(eng.gate.reach)
    monkeypatch.setattr(eng.runner, "repair_graph_width",
                        lambda rows, n: next(w for w in widths if w >= rows) if n <= 3 else None)
    writes = []
    real_build = AttentionBatch.build

    def build(**kw):                   # the repair batches' KV writes, per sequence
        b = real_build(**kw)
        if kw.get("read_only_rows") is not None:
            writes.append((kw["read_only_rows"], kw["query_lens"], b.slot_mapping.tolist(), b.cu_seqlens_q_host))
        return b
    monkeypatch.setattr(AttentionBatch, "build", staticmethod(build))
    reach = eng.gate.reach
    sp = SamplingParams(temperature=0.0, max_tokens=TINY_NEW, ignore_eos=True, logprobs=0)
    done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        def fires(q, rid=str(i)):
            return forced_draw(_Req(rid), q + 1) < RATE
        want_ids, want_lps, _ = reference_gate(eng.model, p, reach, TINY_NEW, fires, eng.gate.fp4_prefill)
        out = done[str(i)].outputs[0]
        assert out.token_ids == want_ids, (case, i)
        got = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want_lps)) < 2e-5
    c = eng.gate.counters
    assert c.read_only_rows > 0 and c.repaired == c.fires > 0
    widened = [w for w in writes if any(w[0])]
    assert widened
    for read_only, qs, slots, cu in widened:
        assert len(set(qs)) == 1 and qs[0] in widths           # one captured width per pass
        for r, start in zip(read_only, cu):
            assert all(x == -1 for x in slots[start:start + r]) and slots[start + r] >= 0


def test_repair_widths():
    from moet.engine.model_runner import repair_widths

    assert repair_widths(32) == [1, 2, 4, 8, 16, 33]
    assert repair_widths(0) == [1]
    assert repair_widths(5) == [1, 2, 4, 6]
    assert repair_widths(3) == [1, 2, 4]
    # no width past the longest sequence a replay may serve (--max-model-len, or DSA's top-k)
    assert repair_widths(32, 13) == [1, 2, 4, 8] and repair_widths(32, 33) == [1, 2, 4, 8, 16, 33]


def test_confidence_gate_repairs_moet_tiny_arithmetic(tiny):
    """The default engine (W2 + gate) answers 345 + 278 right where bare W2 does not."""
    path, prompts = tiny
    sp = SamplingParams(temperature=0.0, max_tokens=120)
    answer = lambda eng: eng.tokenizer.decode(run(eng, prompts[:1], sp)[0]).split("</think>")[-1]  # noqa: E731
    assert "623" not in answer(engine(path, fp4_gate=False))
    eng = engine(path)
    assert eng.gate is not None and "623" in answer(eng)
    assert 0 < eng.gate.counters.fires < eng.gate.counters.rows_checked


def test_tau0_is_bare_w2_and_batching_does_not_change_tokens(path):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    bare = run(engine(path, fp4_gate=False), PROMPTS, sp)
    never = engine(path, gate_tau=0.0, gate_refresh=0, fp4_prefill=False)
    assert run(never, PROMPTS, sp) == bare and never.gate.counters.fires == 0
    gated = engine(path, gate_tau=0.5)
    together = run(gated, PROMPTS, sp)
    assert gated.gate.counters.fires > 0                # random tiny weights are unsure often
    alone = [run(engine(path, gate_tau=0.5), [p], sp)[0] for p in PROMPTS]
    assert together == alone
    assert together != bare


def test_gate_off_where_it_does_not_apply(path):
    assert engine(path, fp4_gate=False).gate is None
    assert engine(path, fp4_pool_gb="0").gate is None
    eng = engine(path, expert_format="fp4")              # nothing to repair
    assert eng.gate is None and not eng.model.has_repair_tier()


def test_shared_blocks_are_never_rewritten():
    bm = BlockManager(16, 4)
    sp = SamplingParams(max_tokens=4)
    a = Sequence(0, "a", 0, list(range(10)), sp, 4)
    bm.allocate(a, 10)
    b = Sequence(1, "b", 0, list(range(10)), sp, 4)
    bm.allocate_prefix(b, a.block_table[:2])             # b shares a's two full blocks
    bm.allocate(b, 10)
    gate = ConfidenceGate(runner=None, block_manager=bm, tau=1.0, reach=32)
    assert gate._writable_from(b, 0, 9) == 8            # past the shared blocks
    assert gate._writable_from(b, 0, 7) is None         # the fired position itself is shared
    assert gate._writable_from(a, 0, 9) == 8
    b.num_computed_tokens = 10
    bm.free_seq(b)
    assert gate._writable_from(a, 2, 9) == 2            # a holds them alone again


def test_rewritten_blocks_leave_the_prefix_index():
    bm = BlockManager(8, 4)
    s = Sequence(0, "a", 0, list(range(9)), SamplingParams(max_tokens=4), 4)
    bm.allocate(s, 9)
    s.num_computed_tokens = 9
    bm.commit_full_blocks(s)
    assert len(bm.hash_to_block) == 2
    assert bm.unregister_rewritten(s, 5, 8) == 1         # block 1 (positions 4..7) was registered
    assert list(bm.hash_to_block.values()) == [s.block_table[0]]
    bm.check([s])


def test_forced_draw_is_fixed_and_uniform():
    seq = Sequence(0, "req-1", 0, [1, 2], SamplingParams(), 4)
    draws = [forced_draw(seq, p) for p in range(4000)]
    assert draws == [forced_draw(seq, p) for p in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert abs(sum(d < 0.3 for d in draws) / len(draws) - 0.3) < 0.03


@pytest.mark.parametrize("kw, flag", [
    (dict(gate_tau=1.5), "--gate-tau"),
    (dict(gate_tau=-0.1), "--gate-tau"),
    (dict(gate_reach=-1), "--gate-reach"),
    (dict(fp4_pool_gb="lots"), "--fp4-pool-gb"),
])
def test_bad_settings_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(model="x", **kw)


def test_pool_too_small_is_refused_before_loading(path, monkeypatch):
    import moet.model
    monkeypatch.setattr(moet.model, "load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError, match="--fp4-pool-gb 0.000001 holds 0 FP4 experts per MoE layer"):
        engine(path, fp4_pool_gb="0.000001")


def test_refresh_fires_every_n_generated_positions(path):
    """--gate-refresh 4 with tau 0: a sequence's KV is FP4's after its prompt, then every 4th
    generated position fires and recomputes exactly the 4 W2 positions since."""
    eng = engine(path, gate_tau=0.0, gate_refresh=4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run(eng, PROMPTS, sp)
    c = eng.gate.counters
    # rows checked: positions P .. P + 10 (the first token comes from the FP4 prompt)
    assert c.rows_checked == 11 * len(PROMPTS)
    assert c.fires == c.repaired == 2 * len(PROMPTS) and c.recomputed_rows == 8 * len(PROMPTS)
    with pytest.raises(ConfigError, match="--gate-refresh"):
        EngineConfig(model="x", gate_refresh=-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
def test_repair_passes_replay_captured_graphs(tiny):
    """On CUDA the gate's repair passes replay graphs captured under the FP4 tier, widened to a
    captured width; the greedy tokens equal eager repairs' and logprobs agree to rounding."""
    path, prompts = tiny
    kw = dict(device="cuda", max_num_seqs=4, max_model_len=512, kv_cache_memory_gb=0.05)
    graphs, eager = engine(path, **kw), engine(path, enforce_eager=True, **kw)
    assert sorted(graphs.runner.repair_graphs) == [1, 2, 4, 8, 16, 33] and not eager.runner.repair_graphs
    for eng in (graphs, eager):
        eng.gate.forced_fire_rate = RATE
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    got, want = (eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)]) for eng in (graphs, eager))
    for i in range(len(prompts)):
        a, b = got[str(i)].outputs[0], want[str(i)].outputs[0]
        assert a.token_ids == b.token_ids, i
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 1e-2
    c = graphs.gate.counters
    assert c.graph_passes > 0 and c.read_only_rows > 0 and c.fires == eager.gate.counters.fires
    assert sum(gs.replays for gs in graphs.runner.repair_graphs.values()) == c.graph_passes
