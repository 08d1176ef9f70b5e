"""`--peer transformers`: transformers' generate() on the same shape (random BF16 init on the
device) or the same checkpoint's weights, in the same run, after moet's engine has given its
memory back; the peer ratio is moet's tok/s over the peer's at the same batch / prompt length.

decode tok/s: (B x (n - 1)) / (time of an n-token generate - time of a 1-token one), the
prefill and first token cancelling. prefill: the seconds of a 1-token generate of a T-token
prompt. A shape whose BF16 weights do not fit the GPU runs cut to fewer decoder layers, at two
depths; its times are extrapolated linearly in the layer count to the full depth (what a layer
costs is what the two depths differ by), and its rows say so."""
from __future__ import annotations

import gc
import time

import torch

from moet.bench.target import Settings, sync

# moet's expert_format -> the weights transformers gets for the shipped NVFP4 checkpoint
# (moet.probe.loader): "nvfp4" is exactly what moet's fp4 and bf16 formats compute with
HF_EXPERTS = {"w2": "w2", "fp4": "nvfp4", "bf16": "nvfp4"}


def gen_s(model, ids, k: int, device) -> float:
    """Seconds of one generate() of exactly k new tokens."""
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False)
    sync(device)
    return time.perf_counter() - t0


def _quiet(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _hf_config(cfg: dict, layers: int | None = None):
    import transformers as tf

    from moet.bench.shapes import first_layers
    if layers is not None:
        cfg = first_layers(cfg, layers)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return tf.AutoConfig.for_model(cfg["model_type"], **kw)


class Peer:
    """One or two transformers models (two: the cut depths) and how to scale their times."""

    def __init__(self, label: str, builds: list, full_layers: int | None, device: torch.device):
        self.label, self.builds, self.full_layers, self.device = label, builds, full_layers, device

    @property
    def extrapolated(self) -> bool:
        return len(self.builds) == 2

    def _time(self, measure) -> float:
        """measure(model) at each depth; at two depths, linear in the layer count to the full one."""
        if not self.extrapolated:
            return measure(self.builds[0][1]())
        (l1, make1), (l2, make2) = self.builds
        t1, t2 = measure(make1()), measure(make2())
        return t1 + (self.full_layers - l1) * (t1 - t2) / (l1 - l2)

    def decode_tok_s(self, batch: int, prompt_len: int, vocab: int, n: int, repeats: int) -> float:
        ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(7)).to(self.device)

        def measure(model):
            gen_s(model, ids, 2, self.device)                                  # warm-up
            return (min(gen_s(model, ids, n, self.device) for _ in range(repeats))
                    - min(gen_s(model, ids, 1, self.device) for _ in range(repeats)))
        return batch * (n - 1) / self._time(measure)

    def prefill_s(self, tokens: int, vocab: int) -> float:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(8)).to(self.device)

        def measure(model):
            gen_s(model, ids[:, :64], 1, self.device)                          # warm-up
            return gen_s(model, ids, 1, self.device)
        return self._time(measure)

    def greedy(self, prompt: list[int], n: int) -> list[int] | None:
        if self.extrapolated:
            return None
        model = self.builds[0][1]()
        x = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
        return out[0, x.shape[1]:].tolist()


