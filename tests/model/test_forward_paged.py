"""CausalLM.forward_paged (flat varlen batches over a paged KV cache) against the contiguous
single-sequence path CausalLM.forward, for every family's tiny checkpoint (float32, CPU: the torch
references): several sequences of different lengths in one batch, chunked prefill across page
boundaries, decode steps, a mixed step (decodes + a prefill chunk), random non-contiguous block
tables; fp8 caches within a stated tolerance; bit-identical reruns; MTP layers likewise."""
from __future__ import annotations

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.kernels.kv_cache import KVFormat
from moet.model import load_model
from moet.model.attention_batch import AttentionBatch
from moet.testing.tiny_checkpoint import FAMILIES, VOCAB, cached_checkpoint

BS = 4
NUM_BLOCKS = 48
F32 = KVFormat("auto", dtype=torch.float32)

# Per step, (sequence, new tokens); decodes (1 token) first, as the scheduler orders them.
# Prompts: seq 0 = 13 tokens in chunks 6 + 7 (both cross pages), seq 1 = 5 in one shot,
# seq 2 = 9 in chunks 4 (exactly one page) + 5; then decode steps. Step 1 and 2 are mixed.
SCHEDULE = [
    [(0, 6), (1, 5)],
    [(1, 1), (0, 7), (2, 4)],
    [(0, 1), (1, 1), (2, 5)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (0, 1), (1, 1)],
]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


_MODELS: dict[str, object] = {}


def _model(family: str):
    if family not in _MODELS:
        ckpt = open_checkpoint(cached_checkpoint(family))
        _MODELS[family] = load_model(ckpt, expert_format="bf16", dtype=torch.float32)
    return _MODELS[family]


