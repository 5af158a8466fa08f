"""A WordPiece vocabulary learned from a corpus, the same one every time.

``tokenizers``' trainer numbers continuation pieces in hash-map order, and that order
breaks ties between equally frequent merges, so two trainings on one corpus can give two
vocabularies (huggingface/tokenizers#1794). This is the same procedure (BERT's normalizer
and pre-tokenizer from ``tokenizers``, then byte-pair merges over ``##``-prefixed
continuation pieces, the most frequent pair first) with ties broken by the pieces' text.

Memory and time: one entry per distinct word, and per merge only the words that hold the
merged pair are touched (a heap of pair counts, stale entries skipped when popped).
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable

from tokenizers import normalizers, pre_tokenizers

PREFIX = "##"


def count_words(texts: Iterable[str], lowercase: bool) -> Counter:
    """Each word's count, after BERT's normalisation and pre-tokenisation."""
    normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


def _merged(a: str, b: str) -> str:
    return a + b[len(PREFIX) :]


def learn_vocabulary(
    word_counts: Counter, vocab_size: int, special_tokens: list[str], min_frequency: int = 2
) -> list[str]:
    """Special tokens, then every character (first of a word, or ``##`` continuation), then
    merged pieces in merge order, up to ``vocab_size``. A pair is merged while it occurs at
    least ``min_frequency`` times; equal counts go to the pair whose pieces sort first."""
    words = [(list(w[:1]) + [PREFIX + c for c in w[1:]], n) for w, n in sorted(word_counts.items())]
    vocab = list(special_tokens)
    known = set(vocab)
    for piece in sorted({p for pieces, _ in words for p in pieces}):
        if piece not in known:
            vocab.append(piece)
            known.add(piece)
    pair_counts: Counter = Counter()
    holders: dict[tuple[str, str], set[int]] = {}
    for i, (pieces, n) in enumerate(words):
        for pair in zip(pieces, pieces[1:]):
            pair_counts[pair] += n
            holders.setdefault(pair, set()).add(i)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        negative, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative:
            continue  # stale: the pair's count changed since this entry was pushed
        if -negative < min_frequency:
            break
        new = _merged(*pair)
        changed: set[tuple[str, str]] = set()
        for i in sorted(holders.pop(pair, ())):
            pieces, n = words[i]
            for old in zip(pieces, pieces[1:]):
                pair_counts[old] -= n
                changed.add(old)
            merged, j = [], 0
            while j < len(pieces):
                if j + 1 < len(pieces) and (pieces[j], pieces[j + 1]) == pair:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(pieces[j])
                    j += 1
            words[i] = (merged, n)
            for now in zip(merged, merged[1:]):
                pair_counts[now] += n
                holders.setdefault(now, set()).add(i)
                changed.add(now)
        pair_counts.pop(pair, None)
        for p in changed - {pair}:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                pair_counts.pop(p, None)
                holders.pop(p, None)
        if new not in known:
            vocab.append(new)
            known.add(new)
    return vocab[:vocab_size]
