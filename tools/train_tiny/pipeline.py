"""The stages of one training run, in order; each logs what it did and how long it took."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from moet.probe import chat_format
from tools.train_tiny import corpus as corpus_mod
from tools.train_tiny import data, export, tokenizer_build
from tools.train_tiny.model import TinyDeepseekV3, calibrate, count_params, rope_tables
from tools.train_tiny.recipe import Recipe
from tools.train_tiny.train import compile_layers, train

SHARD_BYTES = 15 * 2**20
CKPT_NAME = "moet-tiny"


def _tokenizer_sample(c: corpus_mod.Corpus, r: Recipe) -> list[str]:
    """BPE training text: ~70% code, ~10% prose, ~20% rendered chat (so that chat markup,
    JSON schemas and scratchpads get merges too)."""
    out, size = [], 0
    for t in c.code:
        if size >= 0.7 * r.tokenizer_sample_bytes:
            break
        out.append(t)
        size += len(t)
    for t in c.text:
        if size >= 0.8 * r.tokenizer_sample_bytes:
            break
        out.append(t)
        size += len(t)
    rng = random.Random(r.seed)
    tasks = [data.CHAT_TASKS[k] for k, _ in r.mix.task_share]
    while size < r.tokenizer_sample_bytes:
        t = chat_format.render_conversation(tasks[len(out) % len(tasks)](rng))
        out.append(t)
        size += len(t)
    return out


def _uncompile(model: TinyDeepseekV3) -> None:
    for layer in model.model.layers:
        layer._compiled_call_impl = None


def _pack(ckpt: Path, dest: Path, part_bytes: int = 15 * 2**20) -> list[str]:
    """The device tool returns at most 8 files of <= 16 MiB: ship the checkpoint as one tar
    split into parts (cat ckpt.tar.part-* | tar x)."""
    import io
    import tarfile
    dest.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for f in sorted(ckpt.iterdir()):
            tf.add(f, arcname=f"{ckpt.name}/{f.name}")
    data = buf.getvalue()
    names = []
    for i in range(0, len(data), part_bytes):
        name = f"ckpt.tar.part-{i // part_bytes:02d}"
        (dest / name).write_bytes(data[i:i + part_bytes])
        names.append(name)
    return names


def _write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def run(r: Recipe, out: Path, *, device: str | None, workers: int, bench: bool, log, env: dict,
        pack: Path | None = None, deadline_s: float | None = None) -> int:
    t_start = time.time()
    timings: dict[str, float] = {}
    # torch.cuda.is_available() does not create a CUDA context, so forking the data workers
    # later stays safe; the device name is read after the data stage.
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    import transformers
    env.update(torch=torch.__version__, transformers=transformers.__version__, device=str(dev), workers=workers)
    log({"stage": "start", "recipe": r.as_dict(), "env": env, "params": count_params(r.shape)})
    torch.manual_seed(r.seed)
    ckpt = out / CKPT_NAME

    # 1. corpus
    t = time.time()
    c = corpus_mod.build(r.seed, r.code_bytes, r.text_bytes, workers=min(32, 2 * workers))
    timings["corpus_s"] = round(time.time() - t, 1)
    corpus_stats = {"code_files": c.code_files, "code_bytes": c.code_bytes, "text_files": c.text_files,
                    "text_bytes": c.text_bytes}
    log({"stage": "corpus", **corpus_stats, "seconds": timings["corpus_s"]})

    # 2. tokenizer
    t = time.time()
    tok = tokenizer_build.train(_tokenizer_sample(c, r), r.shape.vocab_size)
    tokenizer_build.save(tok, ckpt, r.shape.max_position_embeddings)
    ids = {n: tok.token_to_id(n) for n in (chat_format.BOS, chat_format.EOS, chat_format.PAD)}
    timings["tokenizer_s"] = round(time.time() - t, 1)
    log({"stage": "tokenizer", "vocab": tok.get_vocab_size(), "special_ids": ids, "seconds": timings["tokenizer_s"]})

    # 3. rows
    t = time.time()
    n_rows = r.steps * r.batch_rows
    rows_np, data_stats = data.build_rows(tokenizer=tok, code=c.code, text=c.text, n_rows=n_rows, mix=r.mix,
                                          seed=r.seed, workers=workers, log=lambda m: log({"stage": "data", "msg": m}))
    del c
    timings["data_s"] = round(time.time() - t, 1)
    log({"stage": "data", "seconds": timings["data_s"]})

    env["device_name"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    # 4. model + self-check against transformers (initial weights, CPU, fp32)
    t = time.time()
    model = TinyDeepseekV3(r.shape)
    model.init_weights(r.seed)
    from tools.train_tiny.selfcheck import max_logit_diff
    probe_ids = torch.from_numpy(rows_np[:1, :66].astype(np.int64))
    diff = max_logit_diff(model, probe_ids)
    log({"stage": "selfcheck", "max_logit_diff_main": diff[0], "max_logit_diff_mtp": diff[1],
         "seconds": round(time.time() - t, 1)})
    if max(diff) > 1e-3:
        raise SystemExit(f"training forward disagrees with transformers (max logit diff {diff}); not training")
    model.to(dev)
    rows = torch.from_numpy(rows_np.astype(np.int32)).to(dev)
    del rows_np

    # 5. train
    t = time.time()
    if bench and dev.type == "cuda":
        _bench(model, rows, r, dev, log)
    if r.compile == "layers" and dev.type == "cuda":
        compile_layers(model)
    history, _ = train(model, rows, r, dev, log)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    timings["train_s"] = round(time.time() - t, 1)
    log({"stage": "train", "seconds": timings["train_s"], "steps": r.steps,
         "tokens": r.steps * r.batch_rows * rows.shape[1],
         "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1) if dev.type == "cuda" else None})

    # 6. calibrate + export
    t = time.time()
    _uncompile(model)
    cos, sin = rope_tables(r.shape, rows.shape[1] - 1, dev)
    calib_batches = [rows[-(i + 1) * 4:rows.shape[0] - i * 4].long() for i in range(2)]
    amax = calibrate(model, calib_batches, cos, sin)
    bias = {f"layer{i}": [round(x, 3) for x in m.e_score_correction_bias.tolist()]
            for i, m in enumerate(model.moe_routers())}
    del rows
    bf16 = export.bf16_state_dict(model)
    q = export.nvfp4_state_dict(bf16, amax)
    qc, hq = export.quant_configs(q)
    config = export.hf_config(r.shape, ids[chat_format.BOS], ids[chat_format.EOS], ids[chat_format.PAD])
    config["quantization_config"] = qc
    gen_cfg = {"bos_token_id": ids[chat_format.BOS], "eos_token_id": [ids[chat_format.EOS]],
               "pad_token_id": ids[chat_format.PAD], "do_sample": False, "max_new_tokens": 256}
    export.write(ckpt, q, config, shard_bytes=SHARD_BYTES, generation_config=gen_cfg, hf_quant_config=hq)
    timings["export_s"] = round(time.time() - t, 1)
    sizes = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())}
    timings["to_checkpoint_s"] = round(time.time() - t_start, 1)
    log({"stage": "export", "files": sizes, "total_bytes": sum(sizes.values()), "seconds": timings["export_s"],
         "wall_to_checkpoint_s": timings["to_checkpoint_s"]})
    del model
    summary = {"recipe": r.as_dict(), "env": env, "params": count_params(r.shape), "corpus": corpus_stats,
               "data": data_stats, "timings": timings, "history": history, "router_bias": bias,
               "selfcheck_max_logit_diff": diff, "files": sizes, "probes": {}}
    _write_summary(out, summary)
    if pack is not None:
        log({"stage": "pack", "parts": _pack(ckpt, pack)})

    # 7. probes
    t = time.time()
    from transformers import AutoTokenizer

    from moet.probe.loader import Loaded, build, hf_config, load, read_tensors
    from moet.probe.run import run_all
    probes = summary["probes"]
    tensors = read_tensors(ckpt)
    stop = (lambda: time.time() - t_start > deadline_s) if deadline_s else None
    for fmt in ("bf16", "nvfp4", "w2"):
        if fmt == "bf16":  # the trained weights before NVFP4 (not shipped: 4x the expert bytes)
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            hfm, mtp = build(hf_config(ckpt), bf16, "bf16", dev, dtype)
            m = Loaded(hfm, mtp, AutoTokenizer.from_pretrained(str(ckpt)), "bf16", dev, dtype)
        else:
            m = load(ckpt, fmt, dev, tensors=tensors)
        probes[fmt] = {}
        for name in r.probe_order:  # one at a time, in the recipe's order; saved after each
            probes[fmt] |= run_all(m, r.probe_budget, only=(name,), log=log, should_stop=stop)
            _write_summary(out, summary)
        del m
    timings["probes_s"] = round(time.time() - t, 1)
    timings["total_s"] = round(time.time() - t_start, 1)
    _write_summary(out, summary)
    from tools.train_tiny.card import write_card
    write_card(ckpt / "MODEL_CARD.md", summary)
    log({"stage": "done", **timings})
    return 0


def _bench(model: TinyDeepseekV3, rows, r: Recipe, dev, log, steps: int = 8) -> None:
    """Throughput of eager vs regional-compiled steps (copies of the model; the real run
    starts from the untouched initial weights)."""
    import copy
    for mode in ("none", "layers"):
        m = copy.deepcopy(model)
        if mode == "layers":
            compile_layers(m)
        t = time.time()
        train(m, rows, r, dev, lambda rec: None, steps=2)  # warm-up / compile
        torch.cuda.synchronize()
        warm = time.time() - t
        t = time.time()
        train(m, rows, r, dev, lambda rec: None, steps=steps, start_step=2)
        torch.cuda.synchronize()
        per = (time.time() - t) / steps
        log({"stage": "bench", "compile": mode, "warmup_s": round(warm, 1), "step_s": round(per, 4),
             "tok_per_s": round(r.batch_rows * rows.shape[1] / per),
             "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)})
        del m
        torch.cuda.empty_cache()
