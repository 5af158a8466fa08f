"""Small, fast builders shared by the model tests.

Everything here is deterministic and tiny enough to run in milliseconds on a CPU:

- :func:`tiny_vocab` / :func:`tiny_masking_vocab`: a WordPiece-style token list with
  BERT's special tokens at the usual ids, and the :class:`~models.masking.MaskingVocab`
  built from it.
- :func:`random_word_batch`: (input_ids, attention_mask) batches of whole words
  (a start piece plus ``##`` continuations) framed as ``[CLS] ... [SEP] [PAD]*``, with
  the word boundaries returned so tests can check whole-word properties.
- :func:`tiny_bert_config`, :func:`tiny_backbone_config`, :func:`tiny_mlm`: a tiny BERT
  (hidden 32, 4 layers, 2 heads, no dropout by default).
- :func:`make_tokenizer_dir`: a real HF tokenizer directory trained with
  :func:`pipeline.data.tokenizer.train_wordpiece` on generated text (for export tests).
"""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from pipeline.core import sealed, storage
from tests.pace import bound_s

# BERT's special tokens, at the ids a BERT vocabulary puts them.
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SPECIAL_IDS = [PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID]

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were which "
    "this be or has had not but have also its their first after one two new who they been "
    "more other into time year city film world during"
).split()
_CONTINUATIONS = (
    "##s ##ed ##ing ##er ##ly ##ion ##al ##ic ##es ##en ##ity ##ment ##ous ##ive ##ness "
    "##a ##e ##i ##o ##y ##ter ##ist ##ize ##able ##ful"
).split()


def tiny_vocab() -> list[str]:
    """A WordPiece-style vocabulary: specials at ids 0-4, then words, then ``##`` pieces.

    Its size (80) deliberately differs from every dimension of :func:`tiny_bert_config`,
    so a tensor with a vocab-sized axis can be told apart from any other.
    """
    return SPECIAL_TOKENS + _WORDS + _CONTINUATIONS


def tiny_masking_vocab(tokens: list[str] | None = None):
    """The :class:`MaskingVocab` of ``tokens`` (default :func:`tiny_vocab`)."""
    from models.masking import MaskingVocab

    tokens = tokens if tokens is not None else tiny_vocab()
    return MaskingVocab(tokens, special_ids=SPECIAL_IDS, mask_token_id=MASK_ID)


def start_ids(tokens: list[str] | None = None) -> list[int]:
    """Ids of word-start pieces (non-special, not ``##``)."""
    tokens = tokens if tokens is not None else tiny_vocab()
    return [i for i, t in enumerate(tokens) if i not in SPECIAL_IDS and not t.startswith("##")]


def continuation_ids(tokens: list[str] | None = None) -> list[int]:
    """Ids of ``##`` continuation pieces."""
    tokens = tokens if tokens is not None else tiny_vocab()
    return [i for i, t in enumerate(tokens) if t.startswith("##")]


@dataclass
class WordBatch:
    """A generated batch. ``words`` lists, per row, the (start, end) piece span of each word
    (end exclusive). Spans never include special tokens or padding."""

    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long, 0 on padding
    words: list[list[tuple[int, int]]]


