"""Expert prefetch (store/prefetch.py): layer i+1's experts guessed from layer i's post-attention
residual (tiny qwen3_moe: dense, moe, moe). Logits with prefetch on equal fully resident bit for bit at 10% / 25% caches; the
cache's precision / recall equal an independent count (plain top-k of layer i+1's router
over the captured residual vs the experts layer i+1 really chose); a prefetch never evicts a row
the step pinned."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moet.model import load_model
from moet.store import ExpertCache, HostArena, attach_prefetch, run_with_replay


def _cached_model(ckpt, pack, slots):
    model = load_model(ckpt, expert_format="w2", dtype=torch.float32, routed_experts=False)
    cache = ExpertCache(pack, slots, "cpu", arena=HostArena(pack, 16, pin=False))
    cache.attach(model.moe_blocks())
    assert attach_prefetch(model, cache) == 2              # layers 0, 1 predict MoE layers 1, 2
    return model, cache


@pytest.mark.parametrize("fraction", [0.10, 0.25])
def test_prefetch_bit_identical_and_scored_like_an_independent_count(qwen40_pack, fraction):
    ckpt, ref, pack = qwen40_pack
    spec = ckpt.spec
    model, cache = _cached_model(ckpt, pack, int(pack.num_layers * pack.num_experts * fraction))
    # independent reference: the residual after layer 0's attention, captured from the resident model
    layers = ref.model.layers                              # dense, moe, moe: layers 0 and 1 predict 1 and 2
    residuals, routed = {}, {}
    hooks = []
    for i in (0, 1):
        hooks.append(layers[i].post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: residuals.__setitem__(i, a[0])))
        hooks.append(layers[i + 1].post_attention_layernorm.register_forward_hook(
            lambda m, a, out, i=i: routed.__setitem__(i, out)))
    g = torch.Generator().manual_seed(int(fraction * 1000))
    tp = npred = nreal = 0
    for _ in range(2):
        prompt = torch.randint(0, 256, (5,), generator=g)
        kv_ref, kv = ref.new_cache(64, "cpu"), model.new_cache(64, "cpu")
        chunks, start, last = [prompt[i:i + 2] for i in range(0, 5, 2)], 0, None
        for n in range(len(chunks) + 4):
            ids = chunks[n] if n < len(chunks) else last[-1:].argmax(-1)
            want = ref.forward(ids, start, kv_ref)
            got, res = run_with_replay(lambda: model.forward(ids, start, kv), cache, scan=n < len(chunks))
            assert torch.equal(got, want)
            res_i, routed_i = dict(residuals), dict(routed)   # the calls below refire the norms' hooks
            for i in (0, 1):
                # layer i+1's router on its norm of layer i's residual (the guess) vs on its real input
                nxt = layers[i + 1]
                w = nxt.mlp.gate.weight
                real = torch.topk(F.linear(routed_i[i], w), spec.router.top_k).indices
                guess = torch.topk(F.linear(nxt.post_attention_layernorm(res_i[i]), w), spec.router.top_k).indices
                p, r = set(guess.reshape(-1).tolist()), set(real.reshape(-1).tolist())
                tp, npred, nreal = tp + len(p & r), npred + len(p), nreal + len(r)
            last, start = want, start + ids.shape[0]
    for h in hooks:
        h.remove()
    st = cache.stats()
    assert st["expert_prefetch_predicted_total"] == npred
    assert st["expert_prefetch_precision"] == pytest.approx(tp / npred) and 0 < tp < npred
    assert st["expert_prefetch_recall"] == pytest.approx(tp / nreal)
    assert st["expert_prefetch_rows_total"] > 0
    assert 0 <= st["expert_prefetch_misses_saved_total"] <= st["expert_prefetch_rows_total"]


def test_prefetch_never_evicts_pinned_rows(qwen40_pack):
    ckpt, _, pack = qwen40_pack
    e = pack.num_experts
    _, cache = _cached_model(ckpt, pack, 8)
    cache.begin_pass()
    cache.fetch(np.arange(8))                        # this step needs layer 0's experts 0..7: pinned
    assert cache.prefetch(1, np.arange(4)) == 0      # no free slot, nothing evictable
    assert cache.resident()[0, :8].all()
    cache.end_step(np.zeros((pack.num_layers, e), dtype=np.int32))    # unpins; rows unused this step
    cache.end_step(np.zeros((pack.num_layers, e), dtype=np.int32))    # ... and the previous one
    cache.begin_pass()
    assert cache.prefetch(1, np.arange(4), running_layer=0) == 0      # the running layer's rows stay
    assert cache.prefetch(1, np.arange(4)) == 4                       # now they may go
    assert cache.resident()[1, :4].all() and cache.resident()[0].sum() == 4
    assert cache.stats()["expert_prefetch_rows_total"] == 4
