"""The pre-training method interface (models/method.py) that the training loop relies on."""

from __future__ import annotations

import torch

from models.method import PlainEngine, PretrainingMethod
from models.mlm import MLMConfig, MLMMethod
from pipeline.training.pretrain import METHODS
from tests.helpers import random_word_batch, tiny_masking_vocab, tiny_mlm, tiny_vocab

OWN = ("build", "corrupt_batch", "loss", "export")  # what each method must define itself


class RecordingEngine(PlainEngine):
    """A plain engine that records what backward received."""

    def __init__(self, module):
        super().__init__(module)
        self.backward_calls = []

    def backward(self, loss):
        self.backward_calls.append(loss)
        super().backward(loss)


def test_every_registered_method_implements_the_interface():
    for name, cls in METHODS.items():
        assert issubclass(cls, PretrainingMethod), name
        missing = [m for m in OWN if getattr(cls, m) is getattr(PretrainingMethod, m)]
        assert not missing, f"{name} lacks {missing}"
        assert cls.example_format in ("sequences", "span_pairs"), name
        assert cls.name == name


def test_plain_backward_backpropagates_the_reported_loss():
    method = MLMMethod(MLMConfig(mlm_probability=0.3), tiny_masking_vocab())
    assert isinstance(method, PretrainingMethod)
    model = method.build(tiny_mlm(len(tiny_vocab()), initializer_range=0.2))
    wb = random_word_batch(4, 24, seed=3)
    batch = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(3))
    engine = RecordingEngine(model)
    loss, _ = method.backward(engine, batch)
    assert len(engine.backward_calls) == 1
    assert not loss.requires_grad  # detached for logging
    torch.testing.assert_close(loss, engine.backward_calls[0].detach())
    expected, _ = method.loss(model, batch)
    torch.testing.assert_close(loss, expected.detach())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_make_batch_frames_the_streams_arrays_as_corrupt_batch_reads_them():
    """The stream's span pairs (b, 2, L) with lengths become (2b, L) rows, partners
    adjacent, masked past each length; the corruption is the tensor-level one, same seed."""
    method = MLMMethod(MLMConfig(mlm_probability=0.3), tiny_masking_vocab())
    wb = random_word_batch(4, 12, seed=5)
    lengths = wb.attention_mask.sum(1).numpy().reshape(2, 2)
    arrays = {"input_ids": wb.input_ids.numpy().reshape(2, 2, 12), "length": lengths}
    arrays["input_ids"].setflags(write=False)  # as Ray Data hands them out
    got = method.make_batch(arrays, torch.Generator().manual_seed(7))
    want = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(7))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key])
    assert method.count_tokens(arrays) == int(wb.attention_mask.sum())
