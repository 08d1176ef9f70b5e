"""Incremental detokenization and stop strings, vLLM's rules.

Text grows by decoding a short window: decode(ids[prefix:]) minus decode(ids[prefix:read]).
The window starts a few tokens back (in the prompt at first) so tokenizers that drop a
leading space at the start of a decode (SentencePiece) still produce it for the first output
token. A decode that ends in U+FFFD is an incomplete multi-byte character (or a byte-fallback
token waiting for its partner): nothing is emitted until a later token completes it, so a
streamed delta never splits a character. On finish whatever is pending is flushed as decode
gives it (an invalid byte sequence stays U+FFFD, as tokenizer.decode shows it).

Stop strings are searched only where new text could complete one (the new characters plus
max_len - 1 before them), from min_tokens on. The text is cut before the stop string (after
it with include_stop_str_in_output); while running, the last max_len - 1 characters are
held back from the visible text since they might be the start of a stop string.
"""
from __future__ import annotations

from moet.engine.sequence import Sequence

PREFIX_WINDOW = 5          # tokens of context before the read offset (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, seq: Sequence):
        self.tokenizer = tokenizer
        self.seq = seq
        sp = seq.params
        self.skip_special = sp.skip_special_tokens
        self.stops = sp.stop_list
        self.include_stop = sp.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1 if not self.include_stop else 0
        self.prefix_offset = max(0, seq.num_prompt_tokens - PREFIX_WINDOW)
        self.read_offset = seq.num_prompt_tokens
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _advance(self, flush: bool) -> str:
        ids = self.seq.token_ids
        if self.read_offset >= len(ids):
            return ""
        before = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if not flush and (len(full) <= len(before) or full.endswith(REPLACEMENT)):
            return ""                                  # incomplete character: wait for more tokens
        delta = full[len(before):] if full.startswith(before) else full
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return delta

    def update(self) -> str | None:
        """After new tokens were appended to the sequence: extend the text; returns the stop
        string that ended generation, if any (the text is then already cut)."""
        if self.stopped:
            return None
        start = len(self.text)
        self.text += self._advance(flush=False)
        if not self.stops or len(self.text) == start or self.seq.num_output_tokens < self.seq.params.min_tokens:
            return None
        longest = max(len(s) for s in self.stops)
        lo = max(0, start - longest + 1)
        hit = None
        for s in self.stops:
            pos = self.text.find(s, lo)
            if pos >= 0 and (hit is None or pos < hit[0]):
                hit = (pos, s)
        if hit is None:
            return None
        pos, s = hit
        self.text = self.text[: pos + len(s)] if self.include_stop else self.text[:pos]
        self.stopped = True
        return s

    def finish(self) -> None:
        """Flush a pending (incomplete) character when the sequence ends for another reason."""
        if not self.stopped:
            self.text += self._advance(flush=True)

    def visible_text(self, finished: bool) -> str:
        if finished or self.stopped or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
