"""The optimisation loop: AdamW, linear warm-up then cosine to min_lr, bf16 autocast, grad
clipping, the aux-loss-free router-bias update after every step. All rows live on the GPU
(a few hundred MB), so there is no loader; the loop syncs with the host only to log.
"""
from __future__ import annotations

import math
import time

import torch

from tools.train_tiny.model import TinyDeepseekV3, loss_fn, rope_tables, update_bias
from tools.train_tiny.recipe import Recipe


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    p = (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def optimizer(model: TinyDeepseekV3, r: Recipe, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms
    groups = [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=r.lr, betas=r.betas, fused=device.type == "cuda")


def compile_layers(model: TinyDeepseekV3) -> None:
    """Regional compilation: one graph per layer kind (dense, MoE, MTP) instead of one for the
    whole model, so compile time stays small; fuses the many small elementwise ops."""
    for layer in model.model.layers:
        layer.compile()


def train(model: TinyDeepseekV3, rows: torch.Tensor, r: Recipe, device: torch.device, log,
          steps: int | None = None, start_step: int = 0, opt=None) -> tuple[list[dict], torch.optim.Optimizer]:
    """rows: int32 [n_rows, seq_len + 2] on `device`. Returns (log records, optimizer)."""
    steps = r.steps if steps is None else steps
    t_len = rows.shape[1] - 2
    cos, sin = rope_tables(model.s, t_len + 1, device)
    opt = opt or optimizer(model, r, device)
    model.train()
    history, t0, tokens_since, t_last = [], time.time(), 0, time.time()
    acc, n_acc = None, 0
    for step in range(start_step, start_step + steps):
        lr = lr_at(step, r)
        for g in opt.param_groups:
            g["lr"] = lr
        lo = (step * r.batch_rows) % rows.shape[0]
        batch = rows[lo:lo + r.batch_rows].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, main, mtp = loss_fn(model, batch, cos, sin, r.mtp_weight, ignore_index=-100)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance = update_bias(model, r.bias_update_rate)
        stats = torch.stack([main, mtp, gnorm.float(), balance.float()])
        acc = stats if acc is None else acc + stats
        n_acc += 1
        tokens_since += batch.numel()
        if (step + 1) % r.log_every == 0 or step + 1 == start_step + steps:
            vals = (acc / n_acc).tolist()  # the only host sync
            now = time.time()
            rec = {"step": step + 1, "loss": round(vals[0], 4), "mtp_loss": round(vals[1], 4),
                   "grad_norm": round(vals[2], 3), "max_load_ratio": round(vals[3], 3), "lr": lr,
                   "tok_per_s": round(tokens_since / (now - t_last)), "elapsed_s": round(now - t0, 1)}
            history.append(rec)
            log(rec)
            acc, n_acc, tokens_since, t_last = None, 0, 0, now
    return history, opt
