"""Sizing from memory (models/memory.py): what autograd keeps, the fitted cost of a batch,
and the micro-batch the loop splits a step into (pipeline/training/worker.py). The gradient
cache's chunk: tests/models/test_packing.py. On Ray Train, the sized run against the same split
set by hand: tests/training/test_pretrain_ray.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel

from models.cocondenser import CoCondenserConfig, CoCondenserMethod
from models.condenser import CondenserConfig, CondenserMethod
from models.memory import (
    ACTIVATION_SHARE,
    OPTIMIZER_BYTES_PER_PARAM,
    ActivationCost,
    fitting_micro_batch,
    measure_activations,
    saved_bytes,
)
from models.method import PlainEngine
from models.mlm import MLMConfig, MLMMethod
from models.simlm import SimLMConfig, SimLMMethod
from pipeline.training.train_config import TrainConfig
from pipeline.training.worker import size_micro_batch
from tests.helpers import tiny_masking_vocab, tiny_mlm, tiny_vocab

WIDTH = 32


def test_saved_bytes_counts_what_autograd_keeps_for_the_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    x = torch.randn(10, 16)
    # Linear keeps its input (for the weight's gradient), tanh its output; weights aside.
    assert saved_bytes(lambda: model(x), model) == 2 * 10 * 16 * 4
    assert all(p.grad is None for p in model.parameters())


def test_the_cost_is_fitted_from_two_forwards():
    measured = []

    def activations(n: int) -> int:
        measured.append(n)
        return 1000 + 64 * n

    assert measure_activations(activations, 3) == ActivationCost(per_item=64, fixed=1000)
    assert measured == [3, 6]
    assert ActivationCost(per_item=64, fixed=1000).bytes(10) == 1640


def test_the_micro_batch_is_the_largest_divisor_of_the_step_that_fits():
    cost = ActivationCost(per_item=10, fixed=100)
    assert fitting_micro_batch(cost, budget=1000, step_items=12) == 12
    assert fitting_micro_batch(cost, budget=190, step_items=12) == 6  # 12 takes 220; 6 takes 160
    assert fitting_micro_batch(cost, budget=139, step_items=12) == 3  # 4 takes 140
    assert fitting_micro_batch(cost, budget=150, step_items=7) == 1  # a prime: all or one at a time
    assert fitting_micro_batch(cost, budget=50, step_items=12) == 1  # never below one


def _method(name: str, tmp_path):
    vocab = tiny_masking_vocab()
    if name == "simlm":
        generator = str(tmp_path / "generator")
        tiny_mlm(len(tiny_vocab()), seed=7, num_layers=1).save_pretrained(generator)
        return SimLMMethod(SimLMConfig(generator=generator), vocab)
    return {"mlm": MLMMethod(MLMConfig(), vocab), "condenser": CondenserMethod(CondenserConfig(), vocab)}[name]


@pytest.mark.parametrize("name", ["mlm", "condenser", "simlm"])
def test_a_methods_cost_predicts_a_larger_micro_batch(name, tmp_path):
    method = _method(name, tmp_path)
    model = method.build(tiny_mlm(seed=3))
    cost = method.activation_cost(model, WIDTH)
    assert cost is not None and cost.per_item > 0
    # A batch three times the larger measuring one, from other tokens and another masking
    # draw: the masked positions (the MLM logits) vary with the draw, the rest is exact.
    rng = np.random.default_rng(5)
    rows = 12
    arrays = {
        "input_ids": rng.choice(method.vocab.replacement_ids.numpy(), (rows, WIDTH)).astype(np.int32),
        "length": np.full(rows, WIDTH, np.int32),
    }
    batch = method.make_batch(arrays, torch.Generator().manual_seed(11))
    actual = saved_bytes(lambda: method.loss(model, batch)[0], model)
    assert cost.bytes(rows) == pytest.approx(actual, rel=0.05)  # measured: within 3.3%
    assert all(p.grad is None for p in model.parameters())


def test_cocondenser_is_never_split():
    """Its span-pair loss takes every other span of the micro-batch as a negative."""
    method = CoCondenserMethod(CoCondenserConfig(head=""), tiny_masking_vocab())
    assert method.activation_cost(method.build(tiny_mlm(seed=3)), WIDTH) is None


class SizedEngine(PlainEngine):
    """The engine surface :func:`size_micro_batch` uses, as DeepSpeed's one-worker engine has it."""

    dp_world_size = 1
    device = torch.device("cpu")

    def __init__(self, module, micro: int, accum: int):
        super().__init__(module)
        self.micro, self.batch = micro, micro * accum
        self.optimizer = type("ZeroOptimizer", (), {"gradient_accumulation_steps": accum})()

    def set_train_micro_batch_size(self, micro: int) -> None:
        self.micro, self.batch = micro, micro * (self.batch // self.micro)

    def set_train_batch_size(self, batch: int) -> None:
        assert batch % self.micro == 0
        self.batch = batch

    def gradient_accumulation_steps(self) -> int:
        return self.batch // self.micro


class MethodTask:
    def __init__(self, method):
        self.method = method

    def activation_cost(self, module):
        return self.method.activation_cost(module, WIDTH)


@pytest.fixture
def one_process(monkeypatch):
    """The ranks' agreement (an all-reduce of their choices) with one rank: its own choice."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)


def test_the_step_is_split_into_the_fewest_micro_batches_that_fit(one_process, capsys):
    method = MLMMethod(MLMConfig(), tiny_masking_vocab())
    model = method.build(tiny_mlm(seed=3))
    task, cost = MethodTask(method), method.activation_cost(model, WIDTH)
    optimizer_state = OPTIMIZER_BYTES_PER_PARAM * sum(p.numel() for p in model.parameters())

    def available_for(rows: float) -> int:  # the memory in which `rows` rows' activations just fit
        return int((cost.bytes(rows) + optimizer_state) / ACTIVATION_SHARE) + 1

    train = TrainConfig(micro_batch_size=8, grad_accum=1, size_micro_batch="on")
    engine = SizedEngine(model, 8, 1)
    sized = size_micro_batch(engine, task, train, available_for(3.5), kept=0)
    assert (sized["micro_batch_size"], sized["grad_accum"]) == (2, 4)  # 4 would not fit; 2 x 4 keeps 8 a step
    assert (engine.micro, engine.gradient_accumulation_steps(), engine.optimizer.gradient_accumulation_steps) == (
        2,
        4,
        4,
    )

    # A step of 4 x 3 rows in memory for 12: one micro-batch.
    train = TrainConfig(micro_batch_size=4, grad_accum=3, size_micro_batch="on")
    engine = SizedEngine(model, 4, 3)
    assert size_micro_batch(engine, task, train, available_for(12), kept=0)["micro_batch_size"] == 12
    assert (engine.micro, engine.gradient_accumulation_steps()) == (12, 1)

    # A resumed run keeps its first attempt's split while it fits, even where a larger one would.
    sized = size_micro_batch(SizedEngine(model, 4, 3), task, train, available_for(12), kept=4)
    assert (sized["micro_batch_size"], sized["kept_from"]) == (4, 4)
    # ... and no longer once it does not (a smaller device): then the largest that does.
    assert size_micro_batch(SizedEngine(model, 4, 3), task, train, available_for(3.5), kept=4)["micro_batch_size"] == 3
    assert "exceed" not in capsys.readouterr().err
    # Where not even one row fits: a row at a time, and the worker says so.
    assert size_micro_batch(SizedEngine(model, 4, 3), task, train, available_for(0.5), kept=0)["micro_batch_size"] == 1
    assert "exceed this worker's budget" in capsys.readouterr().err


def test_sizing_is_off_where_it_must_or_may_not_run(one_process):
    method = MLMMethod(MLMConfig(), tiny_masking_vocab())
    model = method.build(tiny_mlm(seed=3))
    for setting in ("off", "auto"):  # auto: on with GPUs only
        engine = SizedEngine(model, 8, 1)
        assert size_micro_batch(engine, MethodTask(method), TrainConfig(size_micro_batch=setting), 10, kept=0) == {}
        assert engine.micro == 8
    cocondenser = CoCondenserMethod(CoCondenserConfig(head=""), tiny_masking_vocab())
    engine = SizedEngine(cocondenser.build(tiny_mlm(seed=3)), 8, 1)
    assert size_micro_batch(engine, MethodTask(cocondenser), TrainConfig(size_micro_batch="on"), 10, kept=0) == {}
    with pytest.raises(ValueError, match="memory_gib"):
        TrainConfig(memory_gib=-1)


def test_the_retrievers_cache_chunk_is_sized_only_when_the_micro_batch_does_not_fit():
    """The retriever's gradient cache (in-batch negatives couple its micro-batch, so the
    cache, not a split, is what fits it in memory): no cache when the micro-batch fits, else
    the most full-length passages that fit beside the cache's gradient sums; the chunked
    step then has the whole batch's loss and gradients."""
    from transformers import BertModel

    from models.biencoder import BiEncoder, BiEncoderConfig, ContrastiveObjective
    from tests.helpers import tiny_bert_config

    torch.manual_seed(0)
    cfg = BiEncoderConfig(group_size=4, pooling="mean")
    model = BiEncoder(BertModel(tiny_bert_config(initializer_range=0.2)), None, cfg)
    objective = ContrastiveObjective(cfg, passage_max_len=WIDTH, query_max_len=12)
    assert objective.fit_chunk(model, available_bytes=2**34, micro_batch_size=8) == 0

    def passage_bytes(rows: int) -> int:
        ids = torch.randint(5, len(tiny_vocab()), (rows, WIDTH))
        return saved_bytes(lambda: model.encode_passage(ids, torch.ones_like(ids)), model)

    sums = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget = sums + passage_bytes(10) + 1
    chunk = objective.fit_chunk(model, available_bytes=budget / ACTIVATION_SHARE, micro_batch_size=8)
    assert 8 <= chunk <= 10 and passage_bytes(chunk) + sums <= budget

    rng = np.random.default_rng(2)
    arrays = {
        "q_input_ids": rng.integers(5, len(tiny_vocab()), (8, 12)),
        "q_length": rng.integers(4, 13, 8),
        "d_input_ids": rng.integers(5, len(tiny_vocab()), (8, 4, WIDTH)),
        "d_length": rng.integers(8, WIDTH + 1, (8, 4)),
    }
    batch = objective.make_batch(arrays, torch.Generator())
    losses, grads = [], []
    for chunk_size in (chunk, 0):
        objective.chunk_size = chunk_size
        model.zero_grad()
        losses.append(objective.backward(PlainEngine(model), batch)[0])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 1e-5


