"""Tokenizers: a local HF tokenizer directory, or a WordPiece vocabulary trained on the corpus.

Training our own vocabulary is what lets the embedded default run with no download.
"""

from __future__ import annotations

import os
from typing import Iterable

from tokenizers import BertWordPieceTokenizer
from transformers import AutoTokenizer, BertTokenizerFast, PreTrainedTokenizerBase

from pipeline.core import model_ref
from pipeline.core.errors import ConfigError
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


# The files a tokenizer's vocabulary lives in (WordPiece, byte-level BPE, SentencePiece).
VOCABULARY_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def check_model_tokenizer(reference: str, what: str) -> None:
    """Before any work: the model (its query tower, in an export of two) carries a tokenizer
    with a vocabulary. From a folder without one, transformers builds a tokenizer of its
    special tokens alone, and every word reads as [UNK]: an evaluation then ends with exit 0
    and all-zero metrics. A Hub model's repository holds its own."""
    ref = model_ref.parse(reference, what)
    if ref.kind == "hub":
        return
    tower = "query" if model_ref.has_file(reference, "query/config.json") else ""
    folder = model_ref.join(reference, tower) if tower else ref.text
    if ref.kind == "storage":
        if not any(model_ref.has_file(folder, name) for name in VOCABULARY_FILES):
            raise ConfigError(f"{what} {folder}: holds no tokenizer (none of {', '.join(VOCABULARY_FILES)})")
        return
    path = model_ref.join(reference, tower)  # a local path (a package's too)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {folder}: its tokenizer does not load ({str(exc).splitlines()[0]})") from None
    specials = len(set(tokenizer.all_special_ids))
    if len(tokenizer) <= specials:
        raise ConfigError(
            f"{what} {folder}: holds no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}; what loads is "
            f"its {specials} special tokens alone, every word {tokenizer.unk_token}): save the model's tokenizer beside it"
        )


# Families whose positions are numbered from the padding id + 1 (fairseq's convention): a
# config of N positions holds N - pad_token_id - 1 tokens (514 -> 512 for RoBERTa).
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "bart")


def check_lengths(reference: str, what: str, **lengths: int) -> None:
    """Before any work: each of ``lengths`` (an option's name: its tokens, specials
    included) within the positions the model's ``config.json`` gives (its passage tower's,
    in an export of two). Past them, the model fails in its embeddings on the first long
    text, a traceback minutes into the run."""
    if not lengths or model_ref.parse(reference, what).kind == "hub":
        return
    tower = "passage" if model_ref.has_file(reference, "passage/config.json") else ""
    config = model_ref.read_config(model_ref.join(reference, tower) if tower else reference, what)
    positions = config.get("max_position_embeddings")
    if not positions:
        return
    if config.get("model_type") in OFFSET_POSITIONS:
        positions -= int(config.get("pad_token_id") or 0) + 1
    for name, tokens in lengths.items():
        if tokens > positions:
            raise ConfigError(
                f"{name} {tokens} is more than the {positions} tokens {what} {reference} holds "
                "(its config.json's max_position_embeddings)"
            )


# What masked-language-model pre-training and the re-ranker's pairs need of a tokenizer.
BERT_SPECIALS = ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id")


def check_special_tokens(reference: str, what: str, required: tuple[str, ...]) -> None:
    """Before any work: the tokenizer at ``reference`` (a local folder or a package; one in
    storage or on the Hub is checked where it is loaded) has the special tokens ``required``,
    so that pre-training without [MASK] or [CLS] fails before the corpus is prepared."""
    if model_ref.parse(reference, what).kind not in ("local", "package"):
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_ref.materialize(reference, what))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {reference}: its tokenizer does not load ({str(exc).splitlines()[0]})") from None
    missing = missing_specials(tokenizer, required)
    if missing:
        names = ", ".join(name.removesuffix("_id") for name in missing)
        raise ConfigError(f"{what} {reference}: its tokenizer has no {names}, which this stage needs")


def missing_specials(tokenizer: PreTrainedTokenizerBase, required: tuple[str, ...]) -> list[str]:
    """Which of the special-token ids ``required`` (``"mask_token_id"``, ...) ``tokenizer`` lacks."""
    return [name for name in required if getattr(tokenizer, name) is None]


def load_tokenizer(path: str, required: tuple[str, ...] = ()) -> PreTrainedTokenizerBase:
    """The tokenizer in a local directory, with the special tokens ``required`` of it (a
    decoder's has no [CLS], [SEP] or [MASK]: retrievers frame texts as it does itself)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer {path!r}: not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    missing = missing_specials(tokenizer, required)
    if missing:
        raise ValueError(f"tokenizer {path!r} lacks BERT special tokens: {', '.join(missing)}")
    return tokenizer


# Texts whose tokens, put after a prefix's, must read as the prefix and text tokenized together.
_PREFIX_PROBES = ("In the beginning", "Retrieval, 2 words", "x")


def prefix_token_ids(tokenizer: PreTrainedTokenizerBase, prefix: str) -> list[int]:
    """The token ids a retriever prefix (``"query: "``) puts before a pre-tokenized text:
    those that make ``prefix ids + text ids`` what the tokenizer gives ``prefix + text``,
    as sentence-transformers' prompts are tokenized. A SentencePiece tokenizer marks the
    space before a word on the word, so a prefix's trailing space is left to the text.
    Raises ``ValueError`` where neither form joins exactly: a byte-level BPE (RoBERTa,
    Qwen2, Llama 3) joins the space to the first word, which the text's stored tokens lack."""
    if not prefix:
        return []

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    for form in dict.fromkeys((prefix, prefix.rstrip())):
        head = ids(form)
        if all(head + ids(probe) == ids(prefix + probe) for probe in _PREFIX_PROBES):
            return head
    raise ValueError(
        f"prefix {prefix!r}: this tokenizer ({type(tokenizer).__name__}) tokenizes the prefix and a text together "
        "differently from one after the other, and passages are stored tokenized; end the prefix without a space "
        f"({prefix.rstrip()!r}), or put it on queries only"
    )
