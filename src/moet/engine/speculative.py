"""MTP speculative decoding: the checkpoint's own multi-token-prediction layer drafts k tokens per
sequence after each step; the next step verifies them in one forward (EngineConfig.scheduler.
speculative_config, docs/architecture.md).

Drafting (`MTPDrafter.propose`, after a step's tokens are known). MTP layer 0 (DeepSeek-V3 / GLM-4.5
layout, CausalLM.mtp_forward_paged) runs on every position the step computed and kept: row p takes
the main model's final-normed hidden state at p and the token at p + 1, writes the MTP layer's own
KV at p and predicts the token at p + 2. Every kept position goes through it, prompts included,
so the MTP layer's KV is complete wherever the main model's is (the prefix cache can share it).
(One caveat, which costs drafts, never outputs: the MTP KV at a shared block's last position was
computed with the token that followed it in the sequence that wrote it.) The last row's argmax is
draft 1; drafts 2..k chain: one more row each, at the next position, fed
the previous row's MTP output and the previous draft (its KV there is overwritten once the true
token arrives). Drafts are argmaxes: deterministic, so a run repeats exactly.

Verification (LLMEngine._verify). The step's forward computes each drafting sequence's last token
and its drafts: k + 1 positions. Position by position, the request's own sampler (penalties,
temperature, top-k/p, its generator) picks a token from the target logits with the accepted drafts
already appended; the draft is kept while it equals that pick. The first pick that differs, or
the pick after the last draft, is the step's extra token. With a deterministic draft this is the
standard speculative rejection rule (accept d with probability p(d), else sample from p without
d), so every emitted token is the target's sample at its position: greedy outputs equal
non-speculative greedy outputs, and a seeded request draws the same numbers in the same order.
The confidence gate judges each verified position; a repaired position ends the verification
there (later rows were computed over its unrepaired KV).

KV. The verify forward writes K/V for every draft position; only positions up to the last kept
input count as computed (`num_computed_tokens`), so a rejected draft's slots are simply written
again by a later step, and only blocks below that are offered to the prefix cache. Preemption
drops the drafts (the sequence is recomputed and drafts again).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moet.model.attention_batch import AttentionBatch


@dataclass
class SpecCounters:
    """Totals since the engine started (EngineStats.extra, /metrics)."""
    verify_seq_steps: int = 0        # (sequence, step) pairs that verified at least one draft
    drafts: list[int] = field(default_factory=list)     # drafts verified at each draft position
    accepted: list[int] = field(default_factory=list)   # of them, kept
    emitted: int = 0                 # tokens the verifying (sequence, step) pairs produced

    def stats(self) -> dict[str, float]:
        d, a = sum(self.drafts), sum(self.accepted)
        out = {
            "spec_verify_seq_steps": float(self.verify_seq_steps),
            "spec_draft_tokens_total": float(d),
            "spec_accepted_tokens_total": float(a),
            "spec_acceptance_rate": a / d if d else 0.0,
            # tokens per verifying step of a sequence: kept drafts + the step's own token
            "spec_mean_tokens_per_step": self.emitted / self.verify_seq_steps if self.verify_seq_steps else 0.0,
        }
        for i, (n, k) in enumerate(zip(self.drafts, self.accepted)):
            out[f"spec_acceptance_rate_position_{i + 1}"] = k / n if n else 0.0
        return out


class MTPDrafter:
    def __init__(self, runner, block_manager, num_drafts: int, max_model_len: int):
        self.runner = runner
        self.model = runner.model
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # `moet bench decode --accept-all`: every draft is kept as if the target had picked it (random
        # weights accept none), to time the verify step at full acceptance. Never set when serving.
        self.accept_all = False
        self.set_drafts(num_drafts)

    def set_drafts(self, k: int) -> None:
        """Drafts per step from now on (a bench times several in one run); the counters start again."""
        self.k = int(k)
        self.counters = SpecCounters(drafts=[0] * self.k, accepted=[0] * self.k)
        if self.k:
            self.runner.ensure_verify_graphs(self.k + 1)

    def record(self, drafts: int, kept: int, emitted: int) -> None:
        """One sequence's verification: `drafts` drafts checked, the first `kept` of them kept."""
        c = self.counters
        c.verify_seq_steps += 1
        c.emitted += emitted
        for i in range(drafts):
            c.drafts[i] += 1
            c.accepted[i] += i < kept

    def _budget(self, seq) -> int:
        """Drafts the sequence may take: its next verify step stays within max_model_len and
        produces no more tokens than it may still emit."""
        return max(0, min(self.k, self.max_model_len - seq.num_tokens, seq.max_new_tokens - seq.num_output_tokens - 1))

    @torch.inference_mode()
    def propose(self, rows: list[tuple[object, int, int, int]], hidden: torch.Tensor) -> None:
        """rows: (sequence, first position, first hidden row, kept rows) for every sequence the step
        computed and kept positions for (finished ones left out): the MTP layer runs on them all;
        the sequences now decoding get their drafts (`Sequence.spec_token_ids`)."""
        for seq, *_ in rows:
            seq.spec_token_ids = []
        rows = [r for r in rows if r[3] > 0]
        if not rows:
            return
        dev = self.runner.device
        bs = self.block_manager.block_size
        q = self._uniform_width(rows, hidden)
        if q is not None:
            # the step's rows as they are, q per sequence: those past each one's kept positions
            # (rejected drafts) are padding, written nowhere, their outputs never read
            next_ids = torch.tensor([t for seq, p, _, m in rows for t in seq.token_ids[p + 1:p + m + 1] + [0] * (q - m)],
                                    dtype=torch.long, device=dev)
            batch = AttentionBatch.build(block_tables=[seq.block_table for seq, *_ in rows],
                                         context_lens=[p for _, p, _, _ in rows], query_lens=[q] * len(rows),
                                         block_size=bs, device=dev, pad_blocks_to=self.runner.table_width,
                                         padding_rows=[q - m for *_, m in rows])
            x, logits = self.runner.mtp_forward(next_ids, hidden, batch, from_main=True)
            last = torch.tensor([i * q + m - 1 for i, (*_, m) in enumerate(rows)], device=dev)
        else:
            idx = torch.cat([torch.arange(h, h + m) for _, _, h, m in rows]).to(dev)
            next_ids = torch.tensor([t for seq, p, _, m in rows for t in seq.token_ids[p + 1:p + m + 1]],
                                    dtype=torch.long, device=dev)
            batch = AttentionBatch.build(block_tables=[seq.block_table for seq, *_ in rows],
                                         context_lens=[p for _, p, _, _ in rows], query_lens=[m for *_, m in rows],
                                         block_size=bs, device=dev, pad_blocks_to=self.runner.table_width)
            x, logits = self.runner.mtp_forward(next_ids, hidden[idx], batch, from_main=True)
            last = batch.logits_indices
        # drafting: the sequences whose next step decodes (all their tokens but the newest computed)
        chain = []
        for i, (seq, p, _, m) in enumerate(rows):
            if seq.is_finished or seq.num_computed_tokens != seq.num_tokens - 1 or p + m != seq.num_tokens - 1:
                continue
            if self._budget(seq) > 0:
                chain.append((i, seq))
        if not chain:
            return
        sel = torch.tensor([i for i, _ in chain], device=dev)
        drafts = logits[last[sel]].argmax(-1).tolist()
        h = x[last[sel]]
        for (_, seq), d in zip(chain, drafts):
            seq.spec_token_ids = [int(d)]
        for step in range(1, self.k):
            # the sequences that may take one more draft and have a KV slot for its MTP row
            live = []
            for j, (_, seq) in enumerate(chain):
                if len(seq.spec_token_ids) != step or self._budget(seq) <= step:
                    continue
                pos = seq.num_tokens - 2 + step           # the row whose input is draft `step`
                need = self.block_manager.new_blocks_needed(seq, pos + 1)
                if need > self.block_manager.num_free_blocks:
                    continue
                self.block_manager.allocate(seq, pos + 1)
                live.append(j)
            if not live:
                break
            seqs = [chain[j][1] for j in live]
            ids = torch.tensor([s.spec_token_ids[-1] for s in seqs], dtype=torch.long, device=dev)
            b = AttentionBatch.build(block_tables=[s.block_table for s in seqs],
                                     context_lens=[s.num_tokens - 2 + step for s in seqs], query_lens=[1] * len(seqs),
                                     block_size=bs, device=dev, pad_blocks_to=self.runner.table_width)
            xs, lg = self.runner.mtp_forward(ids, h[torch.tensor(live, device=dev)], b, from_main=False)
            for s, d in zip(seqs, lg.argmax(-1).tolist()):
                s.spec_token_ids.append(int(d))
            # keep h indexed like `chain`: rows of sequences that stopped are simply not read again
            h = h.clone()
            h[torch.tensor(live, device=dev)] = xs

    def _uniform_width(self, rows: list, hidden: torch.Tensor) -> int | None:
        """q when the step brought every row's sequence q positions, in order, and each sequence's
        blocks cover all q (a verify step with the same drafts everywhere, or plain decode): the
        MTP layer's first pass can then take the step's rows as they are, at a captured width.
        None otherwise (a prompt chunk, a sequence with fewer drafts, one that finished)."""
        n, bs = len(rows), self.block_manager.block_size
        if not self.runner.draft_graphs or hidden.shape[0] % n:
            return None
        q = hidden.shape[0] // n
        if (True, q) not in self.runner.draft_graphs:
            return None
        for i, (seq, p, h, m) in enumerate(rows):
            if h != i * q or m > q or len(seq.block_table) * bs < p + q:
                return None
        return q

    def stats(self) -> dict[str, float]:
        return {"spec_num_speculative_tokens": float(self.k)} | self.counters.stats()
