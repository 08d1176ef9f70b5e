"""Captured CUDA graphs of the model's forward for fixed step shapes (engine/model_runner.py).

A GraphSet holds the graphs of one query width q: steps in which every sequence brings exactly q
new tokens, for 1, 2, 4, ..., max_num_seqs sequences. q = 1 is plain decode; q = k + 1 is an MTP
verify step (each sequence's last token and its k drafts, engine/speculative.py), whose rows the
attention layers send through the paged prefill kernels (they size their grid from max_seqlen_q,
a host int fixed here, and read every length from the device). The same class holds the MTP
layer's drafting passes (a hidden-state input beside the ids) and the confidence gate's repair
passes (engine/confidence_gate.py), each a forward of its own.

A step of b sequences replays the graph of the next bucket up. Its inputs are copied into static
buffers, the only tensors a graph reads; padding sequences write nowhere (slot -1) and attend over
q tokens of whatever blocks their stale table rows name (their output is never read). Block
tables are max_model_len wide on CUDA, so eager and graph steps see the same table width (the
decode kernels' split count follows it). The host copies of the lengths are set to their worst
case: a captured kernel may size its grid from them, never its math.

Each set captures into its own memory pool, so a set whose capture fails (a kernel path that
syncs the host) is undone alone and the other keeps its graphs.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from moet.model.attention_batch import AttentionBatch

log = logging.getLogger("moet.engine")

Forward = Callable[[torch.Tensor, AttentionBatch], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


class GraphSet:
    """Static inputs and captured graphs of the steps whose sequences each bring `q` tokens."""

    def __init__(self, q: int, max_num_seqs: int, table_width: int, max_context: int,
                 device: torch.device | str, name: str, hidden: tuple[int, torch.dtype] | None = None):
        """hidden: (width, dtype) of a hidden-state input beside the token ids (the MTP layer's
        passes, engine/speculative.py), a static buffer too; None: ids only."""
        # the longest sequence a replay may serve (ModelRunner.graph_context): max_model_len, or
        # less where the model's forward takes another path past it (DSA beyond its top-k)
        self.q, self.name, self.max_context = q, name, max_context
        self.buckets = graph_buckets(max_num_seqs)
        n = max_num_seqs * q
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.arange(n, dtype=torch.long, device=device) % q
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_num_seqs, table_width, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((max_num_seqs,), q, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(0, (max_num_seqs + 1) * q, q, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(q - 1, n, q, dtype=torch.long, device=device)
        self.hidden = None if hidden is None else torch.zeros(n, hidden[0], dtype=hidden[1], device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.error: str | None = None
        self.pool = None                  # the capture's memory pool (handle)
        self.replays = 0

    def batch(self, bs: int, seq_lens_host: list[int] | None = None) -> AttentionBatch:
        """The static batch of bucket `bs`. seq_lens_host: the true lengths, for running it eagerly
        through the CPU references (which loop over them); default the worst case."""
        q, n = self.q, bs * self.q
        return AttentionBatch(
            positions=self.positions[:n], slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1], max_seqlen_q=q,
            num_decode_seqs=bs if q == 1 else 0, logits_indices=self.logits_indices[:bs],
            seq_lens_host=seq_lens_host or [self.max_context] * bs, cu_seqlens_q_host=list(range(0, n + 1, q)))

    def bucket_for(self, batch: AttentionBatch) -> int | None:
        """The captured bucket that can run `batch`: every sequence brings exactly q tokens."""
        if not self.graphs or batch.max_seqlen_q != self.q or batch.num_tokens != batch.num_seqs * self.q:
            return None
        if self.q > 1 and batch.num_decode_seqs:
            return None
        if max(batch.seq_lens_host, default=0) > self.max_context:
            return None
        return next((k for k in sorted(self.graphs) if k >= batch.num_seqs), None)

    def load(self, bucket: int, input_ids: torch.Tensor, batch: AttentionBatch,
             hidden: torch.Tensor | None = None) -> None:
        """Copies a step of batch.num_seqs <= bucket sequences into the static inputs."""
        b, q = batch.num_seqs, self.q
        n, m = b * q, bucket * q
        self.input_ids[:n].copy_(input_ids)
        if self.hidden is not None:
            self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:m].fill_(-1)
        self.block_tables[:b, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.seq_lens[b:bucket].fill_(q)

    def replay(self, bucket: int, input_ids: torch.Tensor, batch: AttentionBatch,
               hidden: torch.Tensor | None = None):
        """The step's rows of what the captured forward returns (a tensor, or a tuple of them)."""
        self.load(bucket, input_ids, batch, hidden)
        self.graphs[bucket].replay()
        self.replays += 1
        out, n = self.outputs[bucket], batch.num_tokens
        return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]

    @torch.inference_mode()
    def capture(self, forward: Forward, device: torch.device) -> None:
        """Captures every bucket (largest first: the smaller graphs reuse its pool blocks). On a
        failure no graph is kept, the capture is undone and one warning says why."""
        g = out = None
        with torch.cuda.device(device):
            # own pool and capture stream, both by handle, so that a failed capture can be undone
            self.pool = pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)
            caller = torch.cuda.current_stream(device)
            try:
                for bs in reversed(self.buckets):
                    batch, ids = self.batch(bs), self.input_ids[:bs * self.q]
                    # warm-up (compiles kernels) on the capture stream: what a stream gets on its first
                    # use (cuBLAS's workspace) is then made here, not inside the capture, where it
                    # would come from the graph pool and hold it for the life of the process
                    stream.wait_stream(caller)
                    with torch.cuda.stream(stream):
                        forward(ids, batch)
                    torch.cuda.synchronize(device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool, stream=stream):
                        out = forward(ids, batch)
                    self.graphs[bs], self.outputs[bs] = g, out
                torch.cuda.synchronize(device)
            except Exception as exc:     # e.g. a kernel path that syncs the host: run eager, say so once
                # only the text is kept: the exception's frames hold the capture's tensors (pool blocks)
                self.error = capture_error_text(exc)
            if self.error is not None:
                failed = g if g is not None and not _capture_ended(g) else None
                g = out = None
                self.graphs.clear()
                self.outputs.clear()
                left = abandon_capture(failed, stream, caller, pool)
                log.warning("CUDA graph capture failed, %s steps run eager: %s%s", self.name, self.error,
                            f" (not undone: {'; '.join(left)})" if left else "")


