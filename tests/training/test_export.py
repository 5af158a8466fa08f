"""Every pre-training method exports a drop-in HF BERT, through the trainer's own task."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import synthetic_docs
from transformers import BertConfig, BertForMaskedLM

from models.backbone import load_module_state
from pipeline.training.pretrain import METHODS, PretrainConfig, PretrainTask
from tests.helpers import assert_drop_in_bert, make_tokenizer_dir, tiny_backbone_config
from tests.models.test_condenser import tokenized_batch


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok_dir = str(tmp_path_factory.mktemp("tok"))
    return tok_dir, make_tokenizer_dir(tok_dir)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_exports_a_drop_in_bert_and_its_extra_weights(method, tokenizer, tmp_path):
    tok_dir, tok = tokenizer
    cfg = PretrainConfig()
    method_cfg = getattr(cfg, method)
    if method == "cocondenser":
        method_cfg.head = ""
    if method == "simlm":  # a frozen generator with the same vocabulary
        method_cfg.generator = str(tmp_path / "generator")
        BertForMaskedLM(
            BertConfig(
                vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32
            )
        ).save_pretrained(method_cfg.generator)
    task = PretrainTask(method, method_cfg, tiny_backbone_config(), tok_dir, len(tok))
    torch.manual_seed(0)
    model = task.build_model().eval()
    ids, mask = tokenized_batch(tok)
    with torch.no_grad():
        expected = model.lm.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]

    paths = task.export(model, str(tmp_path / "export"))
    assert_drop_in_bert(paths["export_dir"], ids, mask, expected)
    assert os.path.isfile(os.path.join(paths["export_dir"], "tokenizer.json"))
    extra = {
        "condenser": "condenser_head.safetensors",
        "cocondenser": "condenser_head.safetensors",
        "simlm": "simlm_decoder.safetensors",
        "mlm": None,
    }[method]
    if extra:  # the head or decoder, so pre-training can continue
        state, meta = load_module_state(paths["head_path"])
        assert os.path.basename(paths["head_path"]) == extra and state and meta
    else:
        assert "head_path" not in paths


def test_loading_our_exports_prints_no_load_report_and_a_real_gap_one_warning(tmp_path, capfd):
    """An MLM export read as an encoder carries an MLM head and no pooler: expected, silent
    (transformers would print a multi-line LOAD REPORT). A checkpoint missing an encoder
    weight is named in one warning."""
    import warnings

    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    from models.backbone import export_backbone, load_pretrained
    from tests.helpers import tiny_mlm

    export_backbone(tiny_mlm(), str(tmp_path / "export"))
    export = str(tmp_path / "export")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_pretrained(AutoModel, export)
    out, err = capfd.readouterr()
    assert not caught and "LOAD REPORT" not in out + err

    weights = load_file(f"{export}/model.safetensors")
    del weights[next(k for k in weights if "encoder.layer.0.attention.self.query.weight" in k)]
    save_file(weights, f"{export}/model.safetensors", metadata={"format": "pt"})
    with pytest.warns(
        UserWarning, match=r"1 weights not in the checkpoint, initialised at random: .*layer\.0\.attention"
    ):
        load_pretrained(AutoModel, export)
    assert "LOAD REPORT" not in "".join(capfd.readouterr())


@pytest.mark.parametrize("pooling,similarity,prefixed", [("mean", "cos", True), ("cls", "dot", False)])
def test_a_retriever_export_is_a_sentence_transformers_model_that_encodes_alike(
    tmp_path, pooling, similarity, prefixed
):
    """``SentenceTransformer(export)`` loads the fine-tuned retriever with its pooling,
    normalisation, trained passage length and prefixes (as prompts), and gives raydense's
    encoder's vectors: queries from text, passages from the corpus's token ids, long texts
    included (both truncate at that length, prefix included)."""
    from transformers import AutoModel

    from models.biencoder import BiEncoder, BiEncoderConfig
    from pipeline.retrieval.encode import Encoder, EncoderSettings
    from tests.helpers import ours_and_sentence_transformers, save_tiny_bert

    texts = [d["text"] for d in synthetic_docs(40, seed=2)]
    init = save_tiny_bert(str(tmp_path / "init"), texts)
    # E5-style prefixes of words the tiny vocabulary knows (an unknown word would be [UNK] in both)
    words = texts[0].split()
    query_prefix, passage_prefix = (f"{words[0]}: ", f"{words[1]} {words[2]}: ") if prefixed else ("", "")
    cfg = BiEncoderConfig(
        pooling=pooling, similarity=similarity, query_prefix=query_prefix, passage_prefix=passage_prefix
    )
    export = str(tmp_path / "export")
    BiEncoder(AutoModel.from_pretrained(init), None, cfg).save(export, init, max_seq_length=24)

    probe = texts[:6] + [" ".join(texts[6:12])]  # the last far longer than 24 tokens
    both = ours_and_sentence_transformers(export, probe, 24)
    (queries, passages), (their_queries, their_passages) = both["ours"], both["theirs"]
    assert both["prompts"] == {k: v for k, v in (("query", query_prefix), ("document", passage_prefix)) if v}
    assert their_passages.shape == passages.shape
    np.testing.assert_allclose(their_passages, passages, atol=1e-5)
    np.testing.assert_allclose(their_queries, queries, atol=1e-5)
    if query_prefix:  # the prefixes change the vectors: they are really there
        assert np.abs(queries - passages).max() > 1e-3
        unprefixed = Encoder(EncoderSettings(model=export, query_prefix="", batch_size=4), export)
        assert np.abs(unprefixed.encode_texts(probe, 24, tower="query") - queries).max() > 1e-3
