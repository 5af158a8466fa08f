"""Every pre-training method on every supported family: BERT, RoBERTa (byte-level BPE), XLM-R,
ModernBERT (BPE) and DeBERTa-v2 (SentencePiece), as tiny random models with tokenizers
trained on the bundled sample. The methods reach the family's internals only through
``models.backbone.family``; these tests pin that wiring down per family."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModel

from models.backbone import FAMILIES, BackboneConfig, build_mlm, family
from models.condenser import Condenser
from models.framing import Framing
from models.masking import MaskingVocab, select_words, word_ids
from models.method import PlainEngine
from pipeline.data.shard_tokenizing import continuation_table, word_piece_counts
from pipeline.training.pretrain import METHODS, PretrainConfig, PretrainTask
from tests.helpers import (
    FAMILY_TOKENIZERS,
    assert_same_loss_and_gradients,
    sample_texts,
    save_tiny_family,
    train_tokenizer,
)

MAX_LEN = 32


@pytest.fixture(scope="module", params=sorted(FAMILY_TOKENIZERS))
def backbone(request, tmp_path_factory):
    """(checkpoint folder, its tokenizer, model_type)."""
    folder = str(tmp_path_factory.mktemp(request.param))
    return folder, save_tiny_family(folder, request.param, sample_texts()), request.param


def stream_arrays(tokenizer, texts: list[str], span_pairs: bool, width: int = MAX_LEN) -> dict[str, np.ndarray]:
    """A micro-batch as the stream yields it: ``[CLS] ids [SEP]`` rows (cut to MAX_LEN,
    framed at ``width``) and their lengths; coCondenser's as (b, 2, width) pairs of spans
    (each text's two halves)."""
    tokens = [np.asarray(t, np.int32) for t in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if span_pairs:
        tokens = [half for t in tokens for half in np.array_split(t, 2)]
    chunks = [t[: MAX_LEN - 2] for t in tokens]
    ids, lengths = Framing.bert(tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id).frame(
        chunks, width
    )
    if span_pairs:
        return {"input_ids": ids.reshape(-1, 2, width), "length": lengths.reshape(-1, 2)}
    return {"input_ids": ids, "length": lengths}


def method_task(folder: str, tokenizer, method: str) -> PretrainTask:
    """``method`` on the family's tiny checkpoint, from scratch (no Condenser head to warm
    start coCondenser); SimLM's frozen generator is that same random MLM (any with the
    corpus's vocabulary will do)."""
    method_cfg = getattr(PretrainConfig(), method)
    if method == "cocondenser":
        method_cfg.head = ""
    if method == "simlm":
        method_cfg.generator = folder
    return PretrainTask(method, method_cfg, BackboneConfig(init=folder), folder, len(tokenizer))


def loss_and_gradients(task: PretrainTask, model, arrays: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """One backward of the stream's ``arrays`` from zeroed gradients: (loss, gradients)."""
    model.zero_grad()
    batch = task.make_batch(arrays, torch.Generator().manual_seed(0))
    loss, _ = task.backward(PlainEngine(model), batch)
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_on_the_family_and_exports_a_checkpoint_automodel_loads(backbone, method, tmp_path):
    folder, tokenizer, model_type = backbone
    task = method_task(folder, tokenizer, method)
    torch.manual_seed(0)
    model = task.build_model()
    assert type(model.lm).__name__.lower().startswith(model_type.replace("-", ""))  # XLMRobertaForMaskedLM, ...
    texts = sample_texts(40)[20:28]
    batch = task.make_batch(stream_arrays(tokenizer, texts, method == "cocondenser"), torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(8):  # the same corrupted batch: a working model fits it
        optimizer.zero_grad()
        loss, _ = task.backward(PlainEngine(model), batch)
        optimizer.step()
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses

    paths = task.export(model.eval(), str(tmp_path / "export"))
    loaded = AutoModel.from_pretrained(paths["export_dir"]).eval()
    assert type(loaded) is type(family(model.lm).base(model.lm))
    ids = torch.as_tensor(stream_arrays(tokenizer, texts[:3], False)["input_ids"]).long()
    mask = (ids != tokenizer.pad_token_id).long()
    with torch.no_grad():
        expected = family(model.lm).base(model.lm)(input_ids=ids, attention_mask=mask).last_hidden_state
        exported = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_sdpa_attention_equals_eager_in_loss_and_gradients(backbone, method):
    """Every family that has it trains through ``scaled_dot_product_attention`` by default
    (the Condenser head and SimLM's decoder too: their layers read the backbone's config),
    and on padded rows it gives eager attention's loss and gradients. DeBERTa-v2 has only
    its own (eager) attention."""
    folder, tokenizer, model_type = backbone
    task = method_task(folder, tokenizer, method)
    torch.manual_seed(0)
    model = task.build_model().eval()  # no dropout: eager and SDPA would draw it differently
    assert model.lm.config._attn_implementation == ("eager" if model_type == "deberta-v2" else "sdpa")
    texts = sample_texts(40)[20:28]
    arrays = stream_arrays(tokenizer, texts, method == "cocondenser")
    assert (arrays["length"] < MAX_LEN).any()  # padded rows: the masks are exercised

    default = loss_and_gradients(task, model, arrays)
    assert len(default[1]) > 10
    model.lm.set_attn_implementation("eager")
    assert_same_loss_and_gradients(default, loss_and_gradients(task, model, arrays))


def test_span_pairs_cut_to_their_longest_span_give_the_full_widths_loss_and_gradients(backbone):
    """The stream frames coCondenser's spans at max_len (80-token spans in 128 by default);
    ``make_batch`` cuts every row to the batch's longest span, rounded up to 8, so no layer
    computes on columns that are padding in every row. The same spans, with the same
    masked tokens, padded back to the full width, give the same loss and gradients."""
    folder, tokenizer, _ = backbone
    cfg = PretrainConfig()
    cfg.cocondenser.head = ""
    cfg.cocondenser.pack_spans = False
    task = PretrainTask("cocondenser", cfg.cocondenser, BackboneConfig(init=folder), folder, len(tokenizer))
    torch.manual_seed(0)
    model = task.build_model().eval()  # no dropout: its draw depends on the width
    width = 3 * MAX_LEN
    arrays = stream_arrays(tokenizer, sample_texts(40)[20:28], span_pairs=True, width=width)
    cut = task.make_batch(arrays, torch.Generator().manual_seed(0))
    longest = int(arrays["length"].max())
    assert cut["input_ids"].shape[1] == -(-longest // 8) * 8 < width
    assert (cut["labels"] >= 0).any() and (arrays["length"] < longest).any()
    fill = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": -100}
    assert {k for k, v in cut.items() if v.dim() == 2} == set(fill)
    padded = {
        k: torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill[k]) if k in fill else v
        for k, v in cut.items()
    }

    def loss_and_grads(batch):
        model.zero_grad()
        loss, _ = task.backward(PlainEngine(model), batch)
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_same_loss_and_gradients(loss_and_grads(cut), loss_and_grads(padded))


def test_packed_span_pairs_give_the_cut_span_pairs_loss_and_gradients(backbone):
    """Packed several to a row (the default), a family's span pairs give the loss and
    gradients of the same spans a row each; a family that cannot pack says so and cuts."""
    folder, tokenizer, model_type = backbone
    arrays = stream_arrays(tokenizer, sample_texts(40)[20:28], span_pairs=True)

    def loss_and_grads(pack_spans: bool):
        cfg = PretrainConfig()
        cfg.cocondenser.head, cfg.cocondenser.pack_spans = "", pack_spans
        task = PretrainTask("cocondenser", cfg.cocondenser, BackboneConfig(init=folder), folder, len(tokenizer))
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = task.build_model().eval()
        batch = task.make_batch(arrays, torch.Generator().manual_seed(0))
        loss, _ = task.backward(PlainEngine(model), batch)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return (float(loss), grads), batch, [str(w.message) for w in caught]

    cut, _, _ = loss_and_grads(False)
    packed, batch, warned = loss_and_grads(True)
    if FAMILIES[model_type].packs:
        assert batch["input_ids"].shape[0] < 2 * len(arrays["length"])  # spans share rows
        assert not any("cannot pack" in w for w in warned)
    else:
        assert "segments" not in batch and any("cannot pack" in w for w in warned)
    assert_same_loss_and_gradients(packed, cut)


@pytest.mark.parametrize("skip_from", [1, 3])
def test_the_condenser_head_reads_late_cls_then_the_early_layers_tokens(backbone, skip_from):
    """A hook on the first head layer: its input is the last layer's CLS followed by the
    token states after layer ``skip_from`` (and no other layer's)."""
    folder, tokenizer, _ = backbone
    torch.manual_seed(0)
    mlm = build_mlm(BackboneConfig(init=folder), len(tokenizer))
    model = Condenser(mlm, n_head_layers=2, skip_from=skip_from).eval()
    captured = {}

    def record(module, args, kwargs) -> None:
        captured["input"] = args[0] if args else kwargs["hidden_states"]

    hook = model.head[0].register_forward_pre_hook(record, with_kwargs=True)
    ids = torch.as_tensor(stream_arrays(tokenizer, sample_texts(4), False)["input_ids"]).long()
    mask = (ids != tokenizer.pad_token_id).long()
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    with torch.no_grad():
        out = model(ids, mask, labels)
        ref = family(mlm).base(mlm)(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hook.remove()
    head_in = captured["input"]
    torch.testing.assert_close(head_in[:, 0], ref.last_hidden_state[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(head_in[:, 1:], ref.hidden_states[skip_from][:, 1:], rtol=0, atol=1e-6)
    for other, states in enumerate(ref.hidden_states):
        if other != skip_from:
            assert (states[:, 1:] - head_in[:, 1:]).abs().max() > 1e-3
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_family_encodes_held_in_half_precision_close_to_fp32(backbone, precision):
    """``--encoder.precision fp16|bf16`` casts the model's weights (no autocast to smooth
    over a module that makes its own fp32 tensors): each family's vectors come out fp32,
    within cosine 0.999 of fp32 encoding, from weights really held in half precision."""
    from pipeline.retrieval.encode import EncoderSettings, local_encoder

    folder, _, _ = backbone
    texts = sample_texts(16)
    vectors = {}
    for p in ("fp32", precision):
        encoder = local_encoder(EncoderSettings(model=folder, pooling="mean", similarity="cos", precision=p))
        assert {w.dtype for w in encoder.model.parameters()} == {encoder.dtype}
        vectors[p] = encoder.encode_texts(texts, MAX_LEN, tower="passage")
    half, full = vectors[precision], vectors["fp32"]
    assert half.dtype == np.float32 and not np.array_equal(half, full)
    assert (half * full).sum(1).min() > 0.999


def test_an_unsupported_family_is_named():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported: pre-training takes bert, roberta"):
        family("gpt2")


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "sentencepiece"])
def test_whole_word_masking_groups_the_pieces_the_tokenizer_calls_one_word(kind, tmp_path):
    """Word boundaries learned from the tokenizer's ``word_ids`` on 400 verses (as corpus
    preparation does), checked on 200 others against ``word_ids`` itself. WordPiece and
    SentencePiece mark every piece as a start or a continuation, so the grouping is exact;
    a byte-level BPE piece can start a word after punctuation (the ``s`` of ``God’s``) and
    continue others (and a lone ``Ġ`` piece joins the next), and the table takes each
    piece's majority role. The ``##`` rule alone gets BPE and SentencePiece wrong: every
    piece would be a word."""
    texts = sample_texts(600)
    tokenizer = train_tokenizer(str(tmp_path), kind, texts[:400])
    table = continuation_table(
        word_piece_counts(tokenizer(texts[:400], add_special_tokens=False).encodings, len(tokenizer))
    )
    learned, marker_only = MaskingVocab.from_tokenizer(tokenizer, table), MaskingVocab.from_tokenizer(tokenizer)

    def agreement(vocab: MaskingVocab) -> float:
        same = total = 0
        for text in texts[400:]:
            encoding = tokenizer(text, add_special_tokens=False)
            ours = word_ids(torch.tensor([encoding["input_ids"]]), vocab)[0].tolist()
            theirs = encoding.word_ids()
            for i in range(1, len(ours)):
                if min(ours[i - 1], ours[i]) < 0:  # a special token (<unk>): never masked
                    continue
                same += (ours[i] == ours[i - 1]) == (theirs[i] == theirs[i - 1])
                total += 1
        return same / total

    measured = agreement(learned)
    if kind == "bpe":  # measured 0.988 with this 400-piece vocabulary
        assert measured > 0.98, measured
    else:
        assert measured == 1.0
    if kind != "wordpiece":
        assert agreement(marker_only) < 0.9

    # Selection takes a word whole: every piece of a selected word, none of the others.
    ids = torch.tensor([tokenizer(texts[450], add_special_tokens=False)["input_ids"]])
    selected = select_words(ids, learned, 0.5, torch.Generator().manual_seed(0))[0]
    words = word_ids(ids, learned)[0]
    for word in words.unique().tolist():
        assert selected[words == word].unique().numel() == 1


@pytest.mark.parametrize("multiple", [1, 7, 64])
def test_the_vocabulary_projection_padded_gives_the_heads_own_logits_and_gradients(backbone, multiple):
    """On a GPU the MLM projection runs on a vocabulary padded to a multiple of 64 (aligned
    rows for its fast kernels): the logits must be the head's own, unpadded, and the
    gradients of a loss on them those of the head's own forward."""
    folder, tokenizer, model_type = backbone
    torch.manual_seed(0)
    mlm = build_mlm(BackboneConfig(init=folder), len(tokenizer)).eval()
    adapter = family(mlm)
    ids = torch.tensor([tokenizer("in the beginning God created the heaven and the earth")["input_ids"]] * 3)
    labels = torch.randint(0, mlm.config.vocab_size, (ids.numel(),))

    def logits_and_grads(padded: bool):
        mlm.zero_grad()
        states = adapter.base(mlm)(input_ids=ids).last_hidden_state.flatten(0, 1)
        logits = adapter.mlm_logits(mlm, states, multiple) if padded else mlm(input_ids=ids).logits.flatten(0, 1)
        torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in mlm.named_parameters() if p.grad is not None}

    (padded, padded_grads), (own, own_grads) = logits_and_grads(True), logits_and_grads(False)
    assert padded.shape == own.shape == (ids.numel(), mlm.config.vocab_size)
    torch.testing.assert_close(padded, own, rtol=0, atol=1e-5)
    assert padded_grads.keys() == own_grads.keys() and len(own_grads) > 10
    for name, grad in own_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_gpu_pads_the_vocabulary_projection_and_a_cpu_does_not(monkeypatch):
    """What the vocabulary projection's shape is, per device: padded to 64 rows on CUDA
    only (spied on with CPU standing in for CUDA, as this machine has no GPU)."""
    from models import backbone as backbone_module

    assert backbone_module.VOCAB_MULTIPLE == {"cuda": 64}
    mlm = build_mlm(BackboneConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), 100)
    shapes = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or real(x, w, b)
    )
    states = torch.randn(5, 16)
    assert family(mlm).mlm_logits(mlm, states).shape == (5, 100)
    monkeypatch.setitem(backbone_module.VOCAB_MULTIPLE, "cpu", 64)
    assert family(mlm).mlm_logits(mlm, states).shape == (5, 100)
    assert [shape for shape in shapes if shape[0] >= 100] == [(100, 16), (128, 16)]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_has_the_same_loss_and_gradients_with_the_vocabulary_padded(backbone, method, monkeypatch):
    """The methods' losses (masked positions only, per sequence, a batch with none) with the
    projection padded as a GPU runs it, against unpadded, on this CPU."""
    from models import backbone as backbone_module

    folder, tokenizer, _ = backbone
    task = method_task(folder, tokenizer, method)
    torch.manual_seed(0)
    model = task.build_model().eval()
    arrays = stream_arrays(tokenizer, sample_texts(40)[20:28], method == "cocondenser")
    unpadded = loss_and_gradients(task, model, arrays)
    monkeypatch.setitem(backbone_module.VOCAB_MULTIPLE, "cpu", 64 if len(tokenizer) % 64 else 7)
    assert_same_loss_and_gradients(unpadded, loss_and_gradients(task, model, arrays))
