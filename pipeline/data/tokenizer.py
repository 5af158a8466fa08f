"""Tokenizers: a local HF tokenizer directory, or a WordPiece vocabulary trained on the corpus.

Training our own vocabulary is what lets the embedded default run with no download.
"""

from __future__ import annotations

import os
from typing import Iterable

from tokenizers import BertWordPieceTokenizer
from transformers import AutoTokenizer, BertTokenizerFast, PreTrainedTokenizerBase

from pipeline.data.wordpiece import count_words, learn_vocabulary

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(
    texts: Iterable[str], out_dir: str, vocab_size: int = 8000, lowercase: bool = True, min_frequency: int = 2
) -> BertTokenizerFast:
    """Train a BERT-style WordPiece tokenizer and save it as an HF tokenizer directory: the
    same texts and settings give the same vocabulary (:mod:`pipeline.data.wordpiece`)."""
    vocab = learn_vocabulary(count_words(texts, lowercase), vocab_size, SPECIAL_TOKENS, min_frequency)
    wordpiece = BertWordPieceTokenizer(
        {piece: i for i, piece in enumerate(vocab)}, lowercase=lowercase, strip_accents=lowercase
    )
    os.makedirs(out_dir, exist_ok=True)
    # Wrap the trained object itself: transformers 5 ignores a bare vocab_file here.
    tokenizer = BertTokenizerFast(
        tokenizer_object=wordpiece._tokenizer,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        do_lower_case=lowercase,
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer {path!r}: not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    missing = [
        name
        for name in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id")
        if getattr(tokenizer, name) is None
    ]
    if missing:
        raise ValueError(f"tokenizer {path!r} lacks BERT special tokens: {', '.join(missing)}")
    return tokenizer


def prefix_token_ids(tokenizer: PreTrainedTokenizerBase, prefix: str) -> list[int]:
    """The token ids a retriever prefix (``"query: "``) puts before a pre-tokenized text."""
    return tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