def _random_tables(totals: list[int], g: torch.Generator) -> list[list[int]]:
    """Distinct pages per sequence in a random order (sequences interleave in memory)."""
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    out, at = [], 0
    for n in totals:
        k = -(-n // BS)
        out.append(perm[at:at + k])
        at += k
    return out


def _contiguous_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one sequence through the contiguous path, all at once."""
    with torch.no_grad():
        return model.forward(ids, 0, model.new_cache(ids.shape[0], "cpu"))


def _run_paged(model, seqs: list[torch.Tensor], tables: list[list[int]], fmt: KVFormat, schedule=SCHEDULE):
    """-> per step (batch, hidden [N, H], logits [N, V], rows as (sequence, position))."""
    kv = model.new_kv_cache(NUM_BLOCKS, BS, fmt, "cpu")
    done = [0] * len(seqs)
    steps = []
    for step in schedule:
        order = [b for b, _ in step]
        batch = AttentionBatch.build(block_tables=[tables[b] for b in order], context_lens=[done[b] for b in order],
                                     query_lens=[n for _, n in step], block_size=BS, device="cpu")
        ids = torch.cat([seqs[b][done[b]:done[b] + n] for b, n in step])
        rows = [(b, p) for b, n in step for p in range(done[b], done[b] + n)]
        with torch.no_grad():
            hidden = model.forward_paged(ids, batch, kv)
            logits = model.logits(hidden)
        steps.append((batch, ids, hidden, logits, rows))
        for b, n in step:
            done[b] += n
    return steps, kv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _setup(family: str, g: torch.Generator):
    model = _model(family)
    totals = [0, 0, 0]
    for step in SCHEDULE:
        for b, n in step:
            totals[b] += n
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in totals]
    return model, seqs, _random_tables(totals, g)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_paged_equals_contiguous_forward(family):
    g = _gen()
    model, seqs, tables = _setup(family, g)
    want = [_contiguous_logits(model, s) for s in seqs]
    steps, _ = _run_paged(model, seqs, tables, F32)
    assert [b.num_decode_seqs for b, *_ in steps] == [0, 1, 2, 3, 3]     # the schedule is what it says
    for batch, _, _, logits, rows in steps:
        ref = torch.stack([want[b][p] for b, p in rows])
        assert _rel(logits, ref) < 1e-5, (family, _rel(logits, ref))
        # logits_indices picks each sequence's last row of the step
        last = [i for i in range(len(rows)) if i + 1 == len(rows) or rows[i + 1][0] != rows[i][0]]
        assert batch.logits_indices.tolist() == last


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_same_batch_twice_is_bit_identical(family):
    """Re-running a step (same writes to the same slots, then the same reads) gives the same bits."""
    g = _gen()
    model, seqs, tables = _setup(family, g)
    steps, kv = _run_paged(model, seqs, tables, F32, SCHEDULE[:2])
    batch, ids, hidden, _, _ = steps[-1]
    with torch.no_grad():
        again = model.forward_paged(ids, batch, kv)
    assert torch.equal(hidden, again)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("fmt", [KVFormat("fp8_e4m3", "tensor", dtype=torch.float32),
                                 KVFormat("fp8_e4m3", "block", group=16, dtype=torch.float32)])
def test_fp8_kv_stays_close(family, fmt):
    g = _gen()
    model, seqs, tables = _setup(family, g)
    want = [_contiguous_logits(model, s) for s in seqs]
    steps, _ = _run_paged(model, seqs, tables, fmt)
    errs = []
    for _, _, _, logits, rows in steps:
        errs.append(_rel(logits, torch.stack([want[b][p] for b, p in rows])))
    # e4m3 keeps ~2**-4 relative per element of K/V; through 2-3 layers of a random tiny model the
    # logits move by a few 1e-2 (MLA's latent cache more: deepseek_v3 per-tensor over 25 seeds had
    # step medians <= 0.23, means <= 0.25, single steps <= 0.51), and a flipped top-k expert choice
    # can make one step jump (once in CI 0.71, the other four steps at 0.03-0.08); a dropped or
    # wrong scale gives O(1) at every step, which the median and the mean catch and one flipped
    # step cannot fake
    med = sorted(errs)[len(errs) // 2]
    assert med < 0.4 and sum(errs) / len(errs) < 0.4 and max(errs) < 1.5, errs
    assert min(errs) > 1e-6, errs               # and it really went through fp8


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_bytes_per_token_counts_every_attention_layer(family):
    model = _model(family)
    for fmt in (F32, KVFormat("fp8_e4m3", "block", group=16)):
        kv = model.new_kv_cache(3, BS, fmt, "cpu")
        assert len(kv) == len(model.model.layers) + len(model.mtp)
        stored = sum(sum(t.nbytes for t in (getattr(layer, f) for f in ("k", "v", "k_scale", "v_scale", "buffer")
                                             if hasattr(layer, f)) if t is not None and t.dim() > 1)
                     for layer in kv)
        # DSA index keys: one row per slot (the last row is the sink of slot -1, not a token's)
        stored += sum(t[:-1].nbytes for layer in kv if getattr(layer, "index_keys", None) is not None
                      for t in (layer.index_keys.data, layer.index_keys.scale) if t is not None)
        assert model.kv_bytes_per_token(fmt) == stored // (3 * BS)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"] + [f for f in FAMILIES if f in ("glm_moe_dsa", "deepseek_v32")])
def test_mtp_forward_paged_equals_contiguous(family):
    """The MTP block over its own paged cache, fed the main model's final-normed hidden states,
    equals mtp_forward over a contiguous cache (prompt in two chunks, then decodes)."""
    g = _gen()
    model, seqs, tables = _setup(family, g)
    schedule = SCHEDULE
    steps, kv = _run_paged(model, seqs, tables, F32, schedule)
    nxt = [torch.cat([s[1:], torch.randint(0, VOCAB, (1,), generator=g)]) for s in seqs]
    want = []
    with torch.no_grad():
        for s, n in zip(seqs, nxt):
            cache = model.new_cache(s.shape[0], "cpu")
            hidden = model.model.norm(model.hidden_states(s, 0, cache))
            want.append(model.mtp_forward(0, n, hidden, 0, cache)[1])
        for batch, _, hidden, _, rows in steps:
            next_ids = torch.stack([nxt[b][p] for b, p in rows])
            _, got = model.mtp_forward_paged(0, next_ids, model.model.norm(hidden), batch, kv)
            ref = torch.stack([want[b][p] for b, p in rows])
            assert _rel(got, ref) < 1e-5, _rel(got, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter form; on a GPU "
                    "tests/kernels/test_attention_cuda.py runs the model through the compiled kernels")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_forward_paged_through_the_triton_kernels(family, monkeypatch):
    """The CUDA dispatch (Triton KV write, decode, prefill/extend; mixed steps split into decode +
    prefill calls) run under TRITON_INTERPRET=1 on CPU: logits equal the contiguous path. Pages of
    16 (the kernels' minimum); prompts cross them."""
    pytest.importorskip("triton")
    from moet.kernels import attention_ops
    g = _gen()
    model = _model(family)
    schedule = [[(0, 18), (1, 5)], [(1, 1), (0, 15)], [(0, 1), (1, 1)]]
    totals = [34, 7]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in totals]
    perm = torch.randperm(8, generator=g).tolist()
    tables = [perm[:3], perm[3:4]]
    want = [_contiguous_logits(model, s) for s in seqs]
    monkeypatch.setattr(attention_ops, "_on_gpu", lambda t: True)

    def not_here(*args, **kwargs):
        raise AssertionError("a torch reference ran where the Triton kernel should")
    for name in ("paged_decode_gqa", "paged_prefill_gqa", "paged_decode_mla", "paged_prefill_mla"):
        monkeypatch.setattr(attention_ops.ref, name, not_here)
    for name in ("write_gqa_kv", "write_mla_kv"):
        monkeypatch.setattr(attention_ops.kv_cache, name, not_here)
    monkeypatch.setitem(globals(), "BS", 16)
    steps, _ = _run_paged(model, seqs, tables, F32, schedule)
    for _, _, _, logits, rows in steps:
        ref = torch.stack([want[b][p] for b, p in rows])
        assert _rel(logits, ref) < 1e-5, _rel(logits, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter form")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_nvfp4_kv_through_references_and_triton_kernels(family, monkeypatch):
    """An nvfp4 cache (GQA K/V, MLA latent + e4m3 rope) over a schedule with mixed steps: through
    the torch references the logits stay near the contiguous path (nvfp4's error, O(0.1) on these
    random tiny models; a dropped or wrong scale or nibble is O(1) at every step), and the same
    schedule through the Triton write, decode and prefill kernels (interpreted) gives the
    references' logits to fp32 rounding: the write stores the reference's bytes and the kernels
    decode them as read_*_kv does."""
    pytest.importorskip("triton")
    from moet.kernels import attention_ops
    g = _gen()
    model = _model(family)
    fmt = KVFormat("nvfp4", dtype=torch.float32)
    schedule = [[(0, 18), (1, 5)], [(1, 1), (0, 15)], [(0, 1), (1, 1)]]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (34, 7)]
    perm = torch.randperm(8, generator=g).tolist()
    tables = [perm[:3], perm[3:4]]
    want = [_contiguous_logits(model, s) for s in seqs]
    monkeypatch.setitem(globals(), "BS", 16)
    ref_steps, ref_kv = _run_paged(model, seqs, tables, fmt, schedule)
    errs = [_rel(logits, torch.stack([want[b][p] for b, p in rows])) for _, _, _, logits, rows in ref_steps]
    # over 12 seeds: qwen3_moe step means 0.10-0.15; deepseek_v3 (its latent is K and V at once)
    # 0.18-0.44, single steps up to 0.76
    assert sum(errs) / len(errs) < 0.75 and max(errs) < 1.5 and min(errs) > 1e-4, errs
    monkeypatch.setattr(attention_ops, "_on_gpu", lambda t: True)
    tri_steps, tri_kv = _run_paged(model, seqs, tables, fmt, schedule)
    for (_, _, _, a, _), (_, _, _, b, _) in zip(tri_steps, ref_steps):
        assert _rel(a, b) < 1e-5, _rel(a, b)
    for x, y in zip(tri_kv, ref_kv):
        parts = ("k", "v", "k_scale", "v_scale") if hasattr(x, "k") else ("buffer",)
        assert all(torch.equal(getattr(x, n).view(torch.uint8), getattr(y, n).view(torch.uint8)) for n in parts)
