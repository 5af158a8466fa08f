"""Decoder LLMs as retrievers: framing with the EOS, last-token pooling, LoRA on their
projections, and an export that sentence-transformers reads as raydense encodes.

Each family is a tiny random model built from a config here, with a tokenizer trained on
the bundled sample by the ``tokenizers`` library, framed as the family's own is
(tests/helpers.py: ``save_tiny_decoder``).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from models.backbone import DECODER_TYPES
from models.biencoder import BiEncoder, BiEncoderConfig, ContrastiveObjective, folder_pooling, pool
from models.framing import Framing
from models.lora import LoraSettings
from tests.helpers import make_tokenizer_dir, ours_and_sentence_transformers, sample_texts, save_tiny_decoder


@pytest.fixture(scope="module", params=DECODER_TYPES)
def decoder(request, tmp_path_factory) -> str:
    return save_tiny_decoder(str(tmp_path_factory.mktemp(request.param)), request.param, sample_texts(300))


def test_the_framing_is_the_tokenizers_own_with_its_eos_appended_once(decoder, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(decoder)
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    own = Framing.of(tokenizer)
    assert own.head == ((bos,) if tokenizer.bos_token else ())  # Llama and Mistral put <s> first, Qwen2 nothing
    assert own.tail == ()
    last = Framing.of(tokenizer, last_token=True)
    assert (last.head, last.tail) == (own.head, (eos,))
    ids, lengths = last.frame_truncated([[7, 8, 9, 10, 11]], max_len=6)
    assert ids[0, : lengths[0]].tolist() == [*own.head, 7, 8, 9, 10, 11][: 6 - 1] + [eos]  # the text cut, not the EOS

    # A tokenizer whose template ends with the EOS already (an export's) gets it once.
    last.save_as_template(tokenizer, str(tmp_path))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded("In the beginning")["input_ids"][-1] == eos
    assert Framing.of(reloaded) == Framing.of(reloaded, last_token=True) == last


def test_an_encoders_framing_is_cls_and_sep_whatever_the_pooling(tmp_path):
    tokenizer = make_tokenizer_dir(str(tmp_path), texts=sample_texts(100))
    bert = Framing.bert(tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id)
    assert Framing.of(tokenizer) == Framing.of(tokenizer, last_token=True) == bert  # no EOS: [SEP] ends it


def test_last_token_pooling_equals_the_last_tokens_state_under_left_and_right_padding(decoder):
    """Each row's vector is the hidden state, computed alone and unpadded, of its last
    token; a right-padded and a left-padded batch both give it (Llama, Mistral and Qwen2's
    rotary positions are relative, so a left pad's shift changes nothing)."""
    encoder = AutoModel.from_pretrained(decoder).eval()
    model = BiEncoder(encoder, None, BiEncoderConfig(pooling="last", length_buckets=1))
    rows = [[5, 9, 14, 30, 2], [7, 3], [11, 12, 13]]
    width = max(map(len, rows))
    right = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    left = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    right_mask, left_mask = (right != 0).long(), (left != 0).long()
    with torch.no_grad():
        alone = torch.stack([encoder(input_ids=torch.tensor([r])).last_hidden_state[0, -1] for r in rows])
        from_right = model.encode_passage(right, right_mask)
        from_left = model.encode_passage(left, left_mask)
        hidden = torch.randn(3, width, 4)
    torch.testing.assert_close(from_right, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_left, alone, atol=1e-5, rtol=0)
    # pool() by hand: the last unmasked position on either side
    torch.testing.assert_close(pool(hidden, right_mask, "last"), hidden[[0, 1, 2], [4, 1, 2]])
    torch.testing.assert_close(pool(hidden, left_mask, "last"), hidden[:, -1])


def test_auto_pooling_of_a_decoder_is_the_last_token(decoder):
    assert folder_pooling(decoder) == "last"


def test_lora_adapts_a_decoders_attention_and_mlp_projections_and_merges_at_export(decoder, tmp_path):
    """Adapters on q/k/v/o and gate/up/down of every layer, nothing else trainable; a few
    steps leave every base weight bit-equal, and the merged export, loaded by ``AutoModel``
    without peft, gives the adapted model's vectors within 1e-5. The adapters alone are
    saved too when asked, as a folder peft loads over the initial checkpoint."""
    from peft import PeftModel

    cfg = BiEncoderConfig(pooling="last", similarity="cos", temperature=0.1, group_size=2)
    cfg.lora = LoraSettings(rank=4, alpha=8.0, save_adapter=True)
    torch.manual_seed(0)
    model = ContrastiveObjective(cfg, passage_max_len=24).build(decoder)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    ids = torch.randint(3, 200, (8, 12))
    mask = torch.ones_like(ids)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        queries, passages = model(ids[:4], mask[:4], ids, mask)
        loss = torch.nn.functional.cross_entropy(
            model.compute_similarity(queries, passages), torch.arange(4) * cfg.group_size
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name

    export = str(tmp_path / "export")
    model.save(export, decoder)
    plain = BiEncoder(AutoModel.from_pretrained(export).eval(), None, cfg)
    model.eval()
    with torch.no_grad():
        adapted_vectors, exported_vectors = model.encode_passage(ids, mask), plain.encode_passage(ids, mask)
        untrained = BiEncoder(AutoModel.from_pretrained(decoder).eval(), None, cfg).encode_passage(ids, mask)
        reloaded = PeftModel.from_pretrained(AutoModel.from_pretrained(decoder), os.path.join(export, "adapter"))
        via_peft = BiEncoder(reloaded.eval(), None, cfg).encode_passage(ids, mask)
    torch.testing.assert_close(exported_vectors, adapted_vectors, atol=1e-5, rtol=0)
    torch.testing.assert_close(via_peft, adapted_vectors, atol=1e-5, rtol=0)
    assert (exported_vectors - untrained).abs().max() > 1e-3  # the adapters did change it


def test_a_decoder_export_is_a_sentence_transformers_model_that_encodes_alike(decoder, tmp_path):
    """``SentenceTransformer(export)`` reads the last token of the EOS-terminated text with
    the prompts, and gives raydense's encoder's vectors: queries from text, passages from
    the corpus's token ids, long texts cut at the trained length. The export's own
    ``AutoTokenizer`` appends the EOS, once."""
    model_type = json.load(open(os.path.join(decoder, "config.json")))["model_type"]
    # A byte-level BPE (Qwen2) joins a prefix's trailing space to the first word, which
    # stored passage tokens lack: a passage prefix there ends without one (prefix_token_ids).
    passage_prefix = "passage:" if model_type == "qwen2" else "passage: "
    cfg = BiEncoderConfig(pooling="last", similarity="cos", query_prefix="query: ", passage_prefix=passage_prefix)
    export = str(tmp_path / "export")
    BiEncoder(AutoModel.from_pretrained(decoder), None, cfg).save(export, decoder, max_seq_length=24)

    texts = sample_texts(12)
    probe = texts[:6] + [" ".join(texts[6:12])]  # the last far longer than 24 tokens
    both = ours_and_sentence_transformers(export, probe, 24)
    (queries, passages), (their_queries, their_passages) = both["ours"], both["theirs"]
    np.testing.assert_allclose(their_passages, passages, atol=1e-5)
    np.testing.assert_allclose(their_queries, queries, atol=1e-5)
    assert both["prompts"] == {"query": "query: ", "document": passage_prefix}
    assert np.abs(queries - passages).max() > 1e-3  # the prompts are really there

    tokenizer = AutoTokenizer.from_pretrained(export)
    framed = tokenizer("query: In the beginning")["input_ids"]
    assert framed[-1] == tokenizer.eos_token_id and framed[-2] != tokenizer.eos_token_id


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_keeps_less_and_gives_the_same_gradients(decoder, lora):
    """With gradient checkpointing the backward keeps fewer bytes (models/memory.py's
    count, which sizes the cache's chunks) and gives the same loss and gradients."""
    from models.memory import saved_bytes

    results = []
    for checkpointing in (False, True):
        cfg = BiEncoderConfig(pooling="last", group_size=2, gradient_checkpointing=checkpointing)
        cfg.lora = LoraSettings(rank=4 if lora else 0)
        torch.manual_seed(0)
        model = ContrastiveObjective(cfg).build(decoder).train()
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # peft starts B at zero, which leaves A without a gradient
                torch.nn.init.normal_(p, std=0.2)
        ids = torch.randint(3, 200, (8, 24), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        kept = saved_bytes(functools.partial(model.encode_passage, ids, mask), model)
        queries, passages = model(ids[:4], mask[:4], ids, mask)
        loss = torch.nn.functional.cross_entropy(model.compute_similarity(queries, passages), torch.arange(4) * 2)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((kept, loss.item(), grads))
    (kept, loss, grads), (kept_checkpointed, loss_checkpointed, grads_checkpointed) = results
    assert kept_checkpointed < kept / 2
    assert loss_checkpointed == pytest.approx(loss, rel=1e-6)
    assert grads and sorted(grads) == sorted(grads_checkpointed)
    for name in grads:
        torch.testing.assert_close(grads_checkpointed[name], grads[name], atol=1e-6, rtol=1e-5)
