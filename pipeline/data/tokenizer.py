"""Tokenizers: a local HF tokenizer directory, or a WordPiece vocabulary trained on the corpus.

Training our own vocabulary is what lets the embedded default run with no download.
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np
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


def word_piece_counts(encodings, vocab_size: int) -> np.ndarray | None:
    """(2, vocab) counts of how often each token id starts a word (row 0) and continues one
    (row 1) in ``encodings`` (a fast tokenizer's batch, without special tokens), with word
    boundaries from the tokenizer's own ``word_ids``. None for a tokenizer without them."""
    ids, continues = [], []
    for i, doc_ids in enumerate(encodings["input_ids"]):
        try:
            words = encodings.word_ids(i)
        except ValueError:  # a slow (Python) tokenizer: no word ids
            return None
        if doc_ids:
            words = np.asarray([-1 if w is None else w for w in words])
            ids.append(np.asarray(doc_ids))
            continues.append(np.r_[False, (words[1:] == words[:-1]) & (words[1:] >= 0)])
    if not ids:
        return np.zeros((2, vocab_size), dtype=np.int64)
    ids, continues = np.concatenate(ids), np.concatenate(continues)
    return np.stack(
        [np.bincount(ids[~continues], minlength=vocab_size), np.bincount(ids[continues], minlength=vocab_size)]
    ).astype(np.int64)


def continuation_table(counts: np.ndarray) -> dict[str, list[int]]:
    """The ids seen mostly continuing a word, and those seen mostly starting one: what
    whole-word masking needs (``models.masking.MaskingVocab``)."""
    seen = counts.sum(0) > 0
    continues = counts[1] > counts[0]
    return {
        "continuation_ids": np.flatnonzero(seen & continues).tolist(),
        "start_ids": np.flatnonzero(seen & ~continues).tolist(),
    }
