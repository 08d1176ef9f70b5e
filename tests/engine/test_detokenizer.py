"""Incremental detokenization: streamed text never splits a multi-byte character and adds up
to tokenizer.decode; stop strings cut the text (or keep the stop with include_stop_str_in_output)
and are held back while they could still be forming."""
import pytest
import transformers

from moet.engine.detokenizer import IncrementalDetokenizer
from moet.engine.sequence import Sequence
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import write_tokenizer


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytetok")
    write_tokenizer(str(d))
    return transformers.AutoTokenizer.from_pretrained(str(d))


def stream(tok, prompt_ids, out_ids, **kw):
    """Feed out_ids one token at a time; -> (visible texts after each token, stop hit, detok)."""
    sp = SamplingParams(**kw)
    s = Sequence(0, "r", 0, prompt_ids, sp, 1000)
    d = IncrementalDetokenizer(tok, s)
    seen, hit = [], None
    for t in out_ids:
        s.append_token(t)
        hit = d.update()
        seen.append(d.visible_text(False))
        if hit is not None:
            break
    if hit is None:
        d.finish()
    return seen, hit, d


TEXT = "héllo wörld € 𝄞 ok"     # 2-, 3- and 4-byte characters: one byte per token here


def test_multibyte_characters_are_never_split(byte_tok):
    ids = list(TEXT.encode())
    seen, hit, d = stream(byte_tok, list(b"Say: "), ids)
    assert hit is None and d.text == TEXT == byte_tok.decode(ids)
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)                        # monotonic
    assert all("\ufffd" not in t for t in seen)      # no half character ever shown
    assert len(set(seen)) < len(seen)                 # some steps waited for continuation bytes


def test_invalid_bytes_flush_as_decode_shows_them(byte_tok):
    ids = list("ab".encode()) + [0xE2, 0x82]          # a truncated 3-byte character at the end
    seen, hit, d = stream(byte_tok, [65], ids)
    assert seen[-1] == "ab" and d.text == byte_tok.decode(ids) == "ab\ufffd"
    ids = [0xE2, 0x82] + list(b"xy")                  # ... and in the middle
    _, _, d = stream(byte_tok, [65], ids)
    assert d.text == byte_tok.decode(ids)


def test_stop_string_spanning_tokens_is_cut_and_held_back(byte_tok):
    ids = list(TEXT.encode())
    seen, hit, d = stream(byte_tok, [65], ids, stop=["wör", "zzz"])
    assert hit == "wör" and d.text == "héllo " and d.stopped
    # while running, nothing that could be the start of "wör" / "zzz" was shown
    assert all(not t.endswith(("w", "wö")) for t in seen[:-1])
    assert all("wö" not in t for t in seen)
    seen, hit, d = stream(byte_tok, [65], ids, stop=["wör"], include_stop_str_in_output=True)
    assert hit == "wör" and d.text == "héllo wör"
    # stops are checked as text arrives: the first to complete wins, cut at its start
    _, hit, d = stream(byte_tok, [65], ids, stop=["llo wörld", "ö"])
    assert hit == "ö" and d.text == "héllo w"
    _, hit, d = stream(byte_tok, [65], ids, stop=["ld", "o w"])
    assert hit == "o w" and d.text == "héll"


def test_min_tokens_delays_stop_strings(byte_tok):
    ids = list(b"ab ab ab")
    _, hit, d = stream(byte_tok, [65], ids, stop=["ab"], min_tokens=4)
    assert hit == "ab" and d.text == "ab "           # the first "ab" came before min_tokens


def test_shipped_tokenizer_incremental_equals_full_decode():
    from moet.assets import default_model

    tok = transformers.AutoTokenizer.from_pretrained(default_model())
    text = " Paris is the capital of France. Ça coûte 5 € — naïve café 東京"
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = tok("Q: where?\nA:", add_special_tokens=False).input_ids
    seen, hit, d = stream(tok, prompt, ids)
    assert d.text == tok.decode(ids)
    assert all("\ufffd" not in t for t in seen)
