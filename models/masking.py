"""Input corruption shared by the pre-training methods.

Masking runs on the training worker, per micro-batch, with an explicit
``torch.Generator``: a replayed step (gradient cache, resume) can recreate the exact
same corruption, and no global RNG state is touched.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class MaskingVocab:
    """What masking needs to know about a vocabulary.

    ``is_continuation[id]`` marks the pieces that continue a word, so a word is a start
    piece followed by its continuations. Which ids those are comes from the tokenizer's
    own word boundaries (``word_ids``) over the corpus, as ``pieces`` (the prepared
    corpus's ``word_pieces.json``: ``continuation_ids`` and ``start_ids``), for WordPiece,
    byte-level BPE and SentencePiece alike; ids it never saw, or every id without it, fall
    back to WordPiece's ``##`` marker. ``replacement_ids`` are the ids a "random token" may
    take: every id except the special tokens, so the 10% random replacements never inject
    [CLS].
    """

    def __init__(self, tokens: list[str], special_ids: list[int], mask_token_id: int, pieces: dict | None = None):
        self.vocab_size = len(tokens)
        self.mask_token_id = int(mask_token_id)
        self.is_continuation = torch.tensor([t.startswith("##") for t in tokens], dtype=torch.bool)
        if pieces:
            for key, value in (("continuation_ids", True), ("start_ids", False)):
                ids = torch.tensor(pieces.get(key, []), dtype=torch.long)
                self.is_continuation[ids[ids < len(tokens)]] = value
        special = torch.zeros(len(tokens), dtype=torch.bool)
        special[torch.tensor(sorted(set(special_ids)), dtype=torch.long)] = True
        self.is_special = special
        self.replacement_ids = torch.nonzero(~special).flatten()

    @classmethod
    def from_tokenizer(cls, tokenizer, pieces: dict | None = None) -> "MaskingVocab":
        vocab = tokenizer.get_vocab()
        tokens = [""] * (max(vocab.values()) + 1)
        for tok, idx in vocab.items():
            tokens[idx] = tok
        return cls(tokens, list(tokenizer.all_special_ids), tokenizer.mask_token_id, pieces)


def word_ids(input_ids: torch.Tensor, vocab: MaskingVocab) -> torch.Tensor:
    """Index of the word each piece belongs to (-1 on special tokens and padding)."""
    special = vocab.is_special[input_ids]
    starts = ~vocab.is_continuation[input_ids] & ~special
    ids = torch.cumsum(starts.long(), dim=1) - 1
    return ids.masked_fill(special, -1)


def select_words(
    input_ids: torch.Tensor, vocab: MaskingVocab, probability: float, generator: torch.Generator
) -> torch.Tensor:
    """Boolean (B, L) selection of whole words, each word chosen with ``probability``.

    A word's pieces share one random draw (the draw at the word's index), so they are
    selected together, and special tokens and padding are never selected.
    """
    words = word_ids(input_ids, vocab)
    draws = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    per_piece = draws.gather(1, words.clamp(min=0))
    return (per_piece < probability) & (words >= 0)


def apply_bert_replacement(
    input_ids: torch.Tensor,
    selected: torch.Tensor,
    vocab: MaskingVocab,
    generator: torch.Generator,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
) -> torch.Tensor:
    """BERT's 80/10/10: [MASK], a random non-special token, or unchanged, per selected piece."""
    draws = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    to_mask = selected & (draws < mask_fraction)
    to_random = selected & (draws >= mask_fraction) & (draws < mask_fraction + random_fraction)
    pick = torch.randint(len(vocab.replacement_ids), input_ids.shape, generator=generator, device=input_ids.device)
    random_tokens = vocab.replacement_ids.to(input_ids.device)[pick]
    out = input_ids.masked_fill(to_mask, vocab.mask_token_id)
    return torch.where(to_random, random_tokens, out)


def whole_word_mask(
    input_ids: torch.Tensor, vocab: MaskingVocab, generator: torch.Generator, probability: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-word masking for MLM: returns (corrupted input ids, labels).

    Labels hold the original id at selected positions and -100 everywhere else, so
    special tokens and padding never contribute to the loss.
    """
    selected = select_words(input_ids, vocab, probability, generator)
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
    return apply_bert_replacement(input_ids, selected, vocab, generator), labels
