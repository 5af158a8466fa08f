"""Whole-word masking with BERT's 80/10/10 replacement (models.masking)."""

from __future__ import annotations

import pytest
import torch

from models.masking import IGNORE_INDEX, MaskingVocab, whole_word_mask, word_ids
from tests.helpers import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    random_word_batch,
    tiny_masking_vocab,
    tiny_vocab,
)

N_SEQ, SEQ_LEN = 200, 128


@pytest.fixture(scope="module")
def vocab() -> MaskingVocab:
    return tiny_masking_vocab()


@pytest.fixture(scope="module")
def batch():
    return random_word_batch(N_SEQ, SEQ_LEN, seed=1234)


@pytest.fixture(scope="module")
def masked(batch, vocab):
    original = batch.input_ids.clone()
    out, labels = whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(7))
    assert torch.equal(batch.input_ids, original), "whole_word_mask modified its input in place"
    return out, labels


def test_batch_is_what_the_stats_assume(batch):
    # Sanity of the fixture itself: many words, multi-piece words, padding and inner [SEP]s.
    n_words = sum(len(w) for w in batch.words)
    assert n_words > 8000
    assert sum(1 for row in batch.words for s, e in row if e - s > 1) > 0.5 * n_words
    assert (batch.attention_mask == 0).any()
    assert ((batch.input_ids == SEP_ID).sum(1) > 1).any()


def test_word_selection_rate_is_15_percent(batch, masked):
    _, labels = masked
    selected = labels != IGNORE_INDEX
    words = [(b, s, e) for b, row in enumerate(batch.words) for s, e in row]
    chosen = sum(bool(selected[b, s]) for b, s, e in words)
    rate = chosen / len(words)
    assert abs(rate - 0.15) <= 0.01, rate


def test_other_probabilities_are_honoured(batch, vocab):
    _, labels = whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(3), probability=0.4)
    starts = torch.tensor([[b, s] for b, row in enumerate(batch.words) for s, _ in row])
    rate = (labels[starts[:, 0], starts[:, 1]] != IGNORE_INDEX).float().mean().item()
    assert abs(rate - 0.4) <= 0.015, rate


def test_replacement_split_is_80_10_10(batch, masked):
    out, labels = masked
    selected = labels != IGNORE_INDEX
    orig, new = batch.input_ids[selected], out[selected]
    n = selected.sum().item()
    assert n > 2000
    to_mask = (new == MASK_ID).float().mean().item()
    unchanged = (new == orig).float().mean().item()
    random = ((new != orig) & (new != MASK_ID)).float().mean().item()
    # A random replacement can draw the original token (1 in 75 here): it counts as unchanged.
    assert abs(to_mask - 0.8) <= 0.02, to_mask
    assert abs(random - 0.1) <= 0.02, random
    assert abs(unchanged - 0.1) <= 0.02, unchanged


def test_whole_words_are_selected_together(batch, masked):
    _, labels = masked
    selected = labels != IGNORE_INDEX
    multi = 0
    for b, row in enumerate(batch.words):
        for s, e in row:
            pieces = selected[b, s:e]
            assert pieces.all() or not pieces.any(), (b, s, e, pieces)
            multi += int(e - s > 1 and bool(pieces.all()))
        # Nothing outside a word span is ever selected.
        covered = torch.zeros(SEQ_LEN, dtype=torch.bool)
        for s, e in row:
            covered[s:e] = True
        assert not selected[b, ~covered].any()
    assert multi > 100  # multi-piece words were actually selected, so the check had teeth


def test_word_ids_follow_continuations(vocab):
    ids = torch.tensor([[CLS_ID, 10, 60, 61, 11, SEP_ID, 12, 62, SEP_ID, PAD_ID]])
    assert word_ids(ids, vocab).tolist() == [[-1, 0, 0, 0, 1, -1, 2, 2, -1, -1]]


def test_specials_and_padding_are_never_selected_or_changed(batch, masked):
    out, labels = masked
    special = torch.isin(batch.input_ids, torch.tensor(SPECIAL_IDS))
    assert special.sum() > 2 * N_SEQ
    assert (labels[special] == IGNORE_INDEX).all()
    assert torch.equal(out[special], batch.input_ids[special])
    for token in (CLS_ID, SEP_ID, PAD_ID):
        where = batch.input_ids == token
        assert where.any()
        assert (out[where] == token).all()
        assert (labels[where] == IGNORE_INDEX).all()
    assert (out[batch.attention_mask == 0] == PAD_ID).all()


def test_labels_are_original_ids_at_selected_positions_only(batch, masked):
    out, labels = masked
    selected = labels != IGNORE_INDEX
    assert torch.equal(labels[selected], batch.input_ids[selected])
    assert (labels[~selected] == IGNORE_INDEX).all()
    # Only selected positions are corrupted.
    assert torch.equal(out[~selected], batch.input_ids[~selected])


def test_random_replacements_never_produce_special_tokens(batch, vocab):
    # A high rate makes many random replacements (about 0.1 * 0.9 * 25k ~ 2k draws).
    out, labels = whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(11), probability=0.9)
    selected = labels != IGNORE_INDEX
    replaced = selected & (out != batch.input_ids) & (out != MASK_ID)
    assert replaced.sum() > 1000
    assert not torch.isin(out[replaced], torch.tensor(SPECIAL_IDS)).any()
    # And the replacements are spread over the whole non-special vocabulary.
    assert len(torch.unique(out[replaced])) > 0.9 * (len(tiny_vocab()) - len(SPECIAL_IDS))


def test_same_seed_same_output_different_seed_differs(batch, vocab):
    def run(seed):
        return whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(seed))

    a_out, a_lab = run(5)
    b_out, b_lab = run(5)
    c_out, c_lab = run(6)
    assert torch.equal(a_out, b_out) and torch.equal(a_lab, b_lab)
    assert not torch.equal(a_lab, c_lab)
    assert not torch.equal(a_out, c_out)


def test_global_rng_is_untouched(batch, vocab):
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(4), expected)


def test_nothing_masked_at_probability_zero(batch, vocab):
    out, labels = whole_word_mask(batch.input_ids, vocab, torch.Generator().manual_seed(0), probability=0.0)
    assert (labels == IGNORE_INDEX).all()
    assert torch.equal(out, batch.input_ids)


def test_from_tokenizer_marks_specials_and_continuations(tmp_path):
    from tests.helpers import make_tokenizer_dir

    tok = make_tokenizer_dir(str(tmp_path / "tok"))
    vocab = MaskingVocab.from_tokenizer(tok)
    assert vocab.vocab_size == len(tok)
    assert vocab.mask_token_id == tok.mask_token_id
    for i in (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.mask_token_id, tok.unk_token_id):
        assert vocab.is_special[i]
        assert i not in vocab.replacement_ids.tolist()
    cont = tok.convert_tokens_to_ids([t for t in tok.get_vocab() if t.startswith("##")])
    assert cont and vocab.is_continuation[cont].all()
    assert vocab.is_continuation.sum() == len(cont)