def random_word_batch(
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    tokens: list[str] | None = None,
    max_continuations: int = 3,
    pad_rows: float = 0.3,
    inner_sep: float = 0.3,
) -> WordBatch:
    """``[CLS] w w ... [SEP] [PAD]*`` rows of whole words, as the training stream frames them.

    Each word is a start piece followed by 0..``max_continuations`` ``##`` pieces, and a
    word is never cut by the end of the row. A fraction ``pad_rows`` of the rows is
    shorter than ``seq_len`` and padded; a fraction ``inner_sep`` also holds a [SEP]
    between two packed documents.
    """
    rng = random.Random(seed)
    starts, conts = start_ids(tokens), continuation_ids(tokens)
    ids = torch.full((batch_size, seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
    all_words = []
    for b in range(batch_size):
        length = rng.randint(seq_len // 4, seq_len - 1) if rng.random() < pad_rows else seq_len
        sep_at = rng.randint(3, length - 3) if rng.random() < inner_sep else None
        row, words = [CLS_ID], []
        while True:
            if sep_at is not None and len(row) >= sep_at:
                row.append(SEP_ID)
                sep_at = None
            word = [rng.choice(starts)] + [rng.choice(conts) for _ in range(rng.randint(0, max_continuations))]
            if len(row) + len(word) > length - 1:
                break
            words.append((len(row), len(row) + len(word)))
            row.extend(word)
        row.append(SEP_ID)
        n = len(row)
        ids[b, :n] = torch.tensor(row)
        mask[b, :n] = 1
        all_words.append(words)
    return WordBatch(ids, mask, all_words)


# -- tiny BERT ----------------------------------------------------------------------------

TINY_SIZES = dict(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64, max_position=64)


def tiny_bert_config(vocab_size: int = len(tiny_vocab()), initializer_range: float = 0.02, **overrides):
    """A ``BertConfig`` for a tiny BERT.

    ``overrides`` take the :data:`TINY_SIZES` keys plus ``dropout`` (hidden and attention
    dropout, default 0). A larger ``initializer_range`` (e.g. 0.2) gives a random model
    whose MLM logits are far from uniform, which makes loss comparisons discriminative.
    """
    from transformers import BertConfig

    sizes = {**TINY_SIZES, "dropout": 0.0, **overrides}
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        intermediate_size=sizes["intermediate_size"],
        max_position_embeddings=sizes["max_position"],
        hidden_dropout_prob=sizes["dropout"],
        attention_probs_dropout_prob=sizes["dropout"],
        pad_token_id=PAD_ID,
        initializer_range=initializer_range,
    )


def tiny_backbone_config(**overrides):
    """A :class:`models.backbone.BackboneConfig` for the same tiny BERT (random init)."""
    from models.backbone import BackboneConfig

    return BackboneConfig(**{**TINY_SIZES, "dropout": 0.0, **overrides})


def tiny_mlm(vocab_size: int = len(tiny_vocab()), seed: int = 0, initializer_range: float = 0.02, **overrides):
    """A randomly initialised tiny ``BertForMaskedLM`` (tied decoder, as every BERT MLM).

    Built from :func:`tiny_bert_config` with the global RNG seeded by ``seed``, so the
    same arguments give the same weights. (For the project's own builder, use
    ``models.backbone.build_mlm(tiny_backbone_config(), vocab_size)``.)
    """
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(tiny_bert_config(vocab_size, initializer_range=initializer_range, **overrides))


# -- a real tokenizer ----------------------------------------------------------------------


def generated_texts(n: int = 400, seed: int = 0) -> list[str]:
    """English-like sentences built from a fixed word list (enough to train a WordPiece)."""
    rng = random.Random(seed)
    words = _WORDS + [
        w + s for w in ("play", "train", "model", "read", "walk", "search") for s in ("", "s", "ed", "ing", "er")
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 25))) + "." for _ in range(n)]


def make_tokenizer_dir(out_dir: str, vocab_size: int = 120, texts: list[str] | None = None):
    """Train a tiny WordPiece tokenizer into ``out_dir``; returns the ``BertTokenizerFast``.

    The vocabulary may come out smaller than ``vocab_size`` on little text: size models
    with ``len(tokenizer)``.
    """
    from pipeline.data.tokenizer import train_wordpiece

    return train_wordpiece(
        texts if texts is not None else generated_texts(), out_dir, vocab_size=vocab_size, min_frequency=1
    )


def assert_drop_in_bert(export_dir: str, input_ids, attention_mask, expected_cls, atol: float = 1e-5) -> None:
    """``export_dir`` loads as a plain HF ``BertModel`` whose CLS output is ``expected_cls``,
    and as a ``BertForMaskedLM`` with its decoder still tied to the word embeddings."""
    from transformers import AutoModel, AutoModelForMaskedLM, BertForMaskedLM, BertModel

    bert = AutoModel.from_pretrained(export_dir).eval()
    assert type(bert) is BertModel
    with torch.no_grad():
        cls = bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
    assert (cls - expected_cls).abs().max() < atol
    mlm = AutoModelForMaskedLM.from_pretrained(export_dir)
    assert type(mlm) is BertForMaskedLM
    assert mlm.cls.predictions.decoder.weight.data_ptr() == mlm.bert.embeddings.word_embeddings.weight.data_ptr()


# -- trainers outside DeepSpeed ---------------------------------------------------------------


class PlainEngine:
    """What a task's ``backward(engine, batch)`` needs of a DeepSpeed engine, in one process:
    calling it runs the module, and ``backward`` is plain autograd."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)

    def backward(self, loss):
        loss.backward()


def assert_same_loss_and_gradients(
    result: tuple[float, dict[str, torch.Tensor]], reference: tuple[float, dict[str, torch.Tensor]]
) -> None:
    """Two ``(loss, {parameter: gradient})`` of one model computed two ways (e.g. SDPA and
    eager attention): the loss within 1e-5 relative, every gradient within fp32 noise."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5)


