"""A pack row that fails its checksum while serving (issue 34): it is re-converted from the
checkpoint and rewritten, the request that needed it goes on with exactly the fully resident
outputs, and the stats count it. When the row cannot be re-converted (the checkpoint is gone),
the step that needed it fails with one clear PackError, the engine says it is degraded
(health(), pack_unrepaired_rows) and becomes ok again once the row is repaired."""
import os

import pytest
import torch

from moet.engine.expert_residency import health_from_extra
from moet.errors import MoetError
from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.store.pack_file import PackFile, PackMeta
from moet.testing.tiny_checkpoint import cached_checkpoint

# every fetch reads the pack (no host arena), 8 device slots (2 layers x top_k 2 x 2 sequences)
# (fp4_gate off: these tests are about W2 pack rows; the gate with the store: test_gate_through_store.py)
KW = dict(expert_format="w2", dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=2,
          num_kv_blocks=64, block_size=4, expert_cache_slots=8, host_arena_gb=0, fp4_gate=False)
SP = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("qwen3_moe", "bf16", tokenizer=False, num_experts=40)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 3)]


@pytest.fixture(scope="module")
def resident(path, prompts):
    llm = LLM(path, **{k: v for k, v in KW.items() if k not in ("expert_cache_slots", "host_arena_gb")})
    assert llm.engine.residency is None
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, SP, use_tqdm=False)]


def _corrupt_layer(paths, stride, num_experts, layer):
    """Flip one byte in every row of `layer` on disk."""
    with open(paths.data, "r+b") as f:
        for e in range(num_experts):
            off = (layer * num_experts + e) * stride + 100 + e
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x20]))


def _good_rows(paths, layer) -> int:
    with PackFile(paths, PackMeta.read(paths.sidecar)) as pf:
        return sum(pf.row_ok(layer, e) for e in range(pf.num_experts))


def _build(path, tmp_path):
    with LLM(path, pack_dir=str(tmp_path), **KW) as llm:
        p = llm.engine.residency.pack
        return p.paths, p.stride, p.num_experts


def test_damaged_rows_repaired_while_serving(path, prompts, resident, tmp_path):
    paths, stride, n = _build(path, tmp_path)
    assert not os.path.exists(paths.hot_set)       # (no arena: nothing warmed at start, the requests meet the damage)
    with LLM(path, pack_dir=str(tmp_path), **KW) as llm:
        assert llm.engine.stats().extra["pack_built_layers"] == 0
        _corrupt_layer(paths, stride, n, 1)        # while it serves: the next reads from disk find it
        got = llm.generate(prompts, SP, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in got] == resident
        st = llm.engine.stats().extra
        assert st["pack_corrupt_rows"] > 0 and st["pack_repaired_rows"] == st["pack_corrupt_rows"]
        assert st["pack_unrepaired_rows"] == 0 and st["pack_degraded"] == 0
        assert llm.engine.health() == ("ok", "") and health_from_extra(st) == ("ok", "")
        repaired = int(st["pack_repaired_rows"])
    assert _good_rows(paths, 1) == repaired and _good_rows(paths, 0) == n   # rewritten on disk, no other row


def _run(llm, prompts):
    """Outputs, or the error the failed step gave its requests (raised or carried, per engine)."""
    try:
        outs = llm.generate(prompts, SP, use_tqdm=False)
    except MoetError as exc:
        return None, exc
    errors = [o.error for o in outs if getattr(o, "error", None) is not None]
    return outs, (errors[0] if errors else None)


def test_unrepairable_row_degrades_until_repaired(path, prompts, resident, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(path, ckpt)
    paths, stride, n = _build(ckpt, tmp_path / "packs")
    weights = os.path.join(ckpt, "model.safetensors")
    with LLM(ckpt, pack_dir=str(tmp_path / "packs"), **KW) as llm:
        res = llm.engine.residency
        _corrupt_layer(paths, stride, n, 1)
        os.rename(weights, weights + ".away")      # the checkpoint cannot be read any more
        outs, err = _run(llm, prompts)
        assert err is not None
        msg = str(err)
        assert "\n" not in msg and "could not be re-converted from the checkpoint" in msg and paths.data in msg
        status, reason = llm.engine.health()
        assert status == "degraded" and paths.data in reason and "--pack-verify full" in reason
        st = llm.engine.stats().extra
        assert st["pack_unrepaired_rows"] >= 1 and st["pack_degraded"] == 1 and st["pack_repaired_rows"] == 0
        assert health_from_extra(st)[0] == "degraded"
        os.rename(weights + ".away", weights)      # back: the next step retries the damaged rows first
        res.repair_retry_s = 0.0
        outs, err = _run(llm, prompts)
        assert err is None
        assert [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs] == resident
        assert llm.engine.health() == ("ok", "")
        st = llm.engine.stats().extra
        assert st["pack_unrepaired_rows"] == 0 and st["pack_repaired_rows"] >= 1
