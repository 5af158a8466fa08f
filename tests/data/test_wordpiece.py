"""The WordPiece vocabulary learned from a corpus: byte-pair merges over ``##`` pieces, most
frequent first, ties broken by the pieces' text, so the same corpus gives the same vocabulary."""

from __future__ import annotations

import random
from collections import Counter

from pipeline.data.tokenizer import train_wordpiece
from pipeline.data.wordpiece import count_words, learn_vocabulary


def test_merges_follow_a_hand_computed_order():
    """low 5, lower 2, newest 6, widest 3. Pair counts: (##e ##s) and (##s ##t) 9 each, the
    tie to the smaller text: ##es, then ##est (9); (##o ##w) and (l ##o) 7: ##ow, then low;
    then the three 6s of newest from the smallest, the 3s of widest, the 2s of lower."""
    counts = Counter({"low": 5, "lower": 2, "newest": 6, "widest": 3})
    vocab = learn_vocabulary(counts, 100, ["[PAD]", "[UNK]"])
    alphabet = ["##d", "##e", "##i", "##o", "##r", "##s", "##t", "##w", "l", "n", "w"]
    merges = ["##es", "##est", "##ow", "low", "##ew", "##ewest", "newest", "##dest", "##idest", "widest"]
    assert vocab == ["[PAD]", "[UNK]", *alphabet, *merges, "##er", "lower"]
    assert learn_vocabulary(counts, 15, ["[PAD]", "[UNK]"]) == vocab[:15]  # stops at the size
    assert learn_vocabulary(counts, 100, ["[PAD]", "[UNK]"], min_frequency=6)[-1] == "newest"


def test_the_same_corpus_in_any_order_gives_the_same_tokenizer(tmp_path):
    texts = [f"the {w} of egypt and the {w}s unto moses" for w in ("lamb", "land", "lord", "month", "feast")] * 7
    texts += ["Jehoshaphat's kingdom; Zerubbabel, the governor!"] * 3
    shuffled = texts[:]
    random.Random(1).shuffle(shuffled)
    assert count_words(texts, True) == count_words(shuffled, True)
    first = train_wordpiece(texts, str(tmp_path / "a"), vocab_size=120)
    second = train_wordpiece(shuffled, str(tmp_path / "b"), vocab_size=120)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert first.tokenize("The lambs of Egypt") == ["the", "lambs", "of", "egypt"]
    assert second.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) == [0, 1, 2, 3, 4]