def save_tiny_bert(out_dir: str, texts: list[str], seed: int = 0, **config_overrides) -> str:
    """A random tiny ``BertModel`` checkpoint with its own WordPiece tokenizer trained on
    ``texts``: what ``--model.init`` points at in the trainers' Ray tests. It holds 128
    positions, as the jobs' default passage length asks (the jobs refuse a length past a
    model's positions)."""
    from transformers import BertModel

    tokenizer = make_tokenizer_dir(out_dir, texts=texts)
    torch.manual_seed(seed)
    config = tiny_bert_config(len(tokenizer), **{"max_position": 128, **config_overrides})
    BertModel(config).save_pretrained(out_dir)
    return out_dir


def retrieval_collection(folder, n_docs: int, n_train: int, n_dev: int) -> dict:
    """A BEIR collection of generated passages; query i is four words of passage i, its one
    positive, so that BM25 and training have signal. Train queries first, then dev."""
    texts = generated_texts(n_docs, seed=3)
    rng = random.Random(0)
    os.makedirs(folder, exist_ok=True)
    paths = {"corpus": os.path.join(folder, "corpus.jsonl")}
    with open(paths["corpus"], "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    for split, ids in (("train", range(n_train)), ("dev", range(n_train, n_train + n_dev))):
        paths[f"{split}_queries"] = os.path.join(folder, f"queries.{split}.jsonl")
        paths[f"{split}_qrels"] = os.path.join(folder, f"qrels.{split}.tsv")
        with open(paths[f"{split}_queries"], "w") as q, open(paths[f"{split}_qrels"], "w") as r:
            r.write("query-id\tcorpus-id\tscore\n")
            for i in ids:
                words = texts[i].split()
                q.write(json.dumps({"_id": f"q{i}", "text": " ".join(rng.sample(words, min(4, len(words))))}) + "\n")
                r.write(f"q{i}\td{i}\t1\n")
    return {"texts": texts, **paths}


def use_collection(data, collection: dict) -> None:
    """A workflow's ``data`` section pointed at a collection of :func:`retrieval_collection`'s shape."""
    from pipeline.core.sections import Queries

    data.corpus = collection["corpus"]
    data.train = Queries(collection["train_queries"], collection["train_qrels"])
    data.dev = Queries(collection["dev_queries"], collection["dev_qrels"])


def ir_measures_of_run(run_uri: str, qrels_uri: str) -> dict:
    """The job's metrics of a TREC run, computed by ir_measures itself from the files."""
    import ir_measures

    from pipeline.retrieval.metrics import JOB_MEASURES

    qrels = list(ir_measures.read_trec_qrels(_trec_qrels(qrels_uri)))
    run = list(ir_measures.read_trec_run(run_uri))
    values = ir_measures.calc_aggregate([ir_measures.parse_measure(m) for m in JOB_MEASURES.values()], qrels, run)
    return {name: values[ir_measures.parse_measure(m)] for name, m in JOB_MEASURES.items()}


def _trec_qrels(tsv: str) -> str:
    out = tsv + ".trec"
    with open(tsv) as f, open(out, "w") as o:
        next(f)
        for line in f:
            q, d, s = line.split()
            o.write(f"{q} 0 {d} {s}\n")
    return out


def read_trace_entries(run_dir: str) -> dict[str, list[tuple[int, int, list[int]]]]:
    """``rank<r>-attempt<a>`` -> its (micro_step, epoch, rows) entries, over every flushed part."""
    entries: dict[str, list] = {}
    for uri in sorted(storage.list_files(storage.join(run_dir, "trace"), ".json")):
        name = uri.rsplit("/", 1)[-1].split("-upto")[0]
        entries.setdefault(name, []).extend(tuple(e) for e in storage.read_json(uri))
    return entries


def rows_in_the_final_model(
    entries: dict[str, list[tuple[int, int, list[int]]]], restored_step: int
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """From the data trace of a run restarted once (:func:`read_trace_entries`), with one
    micro-step per step: {epoch: rows} the final model trained on (attempt 0's micro-batches
    before the restored checkpoint's step, the resumed attempt's from it; attempt 0's later
    ones died with it), and {epoch: rows} attempt 0 trained on before that checkpoint."""
    trained: dict[int, list[int]] = {}
    before_checkpoint: dict[int, list[int]] = {}
    for name, logged in entries.items():
        for micro_step, epoch, rows in logged:
            if name.endswith("attempt1"):
                assert micro_step >= restored_step
                trained.setdefault(epoch, []).extend(rows)
            elif micro_step < restored_step:
                trained.setdefault(epoch, []).extend(rows)
                before_checkpoint.setdefault(epoch, []).extend(rows)
    return trained, before_checkpoint


def drain_for_preemption(address: str, node_id: str, deadline_s: float) -> None:
    """Tell Ray the node will be taken away in ``deadline_s``, as the autoscaler (or KubeRay,
    or cluster/spot_notice.py) does when the cloud reclaims a spot instance; ``ray
    drain-node`` makes the same call."""
    import ray
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = ray._raylet.GcsClient(address=address).drain_node(
        node_id, reason, "spot reclaim (test)", deadline_ms
    )
    assert accepted, why


# What the tests' hand-made checkpoints are signed with (a run's own comes from seal_key).
SEAL_KEY = sealed.SealKey(b"the tests' checkpoint key", "tests.helpers.SEAL_KEY")

SIGTERM_HINT = "interrupted (SIGTERM): rerun the same command to resume"


def stopped_by_sigterm(job, timeout_s: float = 90) -> str:
    """Send a job's process (a ``subprocess.Popen`` with text pipes) SIGTERM and check that it
    stopped as Ctrl-C stops it: exit 143, the resume hint its last stderr line, no native
    stack dump (Ray's own handler printed ``*** SIGTERM received`` and aborted). Its stderr."""
    import signal

    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=bound_s(timeout_s))
    lines = [line for line in err.splitlines() if line.strip()]
    assert job.returncode == 143, err[-3000:]
    assert lines[-1] == SIGTERM_HINT, err[-3000:]
    assert "SIGTERM received" not in err, err[-3000:]
    return err


def is_killed(actor, within_s: float = 30.0) -> bool:
    """Whether ``actor`` is dead within ``within_s`` (on an idle machine; scaled to this one's
    pace): ``ray.kill`` returns before the actor is, so a call made just after it may still
    be answered."""
    import ray

    deadline = time.monotonic() + bound_s(within_s)
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.2)
    return False