# ---------------------------------------------------------------------------- a failed capture

def capture_error_text(exc: BaseException) -> str:
    """What made a capture fail, in one line: the first exception of the chain (a host sync inside
    the capture raises there; torch.cuda.graph's exit then raises again from capture_end, "operation
    failed due to a previous error during capture", which names nothing), where it was raised in
    moet (the innermost moet frame), and the last exception if it is another one."""
    chain = [exc]
    while chain[-1].__context__ is not None and chain[-1].__context__ not in chain:
        chain.append(chain[-1].__context__)
    first, where, tb = chain[-1], None, chain[-1].__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/moet/" in name:
            where = f"{name[name.rindex('/moet/') + 1:]}:{tb.tb_lineno}"
        tb = tb.tb_next

    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"

    return line(first) + (f" (at {where})" if where else "") + (f"; then {line(exc)}" if first is not exc else "")


def abandon_capture(graph, stream: torch.cuda.Stream, caller: torch.cuda.Stream, pool) -> list[str]:
    """Puts the process back the way a failed torch.cuda.graph capture found it, so that later
    models, graphs and random draws in this process work. When capture_end raises (the capture was
    invalidated), torch leaves behind:
      * a capture still open on the stream, if the error came before cudaStreamEndCapture;
      * the capture stream as the current stream (torch.cuda.graph restores the caller's only
        after capture_end returns);
      * the caching allocator still routing the capture's allocations to `pool` (the routing
        entry is dropped after cudaStreamEndCapture succeeds; while any entry is left, the
        allocator defers freeing blocks used on several streams), and the failed graph's
        reference on the pool, so its blocks are never freed;
      * the device's default CUDA generator in capture mode (capture_begin's prologue set it,
        capture_end's epilogue never ran): every later random op outside a capture, and every
        replay of another graph, fails with "Offset increment outside graph capture".
    `graph`: the graph whose capture failed (None when the failure came outside a capture). Call
    inside torch.cuda.device(the capture's device), with no other reference to the pool's graphs
    or their tensors left; returns what could not be undone (for the caller's one warning)."""
    left: list[str] = []
    with torch.cuda.stream(stream):
        if graph is not None and torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()         # ends the (invalid) capture; its error is expected
            except RuntimeError:
                pass
        if torch.cuda.is_current_stream_capturing():
            left.append("the capture stream still captures")
    torch.cuda.set_stream(caller)
    if graph is not None and not _capture_ended(graph):
        index = torch.cuda.current_device()
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is None or release is None:
            left.append("the graph pool (this torch has no _cuda_endAllocateToPool / _cuda_releasePool)")
        else:
            try:
                end(index, pool)
            except RuntimeError:
                pass                        # capture_end got as far as handing the pool back
            try:
                release(index, pool)
            except RuntimeError as exc:
                left.append(f"the graph pool ({exc})")
    try:
        # the one way to run the generator's capture epilogue: a capture that ends. capture_begin
        # registers the default generator of the current device and restarts its capture state;
        # capture_end closes it. Under torch's per-capture generator states it is a no-op.
        scratch, x = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
        with torch.cuda.graph(scratch, stream=stream):
            x.add_(1)
        del scratch
    except RuntimeError as exc:
        left.append(f"the CUDA generator ({exc})")
        torch.cuda.set_stream(caller)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return left


def _capture_ended(graph) -> bool:
    try:
        graph.pool()                        # refused until capture_end has run to its end
        return True
    except RuntimeError:
        return False
