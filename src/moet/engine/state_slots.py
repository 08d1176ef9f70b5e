"""Which slot of the recurrent-state pools a running sequence uses (Qwen3.5's gated DeltaNet
layers keep one state per sequence, not per token: model/layers/gated_deltanet.py).

A sequence gets a slot the first step it is scheduled and keeps it while it holds KV blocks; a
slot whose sequence has released its blocks (finished, aborted, preempted for recompute) is free
again, and that sequence gets a new one when it is scheduled again (its recompute starts from
token 0, so from a zero state). The pools have one slot per sequence a step may hold
(max_num_seqs), so a scheduled sequence always finds one.
"""
from __future__ import annotations

from moet.engine.sequence import Sequence


class StateSlots:
    def __init__(self, size: int):
        self.size = size
        self._holder: list[Sequence | None] = [None] * size

    def slot_for(self, seq: Sequence) -> int:
        s = seq.state_slot
        if 0 <= s < self.size and self._holder[s] is seq:
            return s
        for i, held in enumerate(self._holder):
            if held is None or not held.block_table:          # free, or its sequence let go of its blocks
                if held is not None:
                    held.state_slot = -1
                self._holder[i] = seq
                seq.state_slot = i
                return i
        raise RuntimeError(f"all {self.size} recurrent-state slots are held by running sequences: the scheduler "
                           "ran more sequences than max_num_seqs")
