"""What every model class shares about its MoE blocks (CausalLM, model/deepseek_v4.py's
DeepseekV4LM): the shared experts' side stream and the FP4 repair tier switch. A subclass says
which blocks it has (moe_blocks)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from moet.model.layers.moe import MoE


class MoEModel(nn.Module):
    def moe_blocks(self) -> dict[str, MoE]:
        """{module name: MoE block}: every subclass defines it (CausalLM, DeepseekV4LM)."""
        raise NotImplementedError(f"{type(self).__name__} must define moe_blocks")

    def overlap_shared_experts(self, device: torch.device) -> int:
        """Run every MoE block's shared experts on one second CUDA stream, next to the routed
        experts (ExpertSlots.shared_stream; one stream for all layers: the layers run one after another).
        No-op off CUDA. -> number of MoE blocks that overlap."""
        if device.type != "cuda":
            return 0
        blocks = [m for m in self.modules() if isinstance(m, MoE) and m.shared_experts is not None]
        stream = torch.cuda.Stream(device) if blocks else None
        for m in blocks:
            m.experts.shared_stream = stream
        return len(blocks)

    # ------------------------------------------------------------------ the FP4 repair tier

    def has_repair_tier(self) -> bool:
        """Every MoE block holds the FP4 repair tier (ExpertSlots.repair_slot_table)."""
        blocks = list(self.moe_blocks().values())
        return bool(blocks) and all(m.experts.repair_slot_table is not None for m in blocks)

    @contextlib.contextmanager
    def repair_tier(self, rows: torch.Tensor | None = None):
        """Forwards inside compute the routed experts with the FP4 repair tier (the confidence
        gate's repair pass, engine/confidence_gate.py): every row, or with `rows` (a bool mask over
        the pass's rows: a step's prompt positions) those rows only, the others with the primary
        tier. Eager only: a captured graph keeps the tier it was captured with."""
        blocks = list(self.moe_blocks().values())
        rep = pri = None
        if rows is not None:
            rep, pri = rows.nonzero().flatten(), (~rows).nonzero().flatten()
        for m in blocks:
            if rows is None:
                m.experts.repairing = True
            else:
                m.experts.repair_rows, m.experts.primary_rows = rep, pri
        try:
            yield
        finally:
            for m in blocks:
                m.experts.repairing = False
                m.experts.repair_rows = m.experts.primary_rows = None