def read_traces(run_dir: str) -> dict[str, dict[int, list[int]]]:
    """``rank<r>-attempt<a>`` -> {epoch: rows it trained on}."""
    traces = {}
    for name, entries in read_trace_entries(run_dir).items():
        for _, epoch, rows in entries:
            traces.setdefault(name, {}).setdefault(epoch, []).extend(rows)
    return traces


def pid_of(actor) -> int:
    """The process id of a Ray actor (running now)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda instance: os.getpid()))


def kill_process_of(actor) -> int:
    """SIGKILL the actor's process, as a lost node would end it, with no warning to Ray;
    returns the pid it had."""
    import signal

    pid = pid_of(actor)
    os.kill(pid, signal.SIGKILL)
    return pid


# -- other backbone families: tiny random models with tokenizers trained here ----------------

# model_type -> its tokenizer's kind: WordPiece, byte-level BPE or SentencePiece (Unigram)
FAMILY_TOKENIZERS = {
    "bert": "wordpiece",
    "roberta": "bpe",
    "xlm-roberta": "sentencepiece",
    "modernbert": "bpe",
    "deberta-v2": "sentencepiece",
}


def sample_texts(n: int = 400) -> list[str]:
    """The bundled sample's first verses: real text with punctuation."""
    import json

    from pipeline.core.sample import SAMPLE_CORPUS

    with open(SAMPLE_CORPUS) as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def train_tokenizer(out_dir: str, kind: str, texts: list[str], vocab_size: int = 400):
    """A ``PreTrainedTokenizerFast`` of ``kind`` trained on ``texts`` with the ``tokenizers``
    library (no download), saved to ``out_dir``: BERT's specials for WordPiece, RoBERTa's
    (``<s>``, ``</s>``, ...) for the others."""
    from tokenizers import ByteLevelBPETokenizer, SentencePieceUnigramTokenizer
    from transformers import PreTrainedTokenizerFast

    if kind == "wordpiece":
        return make_tokenizer_dir(out_dir, vocab_size=vocab_size, texts=texts)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    if kind == "bpe":
        trained = ByteLevelBPETokenizer()
        trained.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1, special_tokens=specials)
    else:
        trained = SentencePieceUnigramTokenizer()
        trained.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained._tokenizer,
        bos_token="<s>",
        cls_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def tiny_family_config(model_type: str, tokenizer):
    """A tiny config of ``model_type`` (4 layers, hidden 32, no dropout) for ``tokenizer``."""
    from transformers import AutoConfig

    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, num_attention_heads=2)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id
    )
    bert_like = dict(
        intermediate_size=64, max_position_embeddings=130, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    extra = {
        "bert": bert_like,
        "roberta": bert_like,
        "xlm-roberta": bert_like,
        "deberta-v2": dict(
            intermediate_size=64,
            max_position_embeddings=128,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        "modernbert": dict(
            intermediate_size=64,
            max_position_embeddings=128,
            global_attn_every_n_layers=3,
            local_attention=8,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            mlp_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
    }[model_type]
    return AutoConfig.for_model(model_type, **sizes, **ids, **extra)


def save_tiny_family(out_dir: str, model_type: str, texts: list[str], seed: int = 0):
    """A random tiny ``AutoModelForMaskedLM`` of ``model_type`` saved with its own tokenizer;
    returns the tokenizer."""
    from transformers import AutoModelForMaskedLM

    tokenizer = train_tokenizer(out_dir, FAMILY_TOKENIZERS[model_type], texts)
    torch.manual_seed(seed)
    AutoModelForMaskedLM.from_config(tiny_family_config(model_type, tokenizer)).save_pretrained(out_dir)
    return tokenizer


def train_decoder_tokenizer(out_dir: str, model_type: str, texts: list[str], vocab_size: int = 400):
    """A decoder's tokenizer trained on ``texts`` with the ``tokenizers`` library, framed as
    its family's is: Llama's and Mistral's a SentencePiece-style BPE with byte fallback that
    puts ``<s>`` first and has no pad token; Qwen2's a byte-level BPE with no special token
    added and ``<|endoftext|>`` as its EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if model_type == "qwen2":
        trained = Tokenizer(models.BPE())
        trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trained.decoder = decoders.ByteLevel()
        specials, alphabet = ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet()
    else:
        trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        trained.decoder = decoders.Metaspace(prepend_scheme="first")
        specials, alphabet = ["<unk>", "<s>", "</s>"], []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet)
    trained.train_from_iterator(texts, trainer)
    if model_type == "qwen2":
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=trained, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
        )
        tokenizer_class = "Qwen2Tokenizer"
    else:
        trained.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=trained, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        tokenizer_class = "LlamaTokenizer"  # Mistral's checkpoints use Llama's tokenizer class too
    tokenizer.save_pretrained(out_dir)
    config_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump(config | {"tokenizer_class": tokenizer_class}, f)
    return tokenizer


def tiny_decoder_config(model_type: str, tokenizer, **overrides):
    """A tiny config of a decoder family (2 layers, hidden 32, 4 query heads sharing 2
    key/value heads, as Llama, Mistral and Qwen2 group them)."""
    from transformers import AutoConfig

    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoConfig.for_model(model_type, **(sizes | overrides))


def save_tiny_decoder(out_dir: str, model_type: str, texts: list[str], seed: int = 0, **overrides) -> str:
    """A random tiny ``AutoModelForCausalLM`` of ``model_type`` (its LM head included, as the
    families' checkpoints are) saved with its own tokenizer; returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_decoder_tokenizer(out_dir, model_type, texts)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_decoder_config(model_type, tokenizer, **overrides)).save_pretrained(out_dir)
    return out_dir


def index_of_random_vectors(root, shards: int, per_shard: int, dim: int, factory: str):
    """Random vectors as an embeddings folder of ``shards`` shards (doc ids ``d<row>``) and
    their index of ``factory`` (built on Ray), under ``root``: (index URI, vectors, rows)."""
    import numpy as np

    from pipeline.retrieval import embeddings as emb
    from pipeline.retrieval.faiss_index import IndexConfig
    from pipeline.retrieval.index_build import IndexJobConfig, run_indexing

    vectors = np.random.default_rng(0).standard_normal((shards * per_shard, dim)).astype(np.float32)
    rows = np.arange(len(vectors))
    entries = [
        emb.write_shard(str(root / "emb"), i, rows[s], [f"d{r}" for r in rows[s]], vectors[s])
        for i, s in enumerate(np.split(rows, shards))
    ]
    emb.write_manifest(str(root / "emb"), dim, entries, normalized=False, similarity="dot", model="m")
    run_indexing(
        IndexJobConfig(embeddings=str(root / "emb"), output=str(root / "index"), index=IndexConfig(factory=factory))
    )
    return str(root / "index"), vectors, rows


class SlowS3:
    """moto's S3 on loopback, each request delayed and counted by method."""

    def __init__(self, latency_s: float):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.latency_s, self.counts, self.lock = latency_s, collections.Counter(), threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)

        def delayed(environ, start_response):
            with self.lock:
                self.counts[environ["REQUEST_METHOD"]] += 1
            time.sleep(self.latency_s)
            return app(environ, start_response)

        self.server = make_server("127.0.0.1", 0, delayed, True, request_handler=MotoRequestHandler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def client_env(self) -> dict[str, str]:
        """What a process (a job, a local Ray) needs to use this server as its S3."""
        return {
            "RAY_AUTH_MODE": "disabled",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "rehearsal",
            "AWS_SECRET_ACCESS_KEY": "rehearsal",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def taken(self) -> dict:
        with self.lock:
            counts, self.counts = dict(self.counts), collections.Counter()
        return counts | {"total": sum(counts.values())}


def _status_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def resident_growth(run, *args):
    """``run(*args)``'s result and how far this process's resident memory rose above where it
    stood when the call began, in bytes: the kernel's high-water mark (``VmHWM``), reset to the
    present first. It counts what tracemalloc misses: torch tensors, Arrow buffers, the
    object-store pages a ``ray.get`` result is read from. Freed heap is handed back to the
    kernel first (``malloc_trim``), or a later call could grow into it unseen."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to VmRSS (Linux 4.0+)
    start = _status_kib("VmRSS")
    result = run(*args)
    return result, (_status_kib("VmHWM") - start) << 10


def ours_and_sentence_transformers(export: str, texts: list[str], max_len: int) -> dict:
    """Query and passage vectors of a retriever export, by raydense's encoder (passages from
    their stored token ids, as prepare_corpus stores them) and by ``SentenceTransformer``
    (with its prompts): ``{"ours": (queries, passages), "theirs": (...), "prompts": ...}``."""
    from sentence_transformers import SentenceTransformer

    from pipeline.retrieval.encode import Encoder, EncoderSettings

    ours = Encoder(EncoderSettings(model=export, batch_size=4), export)
    corpus_tokens = ours.tokenizer(texts, add_special_tokens=False)["input_ids"]
    theirs = SentenceTransformer(export, device="cpu")
    return {
        "ours": (ours.encode_texts(texts, max_len, tower="query"), ours.encode_tokens(corpus_tokens, max_len)),
        "theirs": (
            theirs.encode_query(texts, convert_to_numpy=True, batch_size=4),
            theirs.encode_document(texts, convert_to_numpy=True, batch_size=4),
        ),
        "prompts": {k: v for k, v in theirs.prompts.items() if v},  # sentence-transformers adds empty ones
    }


def memory_gib_for_state(params: int, stage: int, workers: int, precision: str = "fp32") -> float:
    """A ``--train.memory_gib`` that holds the model's state (models/memory.py) with a fifth
    to spare and leaves micro-batch sizing nothing for activations (half the memory, less
    the optimiser state it reserves): sized from it, a step runs one row at a time."""
    from models.memory import model_state

    return 1.2 * model_state(params, params, stage, workers, precision).total / 2**30


def side_by_side(real, marks: str, peers: int = 2, wait_s: float = 60.0):
    """``real``, wrapped to record under ``marks`` the process of each call and whether
    ``peers`` calls were under way at once: each call waits (up to ``wait_s``) for the
    others to start before it runs. Calls made one after another never meet. Read back with
    :func:`side_by_side_seen`. Wrap before the code under test makes its Ray tasks (the
    wrapper reaches them by value: ``tests.helpers`` is registered so)."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def call(*args, **kwargs):
        import uuid

        os.makedirs(marks, exist_ok=True)
        mark = os.path.join(marks, uuid.uuid4().hex)
        with open(mark + ".started", "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + wait_s
        while len([m for m in os.listdir(marks) if m.endswith(".started")]) < peers and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(mark + ".met", "w") as f:
            f.write(str(len([m for m in os.listdir(marks) if m.endswith(".started")]) >= peers))
        return real(*args, **kwargs)

    return call


def side_by_side_seen(marks: str) -> tuple[set[int], bool]:
    """The processes :func:`side_by_side` calls ran in, and whether every call met its peers."""
    names = os.listdir(marks)
    pids = {int(open(os.path.join(marks, n)).read()) for n in names if n.endswith(".started")}
    met = all(open(os.path.join(marks, n)).read() == "True" for n in names if n.endswith(".met"))
    return pids, met and any(n.endswith(".met") for n in names)
