"""Structured outputs: a sequence whose SamplingParams carry StructuredOutputsParams samples only
tokens its grammar allows (xgrammar, the grammar engine vLLM and SGLang use).

  * JSON comes out in one layout (", " and ": " between items, no other whitespace): with free
    whitespace a small or 2-bit model can spend its tokens on newlines inside the object.
  * build_grammar (no tokenizer needed, so the server can refuse a bad request before admitting
    it): a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar ->
    an xgrammar Grammar, or RequestError naming the field when it does not compile or admits no
    string at all (`admits_a_string`: xgrammar accepts `root ::= "a" root`, which could only run
    to the length limit).
  * GrammarBackend (one per engine): the tokenizer's vocabulary as xgrammar sees it, a compile
    cache, a matcher per sequence. A grammar whose first step allows no token of this
    vocabulary is refused at admission too.
  * Per step the sampler fills one bitmask row per constrained sequence on the host (the grammar
    state follows the tokens the host already has) and applies it on the device: no extra sync,
    and the host work overlaps the step's forward, which the host queued before sampling. A
    sequence whose grammar allows no token (its grammar finished while end-of-sequence is
    blocked: ignore_eos, min_tokens) finishes with finish_reason "grammar_dead_end".
  * Accepted tokens advance the matcher (LLMEngine._after_token); MTP verification samples each
    position after the previous one's token is accepted, so drafts need no rollback.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch

from moet.errors import RequestError
from moet.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

DEAD_END = "grammar_dead_end"          # the finish reason of a sequence its grammar left no token


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:          # a runtime dependency (pyproject): a broken install
        raise RequestError(f"structured outputs need the xgrammar package ({exc}); pip install xgrammar",
                           param="structured_outputs") from None
    return xgrammar


def _field(so: StructuredOutputsParams) -> str:
    return f"structured_outputs.{so.kind}"


def build_grammar(so: StructuredOutputsParams, param: str | None = None) -> "xgrammar.Grammar":
    """so -> an xgrammar Grammar. RequestError (param: `param`, default structured_outputs.KIND)
    when it does not compile or admits no string."""
    xgr = _xgrammar()
    param = param or _field(so)
    kind = so.kind
    try:
        if kind == "json":
            text = so.json if isinstance(so.json, str) else json.dumps(so.json)
            json.loads(text)
            grammar = xgr.Grammar.from_json_schema(text, strict_mode=True, any_whitespace=False)
        elif kind == "json_object":
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(so.regex)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in so.choice))
        else:
            grammar = xgr.Grammar.from_ebnf(so.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise RequestError(f"{param}: {_reason(exc)}", param=param) from None
    if not admits_a_string(str(grammar)):
        raise RequestError(f"{param}: the grammar admits no string (every derivation of its root recurses "
                           "forever)", param=param)
    return grammar


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)


def ebnf_literal(text: str) -> str:
    """A string as an EBNF literal (xgrammar reads JSON-style escapes); "" for the empty string."""
    return json.dumps(text, ensure_ascii=False)


# ---------------------------------------------------------------------------- language emptiness

_TOKEN = re.compile(r'''
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<rep>\{\s*\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<op>\(=|[()|*+?])
  | (?P<ws>\s+)
''', re.VERBOSE)


def _tokens(body: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            raise ValueError(f"unexpected {body[i:i + 20]!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        i = m.end()
    return out


def admits_a_string(ebnf: str) -> bool:
    """Whether the normalized EBNF (str(xgrammar.Grammar): one `name ::= body` per line) derives at
    least one finite string from `root`: the classic productive-nonterminal fixpoint. A text this
    parser does not follow counts as productive (xgrammar then decides at run time)."""
    rules: dict[str, list[tuple[str, str]]] = {}
    try:
        for line in ebnf.splitlines():
            if "::=" in line:
                name, body = line.split("::=", 1)
                rules[name.strip()] = _tokens(body)
    except ValueError:
        return True
    if "root" not in rules:
        return True
    productive: set[str] = set()

    def expr(toks, i):            # -> (productive, next index); alternatives separated by |
        ok, i = seq(toks, i)
        while i < len(toks) and toks[i] == ("op", "|"):
            more, i = seq(toks, i + 1)
            ok = ok or more
        return ok, i

    def seq(toks, i):
        ok = True
        while i < len(toks) and toks[i][1] not in ("|", ")"):
            item, i = atom(toks, i)
            if i < len(toks) and (toks[i][0] == "rep" or toks[i][1] in ("*", "?", "+")):
                q = toks[i][1]
                optional = q in ("*", "?") or (toks[i][0] == "rep" and int(re.findall(r"\d+", q)[0]) == 0)
                item = item or optional
                i += 1
            ok = ok and item
        return ok, i

    def atom(toks, i):
        kind, text = toks[i]
        if kind in ("str", "cls"):
            return True, i + 1
        if kind == "name":
            return text in productive, i + 1
        if text in ("(", "(="):
            ok, i = expr(toks, i + 1)
            if i >= len(toks) or toks[i][1] != ")":
                raise ValueError("unbalanced")
            return (True if text == "(=" else ok), i + 1
        raise ValueError(f"unexpected {text!r}")

    try:
        changed = True
        while changed:
            changed = False
            for name, toks in rules.items():
                if name not in productive and expr(toks, 0)[0]:
                    productive.add(name)
                    changed = True
    except (ValueError, IndexError):
        return True
    return "root" in productive


# ---------------------------------------------------------------------------- per engine

class SequenceGrammar:
    """One sequence's grammar state (an xgrammar GrammarMatcher)."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.words = words              # int32 words of a bitmask row (vocabulary / 32, rounded up)
        self.dead_end = False

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the allowed next tokens into bitmask[row]; False when none is allowed."""
        if self.dead_end or self.matcher.is_terminated():
            bitmask[row].zero_()
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())

    def accept(self, token: int) -> bool:
        """Advances over a sampled token; False when the grammar refuses it (the sequence ends)."""
        if self.dead_end or self.matcher.is_terminated() or not self.matcher.accept_token(token):
            self.dead_end = True
            return False
        return True


class GrammarBackend:
    """The engine's side of structured outputs: this tokenizer's vocabulary for xgrammar, compiled
    grammars (cached by request), matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], info=None):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.info = info or xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                               stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)
        self._compiled: dict[tuple, object] = {}
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]

    @classmethod
    def synthetic(cls, vocab_size: int, stop_token_ids: set[int], seed: int = 0) -> "GrammarBackend":
        """For models without a tokenizer (`moet bench`'s random-weight shapes): the 256 bytes,
        then ASCII words of 2-8 characters, so that a grammar's mask costs what it costs over a
        real vocabulary of that size."""
        import random

        xgr = _xgrammar()
        rng = random.Random(seed)
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;\"{}[]"
        vocab = [bytes([b]) for b in range(256)]
        vocab += [("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))).encode()
                  for _ in range(vocab_size - 256)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids) or None)
        return cls(None, vocab_size, stop_token_ids, info=info)

    def compile(self, so: StructuredOutputsParams, stop_token_ids: list[int] | None):
        """A compiled grammar for `so`; RequestError when it does not compile, admits no string, or
        allows no first token of this vocabulary."""
        key = (so.kind, json.dumps(so.json, sort_keys=True) if isinstance(so.json, dict) else getattr(so, so.kind))
        compiled = self._compiled.get(key)
        if compiled is None:
            grammar = build_grammar(so)
            try:
                compiled = self.compiler.compile_grammar(grammar)
            except RuntimeError as exc:
                raise RequestError(f"{_field(so)}: {_reason(exc)}", param=_field(so)) from None
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        probe = self.new_sequence(compiled, stop_token_ids)
        mask = torch.zeros(1, self.words, dtype=torch.int32)
        if not probe.fill(mask, 0):
            raise RequestError(f"{_field(so)}: the grammar allows no first token of this model's vocabulary",
                               param=_field(so))
        return compiled

    def new_sequence(self, compiled, stop_token_ids: list[int] | None) -> SequenceGrammar:
        xgr = _xgrammar()
        stops = sorted(set(self.stop_token_ids) | set(stop_token_ids or ()))
        return SequenceGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None), self.words)


def fill_bitmask(grammars: list[SequenceGrammar], words: int) -> tuple[torch.Tensor, list[int]]:
    """One host bitmask row per grammar (int32 words, bit t of the row: token t allowed) and the
    rows that allow nothing."""
    mask = torch.empty(len(grammars), words, dtype=torch.int32)
    dead = [i for i, g in enumerate(grammars) if not g.fill(mask, i)]
    return mask, dead


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of mask[i] is clear, in place. `mask` is on the host:
    copied to the device asynchronously (pinned), unpacked there."""
    dev, v = logits.device, logits.shape[-1]
    if dev.type == "cuda":
        mask = mask.pin_memory().to(dev, non_blocking=True)
        idx = torch.tensor(rows, dtype=torch.long).pin_memory().to(dev, non_blocking=True)
    else:
        idx = torch.tensor(rows, dtype=torch.long)
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((mask[:, :, None] >> shifts) & 1).reshape(mask.shape[0], -1)[:, :v].bool()
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
