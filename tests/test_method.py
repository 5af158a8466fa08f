"""The pre-training method interface (models/method.py) that the training loop relies on."""

from __future__ import annotations

import torch

from models.method import PlainEngine, PretrainingMethod
from models.mlm import MLMConfig, MLMMethod
from pipeline.training.pretrain import METHODS
from tests.helpers import random_word_batch, tiny_masking_vocab, tiny_mlm, tiny_vocab

MEMBERS = ("build", "make_batch", "loss", "backward", "export")


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
        missing = [m for m in MEMBERS if not callable(getattr(cls, m, None))]
        assert not missing, f"{name} lacks {missing}"
        assert cls.example_format in ("sequences", "span_pairs"), name
        assert cls.name == name


def test_plain_backward_backpropagates_the_reported_loss():
    method = MLMMethod(MLMConfig(mlm_probability=0.3), tiny_masking_vocab())
    assert isinstance(method, PretrainingMethod)
    model = method.build(tiny_mlm(len(tiny_vocab()), initializer_range=0.2))
    wb = random_word_batch(4, 24, seed=3)
    batch = method.make_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(3))
    engine = RecordingEngine(model)
    loss, _ = method.backward(engine, batch)
    assert len(engine.backward_calls) == 1
    assert not loss.requires_grad  # detached for logging
    torch.testing.assert_close(loss, engine.backward_calls[0].detach())
    expected, _ = method.loss(model, batch)
    torch.testing.assert_close(loss, expected.detach())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