def test_the_model_state_is_partitioned_from_the_stage_that_partitions_each_part():
    """The ZeRO paper's accounting (section 5): a 7.5B model trained in mixed precision on 64
    workers keeps 2 + 2 + 12 bytes a weight whole at stage 0 (120 GB), and 2 + 2 + 12/64
    at stage 1, 2 + (2 + 12)/64 at stage 2, (2 + 2 + 12)/64 at stage 3 (the paper's 31.4,
    16.6 and 1.9 GB)."""
    from models.memory import model_state

    params = 7.5e9
    gb = [model_state(params, params, stage, 64, "bf16").total / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.40625, 16.640625, 1.875])
    lora = model_state(params, 0.01 * params, 3, 8, "bf16")  # adapters: their state only
    assert lora.weights == params * 2 / 8 and lora.optimizer == 0.01 * params * 12 / 8
    assert model_state(params, params, 3, 8, "fp32").total == params * 16 / 8  # fp32: no master copy
    assert model_state(100, 100, 2, 4, "bf16", grad_cache=True).grad_cache == 400  # fp32 sums, whole
    assert model_state(100, 100, 3, 4, "bf16", grad_cache=True).grad_cache == 200  # held on the weights


def test_a_model_that_cannot_fit_its_workers_fails_before_any_work_naming_the_bytes(tmp_path):
    """--train.memory_gib below the state of the model at the chosen stage: a ConfigError
    before the corpus is prepared; the same memory at ZeRO-3 across enough workers passes."""
    from models.memory import model_state, parameter_counts
    from pipeline.core.errors import ConfigError
    from pipeline.training import finetune
    from pipeline.training.engine import check_model_memory
    from tests.helpers import retrieval_collection, sample_texts, save_tiny_decoder

    init = save_tiny_decoder(str(tmp_path / "qwen2"), "qwen2", sample_texts(200))
    params, trainable = parameter_counts(AutoModel.from_pretrained(init))
    at_stage2 = model_state(params, trainable, 2, 2, "fp32").total
    collection = retrieval_collection(tmp_path / "data", 30, 10, 5)
    cfg = finetune.FinetuneConfig()
    cfg.model.init, cfg.corpus.input, cfg.corpus.output = init, collection["corpus"], str(tmp_path / "prepared")
    cfg.data.queries, cfg.data.qrels, cfg.data.negatives = collection["train_queries"], collection["train_qrels"], ""
    cfg.train = TrainConfig(
        output=str(tmp_path / "run"), num_workers=2, zero_stage=2, memory_gib=0.9 * at_stage2 / 2**30
    )
    with pytest.raises(
        ConfigError,
        match=r"does not fit --train.memory_gib: .* need [\d.]+ GiB per worker in fp32 at ZeRO stage 2 across 2 worker",
    ) as caught:
        finetune.run_finetuning(cfg)
    assert f"{params / 1e6:,.1f}M weights" in str(caught.value)
    assert not (tmp_path / "prepared").exists()  # before any work
    cfg.train.zero_stage = 3  # weights, gradients and AdamW's state halved across the 2 workers
    check_model_memory(AutoModel.from_pretrained(init), cfg.train, 2, 0.9 * at_stage2, "--train.memory_gib")