def open_peer(s: Settings, cfg: dict, expert_format: str, checkpoint: str | None, dtype: torch.dtype) -> Peer:
    import transformers as tf

    device = s.device
    label = f"transformers {tf.__version__} generate()"
    if checkpoint is not None:
        if cfg.get("model_type") == "deepseek_v3" and "quantization_config" in cfg:
            from moet.probe.loader import load     # NVFP4 experts decoded as moet decodes them
            model = _quiet(load(checkpoint, experts=HF_EXPERTS[expert_format], device=device, dtype=dtype).model)
            label += f", {HF_EXPERTS[expert_format]} experts"
        else:
            model = _quiet(tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device))
        return Peer(label, [(None, lambda: model)], None, device)

    layers = int(cfg["num_hidden_layers"])
    with torch.device("meta"):
        meta = tf.AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=torch.bfloat16)
    total = sum(p.numel() * 2 for p in meta.parameters())
    per_layer = sum(p.numel() * 2 for p in meta.model.layers[-1].parameters())
    del meta
    held: dict = {}

    def make(n_layers: int | None):
        def build():
            if "model" not in held or held["layers"] != n_layers:
                held.clear()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                with torch.device(device):
                    held["model"] = _quiet(tf.AutoModelForCausalLM.from_config(_hf_config(cfg, n_layers),
                                                                               dtype=torch.bfloat16))
                held["layers"] = n_layers
            return held["model"]
        return build

    room = None
    if device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0] * 0.85 - 4 * 2**30     # activations, KV, the allocator
    if room is None or total <= room:
        return Peer(label + ", BF16", [(layers, make(None))], None, device)
    fit = int((room - (total - layers * per_layer)) // per_layer)
    if fit < 2:
        raise RuntimeError(f"BF16 {total / 2**30:.0f} GiB; not even two decoder layers fit the free memory")
    cut = min(fit, layers - 1)
    return Peer(label + f", BF16, extrapolated from {cut} and {cut // 2} of {layers} layers",
                [(cut, make(cut)), (cut // 2, make(cut // 2))], layers, device)


def run_peer(s: Settings, cfg: dict, expert_format: str, checkpoint: str | None, dtype: torch.dtype,
             label: str) -> None:
    """The peer's decode rows (each --batch) and prefill rows (each --tokens) for the scenarios in
    this run, and the peer ratio on moet's rows of the same batch / length."""
    report = s.report
    try:
        peer = open_peer(s, cfg, expert_format, checkpoint, dtype)
    except Exception as exc:           # moet's numbers stand without the peer; the report says why
        report.note("peer", "error", f"{type(exc).__name__}: {exc}")
        print(f"[peer] not run: {type(exc).__name__}: {exc}", flush=True)
        return
    repeats = 1 if s.device.type == "cuda" else 2
    n = max(3, min(s.decode_tokens, 32))
    vocab = int(cfg["vocab_size"])
    if "decode" in s.scenarios:
        for b in s.batches:
            if not s.budget.ok(45):
                report.note("peer", f"skipped decode batch {b}", "time budget (--budget-s) spent")
                continue
            try:
                tok_s = peer.decode_tok_s(b, s.prompt_len, vocab, n, repeats)
            except torch.cuda.OutOfMemoryError:
                report.note("peer", f"decode batch {b}", "out of GPU memory")
                break
            report.add({"scenario": "decode", "shape": label, "system": "transformers", "batch": b,
                        "config": f"{peer.label}, batch {b}, prompt {s.prompt_len}, new {n}", "tok_s": tok_s})
            _ratio(report, "decode", "batch", b, tok_s)
        if s.greedy and (ids := peer.greedy(s.greedy["prompt"], len(s.greedy["ids"]))) is not None:
            m = s.greedy["ids"]
            same = next((i for i, (a, c) in enumerate(zip(m, ids)) if a != c), min(len(m), len(ids)))
            report.note("peer", "same_greedy_prefix_tokens", f"{same}/{len(m)}")
    if "prefill" in s.scenarios:
        for t in s.tokens:
            if not s.budget.ok(45):
                report.note("peer", f"skipped prefill {t}", "time budget (--budget-s) spent")
                continue
            try:
                secs = peer.prefill_s(t, vocab)
            except torch.cuda.OutOfMemoryError:
                report.note("peer", f"prefill {t}", "out of GPU memory")
                break
            report.add({"scenario": "prefill", "shape": label, "system": "transformers", "tokens": t,
                        "config": f"{peer.label}, prompt {t}", "tok_s": t / secs, "notes": f"TTFT {secs * 1e3:.0f} ms"})
            _ratio(report, "prefill", "tokens", t, t / secs)
    del peer
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()


def _ratio(report, scenario: str, key: str, value: int, peer_tok_s: float) -> None:
    for r in report.rows:
        if r["scenario"] == scenario and r["system"] == "moet" and r.get(key) == value and r.get("tok_s"):
            r["peer_ratio"] = r["tok_s"] / peer_tok_s
    report.save()
