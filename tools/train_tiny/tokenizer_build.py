"""Byte-level BPE trained on the corpus, saved so that AutoTokenizer.from_pretrained and
apply_chat_template work offline (tokenizer.json + tokenizer_config.json with the template).

Digits are split one per token before BPE: arithmetic scratchpads then address single
digits, and numbers never merge into arbitrary chunks.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moet.probe.chat_format import BOS, CHAT_TEMPLATE, EOS, MARKUP_TOKENS, PAD, SPECIAL_TOKENS


def train(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS + MARKUP_TOKENS,  # ids 0.. in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain-text encodes start with <|bos|> like the chat template does (apply_chat_template
    # tokenizes without special tokens, so nothing is doubled).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    # Markup tokens stay atomic but are not "special": decode(skip_special_tokens=True) keeps them.
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        t["special"] = t["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def save(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + MARKUP_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # batched generation
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
