"""The other families through the real job path: corpus prepared with the family's
tokenizer (its word-start table recorded), a few steps on Ray Train + DeepSpeed, an export
that ``AutoModel`` loads. Each family runs a different method; every method runs on every
family in process (tests/test_backbones.py), and coCondenser on RoBERTa on two workers
(tests/test_cocondenser_ray.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_jsonl
from transformers import AutoModel

from models.backbone import BackboneConfig
from pipeline.core import storage
from pipeline.data.prepare import PrepareConfig
from pipeline.training.pretrain import PretrainConfig, StreamConfig, run_pretraining
from pipeline.training.train_config import TrainConfig
from tests.helpers import sample_texts, save_tiny_family

pytestmark = pytest.mark.ray

CASES = [("xlm-roberta", "condenser"), ("deberta-v2", "simlm"), ("modernbert", "mlm")]


@pytest.mark.parametrize("model_type,method", CASES)
def test_a_family_pre_trains_on_ray_and_exports_a_checkpoint_of_its_kind(model_type, method, tmp_path, ray_session):
    texts = sample_texts(120)
    init = str(tmp_path / "init")
    tokenizer = save_tiny_family(init, model_type, texts)
    cfg = PretrainConfig(method=method)
    docs = [{"_id": f"d{i}", "text": t} for i, t in enumerate(texts)]
    cfg.corpus = PrepareConfig(input=write_jsonl(tmp_path / "raw.jsonl", docs), output=str(tmp_path / "corpus"))
    cfg.data = StreamConfig(max_len=32)
    cfg.model = BackboneConfig(init=init)
    if method == "simlm":
        cfg.simlm.generator = init  # a frozen MLM with the corpus's vocabulary
    cfg.train = TrainConfig(output=str(tmp_path / "run"), num_workers=1, micro_batch_size=4, max_steps=3, lr=1e-3)
    summary = run_pretraining(cfg)

    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["final_loss"]))
    manifest = storage.read_json(str(tmp_path / "corpus" / "manifest.json"))
    assert manifest["vocab_size"] == len(tokenizer) and manifest["word_pieces"] == "word_pieces.json"
    loaded = AutoModel.from_pretrained(summary["export_dir"])
    assert loaded.config.model_type == model_type
    initial = AutoModel.from_pretrained(init).state_dict()
    moved = [k for k, v in loaded.state_dict().items() if not torch.equal(v, initial[k])]
    assert len(moved) >= len(initial) // 2  # it trained
